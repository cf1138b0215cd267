"""Tensor parallelism on two GPUs, in one call: ``python3 -m bench.tp_bench [--out DIR]`` (also
``python -m bench decoder --preset llama3.1-70b --tp 2``).

This process is only the launcher: it starts one worker process per GPU (ranks 0 and 1, NCCL and a
gloo group for host-side barriers) and a CPU process that compiles the large tapes meanwhile,
relays their output with timestamps, and kills them all (their process groups) if a stage runs past
its time limit or a worker fails. The workers run, in order, stopping at the first failure:

  smoke    small-2layer (d 128) on the two GPUs: the TP layers over 3 calls (receive slots 1, 0, 1)
           against the two-rank tape VM and the TP reference, KV rows as the VM's; the TP decoder
           (vocab 200) against the VM's logits and tokens; both ranks' outputs bitwise equal
  death    rank 1 does not launch: rank 0 must raise MegakernelError within seconds (the wait's time
           bound), naming the counter; rank 1 raises too; then the same handle and a new build step
           correctly
  correct  8 layers of the 70B shape (llama3.1-70b, vocab 128256): TP=2 against a single-GPU megatape
           decoder of the same full weights on GPU 0 and against the fp32 reference (the multi-layer
           criterion of bench/decoder_bench.py); both ranks' logits bitwise equal
  speed    the 80-layer model with random weights generated per shard on each GPU: megatape TP=2
           (one persistent kernel per GPU) and the NCCL baseline (bench/tp_baseline.py: torch ops with
           all-reduces, one CUDA graph per step) over ``--steps`` steps each (median of CUDA events);
           the per-GPU floor: bytes each GPU reads per step over its stream-copy bandwidth measured in
           this run. Writes ``<out>/decoder-<preset>-tp2.json`` and ``.md`` and prints the table.

NVLink multicast stays off: every process gets ``NCCL_NVLS_ENABLE=0`` and
``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` before torch starts (set at the top of this module too).
Every cross-GPU wait in a TP kernel is bounded in time (``--wait-s``) and every host wait has a
timeout.
"""
from __future__ import annotations

import os

#: set before torch initialises CUDA or NCCL, in this process and (by ``child_env``) in every child
SAFE_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
os.environ.update(SAFE_ENV)
assert all(os.environ.get(k) == v for k, v in SAFE_ENV.items())
#: defaults for the children unless the caller set them: symmetric memory's plain CUDA backend (cuMem +
#: IPC handles; not NVSHMEM), gloo's host-side collectives over loopback (both ranks on one host)
DEFAULT_ENV = {"TORCH_SYMMMEM": "CUDA", "GLOO_SOCKET_IFNAME": "lo"}

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import pickle  # noqa: E402
import queue  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

STAGES = ("smoke", "death", "correct", "speed")
#: seconds each stage may take (kernel compiles included: ~20-60 s each on the GPU machine)
STAGE_TIMEOUT_S = {"smoke": 240, "death": 90, "correct": 270, "speed": 270}
TOTAL_TIMEOUT_S = 560
#: from the start to the first stage's BEGIN (imports, NCCL and gloo initialisation)
STARTUP_TIMEOUT_S = 150
#: host-side collectives of the bench (the gloo group's timeout: rank 1 waits while rank 0 runs the
#: single-GPU comparison, a kernel compile included)
HOST_GROUP_TIMEOUT_S = 420
MARK = "@@"
#: the model of every stage of a CPU rehearsal (``--rehearse``)
REHEARSAL_PRESET = "small-2layer-v200"
#: where a CPU rehearsal writes its results unless --out is given (ignored by git: /build/)
REHEARSAL_OUT = "build/tp-rehearsal"


def _repo_root() -> pathlib.Path:
    return pathlib.Path(__file__).resolve().parent.parent


def child_env(extra: dict | None = None) -> dict:
    """The environment of a child process: this one's, the multicast switches, the repository on
    ``PYTHONPATH``, unbuffered output."""
    env = dict(os.environ)
    for k, v in DEFAULT_ENV.items():
        env.setdefault(k, v)
    env.update(SAFE_ENV)
    root = str(_repo_root())
    pp = env.get("PYTHONPATH", "")
    env["PYTHONPATH"] = root + (os.pathsep + pp if pp and root not in pp.split(os.pathsep) else "")
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("TRITON_INTERPRET", None)
    if extra:
        env.update(extra)
    return env


def _check_env() -> None:
    bad = {k: os.environ.get(k) for k, v in SAFE_ENV.items() if os.environ.get(k) != v}
    if bad:
        raise SystemExit(f"refusing to run: {bad} must be {SAFE_ENV} (NVLink multicast stays off)")


def parse_args(argv=None):
    from . import RESULTS
    p = argparse.ArgumentParser(prog="python3 -m bench.tp_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"results directory (default {RESULTS}; with --rehearse {REHEARSAL_OUT}, so a CPU rehearsal "
                   "never writes beside the GPU results)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, in order: {','.join(STAGES)}")
    p.add_argument("--preset", default="llama3.1-70b", help="the whole model of the speed stage (default llama3.1-70b)")
    p.add_argument("--speed-layers", type=int, default=0, help="layers of the speed stage (0: the preset's)")
    p.add_argument("--correct-layers", type=int, default=8, help="layers of the correctness stage (default 8)")
    p.add_argument("--correct-steps", type=int, default=8)
    p.add_argument("--pos", "--prefill", dest="prefill", type=int, default=1024, help="first decode position")
    p.add_argument("--steps", type=int, default=32, help="timed steps of the speed stage (default 32)")
    p.add_argument("--max-seq", type=int, default=1152)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--wait-s", type=float, default=5.0, help="the TP kernels' wait time bound (seconds)")
    p.add_argument("--death-wait-s", type=float, default=2.0, help="the wait time bound in the death stage")
    p.add_argument("--sms", type=int, default=132, help="SMs the precompiled tapes are for (an H200's 132)")
    p.add_argument("--tiling", default="", metavar="K=V,...",
                   help="tiling overrides of the correct and speed stages' tapes, applied to the default "
                        "tiling of a rank's shard (TPLayout.default_tiling), e.g. 'qkv_rows=16'")
    p.add_argument("--no-precompile", action="store_true", help="compile the tapes in the workers")
    p.add_argument("--no-baseline", action="store_true", help="skip the NCCL baseline")
    p.add_argument("--profile", action="store_true",
                   help="speed stage: also the profiling kernel of the same build (3 steps): every instruction's "
                   "record per rank to <out>/tp-records-rank<r>.json.gz, a middle layer's stages in the log")
    p.add_argument("--total-timeout", type=float, default=TOTAL_TIMEOUT_S)
    p.add_argument("--stage-timeout", default="", help="overrides, e.g. 'smoke=300,speed=200'")
    # internal
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--precompile", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
    p.add_argument("--rehearse", action="store_true",
                   help="CPU rehearsal of every stage (tests): gloo instead of NCCL, the Triton interpreter, shared "
                   "files instead of symmetric memory, small-2layer (vocab 200) for every model, short runs")
    a = p.parse_args(argv)
    if a.out is None:
        a.out = REHEARSAL_OUT if a.rehearse else RESULTS
    if a.rehearse:
        a.preset, a.prefill, a.max_seq, a.steps, a.correct_steps, a.no_precompile = REHEARSAL_PRESET, 19, 64, 3, 2, True
    a.stage_list = [s.strip() for s in a.stages.split(",") if s.strip()]
    bad = [s for s in a.stage_list if s not in STAGES]
    if bad or not a.stage_list:
        p.error(f"--stages: unknown {bad}; known: {','.join(STAGES)}")
    if [s for s in STAGES if s in a.stage_list] != a.stage_list:
        p.error(f"--stages: in the order {','.join(STAGES)}")
    if "death" in a.stage_list and "smoke" not in a.stage_list:
        p.error("--stages: death reuses smoke's handle; include smoke")
    a.timeouts = dict(STAGE_TIMEOUT_S)
    for kv in filter(None, a.stage_timeout.split(",")):
        k, _, v = kv.partition("=")
        if k not in STAGES or not v:
            p.error(f"--stage-timeout: expected stage=seconds, got {kv!r}")
        a.timeouts[k] = float(v)
    for name in ("steps", "correct_steps", "correct_layers", "max_seq", "sms"):
        if getattr(a, name) <= 0:
            p.error(f"--{name.replace('_', '-')}: expected a positive integer")
    if a.prefill < 0 or a.prefill + max(a.steps, a.correct_steps) + 4 > a.max_seq:
        p.error(f"--pos / --steps / --max-seq: positions up to pos + steps + 3 must fit max_seq = {a.max_seq}")
    if not 0 < a.wait_s <= 60 or not 0 < a.death_wait_s <= 60:
        p.error("--wait-s / --death-wait-s: seconds in (0, 60]")
    return a


# ---- the launcher -----------------------------------------------------------------------------------
class _Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self) -> str:
        return f"{time.strftime('%H:%M:%S')} +{time.monotonic() - self.t0:6.1f}s"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _relay(name: str, stream, q: queue.Queue) -> None:
    for raw in iter(stream.readline, b""):
        q.put((name, raw.decode("utf-8", "replace").rstrip("\n")))
    q.put((name, None))


def _kill(procs) -> None:
    """SIGTERM, then SIGKILL, to the process group of each child still running (each was started
    in a session of its own, so its group holds it and whatever it started)."""
    alive = [p for p in procs if p.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in alive:
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        t_end = time.monotonic() + 5
        while time.monotonic() < t_end and any(p.poll() is None for p in alive):
            time.sleep(0.1)
        alive = [p for p in alive if p.poll() is None]
        if not alive:
            return


def supervise(workers: dict, helpers: dict, timeouts: dict, total_timeout: float, clock=None, out=None) -> tuple:
    """Relay the children's output (``[name time] line``), follow the stage markers the workers print
    (``@@STAGE <name> BEGIN`` / ``OK <s>`` / ``FAIL <why>``) and stop everything at the first failure:
    a worker exiting with a non-zero status, a stage past its time limit, the total past
    ``total_timeout``. ``workers`` / ``helpers``: name -> Popen (stdout piped); helpers are killed at
    the end, their exit does not matter. Returns (ok, message, {stage: seconds})."""
    clock = clock or _Clock()
    out = out or sys.stdout
    q: queue.Queue = queue.Queue()
    open_streams = set()
    for name, p in {**workers, **helpers}.items():
        threading.Thread(target=_relay, args=(name, p.stdout, q), daemon=True).start()
        open_streams.add(name)
    t0 = time.monotonic()
    stage, stage_t0, done, failed = None, None, {}, None
    everyone = list(workers.values()) + list(helpers.values())

    def finish(ok, msg):
        _kill(everyone)
        t_end = time.monotonic() + 3           # what the children printed last
        while open_streams and time.monotonic() < t_end:
            try:
                name, line = q.get(timeout=0.2)
            except queue.Empty:
                continue
            if line is None:
                open_streams.discard(name)
            else:
                print(f"[{name} {clock()}] {line}", file=out, flush=True)
        return ok, msg, done

    def take(name, line):
        """One relayed line (None: the stream ended): printed, and the stage markers followed."""
        nonlocal stage, stage_t0, failed
        if line is None:
            open_streams.discard(name)
            return
        print(f"[{name} {clock()}] {line}", file=out, flush=True)
        if line.startswith(MARK + "STAGE ") and name in workers:
            parts = line.split(maxsplit=3)
            st, what = parts[1], parts[2] if len(parts) > 2 else ""
            if what == "BEGIN" and st != stage:
                stage, stage_t0 = st, time.monotonic()
            elif what == "OK":
                done[st] = time.monotonic() - (stage_t0 or t0)
            elif what == "FAIL":
                failed = (st, parts[3] if len(parts) > 3 else "")

    while True:
        try:
            name, line = q.get(timeout=0.25)
        except queue.Empty:
            name = None
        if name is not None:
            take(name, line)
        now = time.monotonic()
        for wname, p in workers.items():
            rc = p.poll()
            if rc is not None and rc != 0:
                # the worker's last lines (its FAIL reason) may still be in the relay: read its
                # stream to its end first (bounded), so the reason is not lost to the exit's timing
                t_end = time.monotonic() + 3
                while wname in open_streams and time.monotonic() < t_end:
                    try:
                        take(*q.get(timeout=0.1))
                    except queue.Empty:
                        pass
                why = f"stage {failed[0]} failed on {wname}: {failed[1]}" if failed else \
                    f"{wname} exited with status {rc}" + (f" during stage {stage}" if stage else "")
                return finish(False, why)
        if all(p.poll() == 0 for p in workers.values()) and not (open_streams & set(workers)):
            return finish(True, "all stages passed")
        if stage is not None and stage not in done and now - stage_t0 > timeouts.get(stage, total_timeout):
            return finish(False, f"stage {stage} ran past its time limit of {timeouts[stage]:.0f} s: killed")
        if stage is None and now - t0 > timeouts.get("startup", STARTUP_TIMEOUT_S):
            return finish(False, f"the workers did not start their first stage within "
                          f"{timeouts.get('startup', STARTUP_TIMEOUT_S):.0f} s (imports, NCCL): killed")
        if now - t0 > total_timeout:
            return finish(False, f"the run passed its total time limit of {total_timeout:.0f} s"
                          + (f" (in stage {stage})" if stage else "") + ": killed")


def launch(a) -> int:
    """Start the workers (and the tape precompile), supervise them, print the summary."""
    clock = _Clock()

    def say(msg):
        print(f"[launcher {clock()}] {msg}", flush=True)

    _check_env()
    t_start = time.time()
    a.out = str(pathlib.Path(a.out).resolve())
    say(f"tp_bench: stages {','.join(a.stage_list)}; total limit {a.total_timeout:.0f} s; env "
        + " ".join(f"{k}={os.environ[k]}" for k in SAFE_ENV))
    work = pathlib.Path(tempfile.mkdtemp(prefix="megatape-tp-"))
    port = _free_port()
    common = (["--rehearse"] if a.rehearse else []) + ["--workdir", str(work), "--out", a.out, "--stages", ",".join(a.stage_list), "--preset", a.preset,
              "--speed-layers", str(a.speed_layers), "--correct-layers", str(a.correct_layers),
              "--correct-steps", str(a.correct_steps), "--pos", str(a.prefill), "--steps", str(a.steps),
              "--max-seq", str(a.max_seq), "--seed", str(a.seed), "--wait-s", str(a.wait_s),
              "--death-wait-s", str(a.death_wait_s), "--sms", str(a.sms), "--tiling", a.tiling] + \
        (["--no-baseline"] if a.no_baseline else []) + (["--no-precompile"] if a.no_precompile else []) + \
        (["--profile"] if a.profile else [])
    me = [sys.executable, "-m", "bench.tp_bench"]
    helpers, workers = {}, {}
    popen = dict(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=str(_repo_root()), start_new_session=True)
    try:
        if not a.no_precompile and ({"correct", "speed"} & set(a.stage_list)):
            helpers["precompile"] = subprocess.Popen(me + ["--precompile"] + common,
                                                     env=child_env({"CUDA_VISIBLE_DEVICES": ""}), **popen)
        for r in range(2):
            env = child_env({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(r),
                             "WORLD_SIZE": "2", "LOCAL_RANK": str(r)})
            workers[f"rank{r}"] = subprocess.Popen(me + ["--worker", "--rank", str(r), "--port", str(port)] + common,
                                                   env=env, **popen)
        ok, msg, done = supervise(workers, helpers, a.timeouts, a.total_timeout, clock)
    except BaseException:
        _kill(list(workers.values()) + list(helpers.values()))
        raise
    import shutil
    shutil.rmtree(work, ignore_errors=True)
    for st in a.stage_list:
        say(f"  {st:8s} " + (f"ok in {done[st]:.1f} s" if st in done else "not passed"))
    md = pathlib.Path(a.out) / f"decoder-{a.preset}-tp2.md"
    if "speed" in a.stage_list and md.exists() and md.stat().st_mtime >= t_start:
        print("\n" + md.read_text(), flush=True)
    say(("PASSED: " if ok else "FAILED: ") + msg + f" (total {clock().split('+')[1].strip()})")
    return 0 if ok else 1


# ---- the tape precompile (a CPU process beside the workers) -------------------------------------------
def _rehearsal_cfg():
    import dataclasses

    from opcodes import PRESETS
    return dataclasses.replace(PRESETS["small-2layer"], vocab=200, name=REHEARSAL_PRESET)


def _speed_cfg(a):
    from opcodes import ModelConfig
    if a.rehearse:
        return _rehearsal_cfg()
    cfg = ModelConfig.from_name(a.preset)
    if not cfg.vocab:
        raise SystemExit(f"--preset {a.preset}: not a whole model (no vocabulary)")
    return cfg.with_layers(a.speed_layers) if a.speed_layers else cfg


def _correct_cfg(a):
    from opcodes import ModelConfig
    if a.rehearse:
        return _rehearsal_cfg()
    return ModelConfig.from_name(a.preset).with_layers(a.correct_layers)


def tp_tiling(a, cfg):
    """The ``--tiling`` overrides applied to the default tiling of a rank's shard of ``cfg``
    (``TPLayout.default_tiling``; None: that default)."""
    if not a.tiling:
        return None
    from opcodes import Tiling
    from opcodes.tp import TPLayout, shard_config
    return TPLayout.default_tiling(shard_config(cfg, 0, 2), **Tiling.parse_spec(a.tiling))


def _tape_file(work: str, key: str) -> pathlib.Path:
    return pathlib.Path(work) / f"tapes-{key}.pkl"


def save_tapes(path: pathlib.Path, tapes, meta: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        pickle.dump({"meta": meta, "tapes": list(tapes)}, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)


def precompile(a) -> int:
    """Compile (and verify: ``compile_model`` runs ``verify_tp``) both ranks' tapes of the correctness
    and the speed stages for ``--sms`` SMs, each into ``<workdir>/tapes-<key>.pkl``."""
    from schedule import compile_model
    jobs = []
    if "correct" in a.stage_list:
        jobs.append(("correct", _correct_cfg(a)))
    if "speed" in a.stage_list:
        jobs.append(("speed", _speed_cfg(a)))
    for key, cfg in jobs:
        t0 = time.perf_counter()
        try:
            c = compile_model(cfg, a.sms, max_seq=a.max_seq, tiling=tp_tiling(a, cfg), tp=2)
        except Exception as e:           # the workers compile themselves
            (pathlib.Path(a.workdir) / f"tapes-{key}.failed").write_text(repr(e))
            print(f"precompile {key}: failed: {e!r}", flush=True)
            continue
        save_tapes(_tape_file(a.workdir, key), c.tapes,
                   dict(cfg=cfg.to_dict(), max_seq=a.max_seq, num_sms=a.sms, tiling=a.tiling, verified=True))
        print(f"precompile {key}: {cfg.layers} layers, {len(c.tapes[0])} + {len(c.tapes[1])} instructions on "
              f"{a.sms} SMs per rank, verified, in {time.perf_counter() - t0:.1f} s", flush=True)
    return 0


# ---- the workers -----------------------------------------------------------------------------------
class Ctx:
    """What a worker's stages share."""

    def __init__(self, a, rank, dev, hg, log):
        self.a, self.rank, self.dev, self.hg, self.log = a, rank, dev, hg, log
        self.state: dict = {}
        self.results: dict = {}


def _sms(dev) -> int:
    import torch
    return torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class _Timer:
    """Per-step times in us: CUDA events around each step on a GPU (the steps issued back to back),
    the host clock in a CPU rehearsal."""

    def __init__(self, dev, n: int):
        import torch
        self.dev, self.cuda = dev, dev.type == "cuda"
        self.evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                    for _ in range(n)] if self.cuda else []
        self.host: list = []

    def run(self, fn, n: int) -> tuple:
        """(per-step us, wall us per step) of ``fn(i)`` for i < n."""
        _sync(self.dev)
        tw = time.perf_counter()
        for i in range(n):
            if self.cuda:
                self.evs[i][0].record()
                fn(i)
                self.evs[i][1].record()
            else:
                t0 = time.perf_counter()
                fn(i)
                self.host.append((time.perf_counter() - t0) * 1e6)
        _sync(self.dev)
        wall = (time.perf_counter() - tw) / n * 1e6
        return ([s.elapsed_time(e) * 1e3 for s, e in self.evs] if self.cuda else self.host), wall


def _file_alloc(workdir: str):
    """Symmetric memory's stand-in in a CPU rehearsal: each rank's buffer a shared file both map."""
    n = [0]

    def alloc(total, device, rank, group, hg):
        import torch
        import torch.distributed as dist
        k = n[0]
        n[0] += 1
        paths = [pathlib.Path(workdir) / f"symm{k}-{q}.bin" for q in range(2)]
        with open(paths[rank], "wb") as f:
            f.truncate(total)
        dist.barrier(group=hg)
        return (torch.from_file(str(paths[rank]), shared=True, size=total, dtype=torch.uint8),
                torch.from_file(str(paths[1 - rank]), shared=True, size=total, dtype=torch.uint8), None)
    return alloc


def _to(obj, dev):
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.to(dev)
    if isinstance(obj, dict):
        return {k: _to(v, dev) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(v, dev) for v in obj)
    return obj


def _clone_cache(kv):
    return [tuple(t.clone() for t in p) for p in kv]


def _gather(c: Ctx, obj) -> list:
    import torch.distributed as dist
    out = [None, None]
    dist.all_gather_object(out, obj, group=c.hg)
    return out


def _barrier(c: Ctx, timeout_s: float = HOST_GROUP_TIMEOUT_S) -> None:
    import torch.distributed as dist
    dist.monitored_barrier(group=c.hg, timeout=datetime.timedelta(seconds=timeout_s))


def _require(cond, msg: str) -> None:
    if not cond:
        raise AssertionError(msg)


def _same_on_both(c: Ctx, t, what: str) -> None:
    """Both ranks hold bitwise the same tensor ``t`` (gathered to the CPU)."""
    import torch
    both = _gather(c, t.detach().to("cpu", copy=True))
    _require(torch.equal(both[0], both[1]),
             f"{what}: the ranks' tensors differ (max |diff| {float((both[0].float() - both[1].float()).abs().max()):.3e})")


def _digest(ts) -> list:
    """Shape and sums of about a million evenly spaced elements of each tensor (deterministic on a
    given GPU model): equal on both ranks iff they generated the same values, all but surely."""
    out = []
    for t in ts:
        v = t.reshape(-1)[::max(1, t.numel() // (1 << 20))].double()
        out.append((tuple(t.shape), float(v.sum()), float(v.pow(2).sum())))
    return out


def _load_tapes(c: Ctx, key: str, cfg, wait_s: float):
    """Both ranks' tapes of ``cfg`` from the precompile (waiting up to ``wait_s``), or None (then the
    build compiles them: ``compile_model`` in the worker)."""
    a = c.a
    sms = _sms(c.dev)
    if a.no_precompile:
        return None
    if sms != a.sms:
        c.log(f"the GPU has {sms} SMs, the precompiled tapes are for {a.sms}: compiling here")
        return None
    path, failed = _tape_file(a.workdir, key), pathlib.Path(a.workdir) / f"tapes-{key}.failed"
    t_end = time.monotonic() + wait_s
    while not path.exists() and not failed.exists() and time.monotonic() < t_end:
        time.sleep(0.5)
    if not path.exists():
        c.log(f"no precompiled {key} tapes ({'failed' if failed.exists() else 'not ready'}): compiling here")
        return None
    with open(path, "rb") as f:
        d = pickle.load(f)
    m = d["meta"]
    if m["cfg"] != cfg.to_dict() or m["max_seq"] != a.max_seq or m["num_sms"] != sms or m["tiling"] != a.tiling:
        c.log(f"the precompiled {key} tapes are for another model: compiling here")
        return None
    return d["tapes"]


def stage_smoke(c: Ctx) -> None:
    import dataclasses

    import torch
    import torch.distributed as dist

    from interp.tp import build_tp_decoder, build_tp_layers, tokens, tp_decode_step, tp_generate, tp_layer_step, tp_teardown
    from opcodes import PRESETS
    from opcodes.reference import make_kv_cache, make_weights, rel_err
    from opcodes.tp import shard_kv_cache, shard_weights, tp_model_ref
    from schedule import compile_model
    from schedule.vm import run_tp, run_tp_decoder

    from interp.sync import clock_probe

    from .decoder_bench import make_decoder_weights
    a, r, dev, log = c.a, c.rank, c.dev, c.log
    # the clock that bounds every TP wait in time measures time (globaltimer in ns on the GPU)
    dk, dh = clock_probe(dev, 0.2)
    log(f"the wait clock advanced {dk:.3f} s while the host's advanced {dh:.3f} s (0.2 s apart)")
    _require(0.1 <= dk <= dh + 0.05, f"the wait clock (globaltimer) advanced {dk:.3f} s in {dh:.3f} s of host time: "
             "the time bound of the TP waits would not hold")
    cfg = PRESETS["small-2layer"]
    MAX_SEQ, POS, CALLS = 64, 19, 3
    sms, seq = _sms(dev), dev.type == "cpu"
    w = make_weights(cfg, seed=0)
    kv = make_kv_cache(cfg, MAX_SEQ, POS, seed=1)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    comp = compile_model(cfg, sms, max_seq=MAX_SEQ, decoder=False, tp=2, sequential=seq)
    shard = _to(shard_weights(w, cfg, r, 2), dev)
    cache = _to(shard_kv_cache(kv, cfg, r, 2), dev)
    t0 = time.perf_counter()
    h = build_tp_layers(shard, cache, cfg, MAX_SEQ, tapes=comp.tapes, verify_tapes=False, tp_group=dist.group.WORLD,
                        host_group=c.hg, wait_s=a.wait_s)
    k = h.layer
    log(f"layers built in {time.perf_counter() - t0:.1f} s: {len(k.tape)} instructions on {k.num_sms} SMs, "
        f"{k.resources.get('n_regs')} registers, {k.resources.get('n_spills')} spills, shared {k.resources.get('shared')}")
    kv_vm = _clone_cache(kv)
    vm = run_tp(comp.tapes, w, kv_vm, x, POS, calls=CALLS, return_all=True)
    ref_shards = [shard_weights(w, cfg, q, 2) for q in range(2)]
    ref_caches = [shard_kv_cache(_clone_cache(kv), cfg, q, 2) for q in range(2)]
    xin, xref, worst = x.to(dev), x, (0.0, 0.0)
    for call in range(CALLS):
        out = tp_layer_step(h, xin, POS + call)
        _same_on_both(c, out, f"layers, call {call + 1}")
        got = out.cpu()
        xref = tp_model_ref(ref_shards, ref_caches, cfg, xref, POS + call)
        e_vm, e_ref = rel_err(got, vm[call][0]), rel_err(got, xref)
        # twice the CPU tests' tolerances (the CPU kernel: ~5e-3 / ~7e-3): a wiring error is O(1)
        _require(e_vm <= 2e-2, f"layers, call {call + 1}: rel err {e_vm:.3e} against the two-rank VM (> 2e-2)")
        _require(e_ref <= 3e-2, f"layers, call {call + 1}: rel err {e_ref:.3e} against the TP reference (> 3e-2)")
        worst = (max(worst[0], e_vm), max(worst[1], e_ref))
        if call == 0:
            c.state["smoke_first"] = got
        xin = out
    a0 = r * cfg.n_kv // 2
    for l in range(cfg.layers):
        for j in range(2):
            mine = cache[l][j].cpu()
            want = kv_vm[l][j][:, a0:a0 + cfg.n_kv // 2]
            e = rel_err(mine[:, :, POS:POS + CALLS], want[:, :, POS:POS + CALLS])
            _require(e <= 3e-2, f"KV rows of layer {l} ({'kv'[j]}): rel err {e:.3e} against the VM's")
            _require(torch.equal(mine[:, :, :POS], shard_kv_cache(kv, cfg, r, 2)[l][j][:, :, :POS]),
                     f"KV rows before {POS} of layer {l} changed")
    log(f"layers: {CALLS} calls, ranks bitwise equal; max rel err {worst[0]:.2e} vs the VM, {worst[1]:.2e} vs the "
        "TP reference; KV rows as the VM's")
    c.state["smoke"] = dict(h=h, w=w, kv=kv, cfg=cfg, MAX_SEQ=MAX_SEQ, POS=POS, x=x)
    # the whole model
    cv = dataclasses.replace(cfg, vocab=200, name="small-2layer-v200")
    wv = make_decoder_weights(cv, 0, "cpu", tied=False)
    kvv = make_kv_cache(cv, MAX_SEQ, POS, seed=1)
    compv = compile_model(cv, sms, max_seq=MAX_SEQ, tp=2, sequential=seq)
    t0 = time.perf_counter()
    hd = build_tp_decoder(_to(shard_weights(wv, cv, r, 2), dev), _to(shard_kv_cache(kvv, cv, r, 2), dev), cv, MAX_SEQ,
                          tapes=compv.tapes, verify_tapes=False, tp_group=dist.group.WORLD, host_group=c.hg,
                          wait_s=a.wait_s)
    log(f"decoder built in {time.perf_counter() - t0:.1f} s: {len(hd.tape)} instructions")
    try:
        vmd = run_tp_decoder(compv.tapes, wv, _clone_cache(kvv), 17, POS, calls=CALLS, return_all=True)
        lg = tp_decode_step(hd, 17, POS)
        e0 = rel_err(lg.cpu(), torch.cat(vmd[0][0], -1))
        _require(e0 <= 4e-2, f"decoder, call 1: logits rel err {e0:.3e} against the VM (> 4e-2)")
        _same_on_both(c, lg, "decoder logits, call 1")
        t1 = tokens(hd)
        _require(t1[0] == t1[1], f"decoder: the ranks' tokens differ: {t1}")
        new = tp_generate(hd, [t1[0]], CALLS - 1, start_pos=POS + 1)
        _same_on_both(c, hd.hidden, "decoder final residual, call 3")
        vm_toks = [vmd[q][1] for q in range(CALLS)]
        got_toks = [t1[0]] + new
        log(f"decoder: logits rel err {e0:.2e} vs the VM at call 1; tokens {got_toks} (VM {vm_toks}); ranks bitwise "
            "equal")
        if got_toks != vm_toks:
            log(f"WARNING: the greedy tokens differ from the VM's ({got_toks} vs {vm_toks}): near-tied logits?")
    finally:
        tp_teardown(hd)


def stage_death(c: Ctx) -> None:
    import torch
    import torch.distributed as dist

    from interp.runtime import MegakernelError
    from interp.tp import build_tp_layers, set_wait, tp_layer_step, tp_teardown
    from opcodes.reference import make_kv_cache, rel_err
    from opcodes.tp import shard_kv_cache, shard_weights, tp_model_ref
    a, r, dev, log = c.a, c.rank, c.dev, c.log
    s = c.state.pop("smoke")
    h, w, cfg, MAX_SEQ, POS, x = s["h"], s["w"], s["cfg"], s["MAX_SEQ"], s["POS"], s["x"]
    try:
        set_wait(h, a.death_wait_s)
        log(f"rank 1 does not launch; the wait bound is {a.death_wait_s:g} s")
        t0 = time.monotonic()
        err = None
        try:
            tp_layer_step(h, x.to(dev), POS, launch=(r == 0))
        except MegakernelError as e:
            err = e
        dt = time.monotonic() - t0
        _require(err is not None, "no MegakernelError: a step whose peer never launched completed")
        msg = str(err)
        head = "\n".join(msg.splitlines()[:5])
        log(f"MegakernelError after {dt:.2f} s:\n{head}")
        _require("rank 0" in msg, "the error does not name rank 0")
        if r == 0:
            # the time bound itself is checked on the GPU only: a CPU rehearsal's time is the host's load
            # (the bound that stopped it is named in the message, below, in both)
            _require(a.rehearse or dt <= a.death_wait_s + 20, f"rank 0 raised after {dt:.1f} s (bound {a.death_wait_s:g} s)")
            _require("waited on counter" in msg, "rank 0's error does not name the counter")
            _require(any("recv" in str(row[4]) for row in err.stuck),
                     "no SM of rank 0 stopped on a receive counter (one its peer signals)")
            _require("time bound" in msg or "polls" in msg, "rank 0's error does not say which bound stopped it")
            _require(err.stuck and all(row[0] == 0 for row in err.stuck), "stuck rows of a rank other than 0")
        _require(h.calls == 0 and int(h.layer.counters.abs().sum()) == 0, "the counters were not reset")
        set_wait(h, a.wait_s)
        out = tp_layer_step(h, x.to(dev), POS)            # the same handle steps again
        _same_on_both(c, out, "the step after the failure")
        ref = tp_model_ref([shard_weights(w, cfg, q, 2) for q in range(2)],
                           [shard_kv_cache(make_kv_cache(cfg, MAX_SEQ, POS, seed=1), cfg, q, 2) for q in range(2)],
                           cfg, x, POS)
        e = rel_err(out.cpu(), ref)
        _require(e <= 3e-2, f"the step after the failure: rel err {e:.3e} against the TP reference")
        same_first = torch.equal(out.cpu(), c.state.get("smoke_first", out.cpu()))
        log(f"the same handle steps again: ranks bitwise equal, rel err {e:.2e} vs the TP reference, "
            f"{'bitwise' if same_first else 'NOT bitwise'} the smoke stage's first call")
    finally:
        tp_teardown(h)
    kv2 = make_kv_cache(cfg, MAX_SEQ, POS, seed=1)
    h2 = build_tp_layers(_to(shard_weights(w, cfg, r, 2), dev), _to(shard_kv_cache(kv2, cfg, r, 2), dev), cfg, MAX_SEQ,
                         tp_group=dist.group.WORLD, host_group=c.hg, wait_s=a.wait_s)
    try:
        out2 = tp_layer_step(h2, x.to(dev), POS)
        _same_on_both(c, out2, "a new build's step")
        e2 = rel_err(out2.cpu(), out.cpu())
        _require(e2 <= 2e-2, f"a new build's step: rel err {e2:.3e} against the old handle's")
        log(f"a new build steps: ranks bitwise equal, {'bitwise equal to' if e2 == 0 else f'rel err {e2:.2e} from'} "
            "the old handle's step")
    finally:
        tp_teardown(h2)


def stage_correct(c: Ctx) -> None:
    import torch

    from interp.decoder import build_decoder, decode_step, teardown_decoder
    from interp.tp import tokens, tp_decode_step, tp_teardown
    from opcodes.reference import make_kv_cache, rel_err
    from opcodes.tp import shard_kv_cache, shard_weights

    from .decoder_bench import check_steps, make_decoder_weights
    a, r, dev, log = c.a, c.rank, c.dev, c.log
    cfg = _correct_cfg(a)
    steps, P = a.correct_steps, a.prefill
    t0 = time.perf_counter()
    w = make_decoder_weights(cfg, a.seed, dev, tied=False)
    kv = make_kv_cache(cfg, a.max_seq, P, seed=a.seed + 1, device=dev)
    dig = _digest([w["embed"], w["lm_head"], w["layers"][0]["q"], w["layers"][-1]["down"], kv[0][0], kv[-1][1]])
    dg = _gather(c, dig)
    _require(dg[0] == dg[1], "the full weights generated on the two GPUs differ (same seed)")
    shard = shard_weights(w, cfg, r, 2)
    cache = shard_kv_cache(kv, cfg, r, 2)
    kv_before = _clone_cache(kv) if r == 0 else None
    if r != 0:
        del w, kv
    else:
        del kv
    torch.cuda.empty_cache()
    log(f"{cfg.name}: weights generated on each GPU in {time.perf_counter() - t0:.1f} s (identical on both ranks)")
    h = _build_rank(c, shard, cache, cfg, _load_tapes(c, "correct", cfg, wait_s=120))
    toks = torch.randint(0, cfg.vocab, (steps,), generator=torch.Generator().manual_seed(a.seed + 3))
    tp_logits, tp_tok = [], []
    try:
        for i in range(steps):
            lg = tp_decode_step(h, int(toks[i]), P + i)
            _same_on_both(c, h.hidden, f"the final residual at step {i}")
            tt = tokens(h)
            _require(tt[0] == tt[1], f"step {i}: the ranks' greedy tokens differ: {tt}")
            tp_tok.append(tt[0])
            if r == 0:
                tp_logits.append(lg.cpu())
    finally:
        tp_teardown(h)
    del shard, cache
    torch.cuda.empty_cache()
    log(f"TP: {steps} steps at positions {P}..{P + steps - 1}; ranks bitwise equal (final residual, tokens)")
    if r == 0:
        t0 = time.perf_counter()
        kv = _clone_cache(kv_before)
        dh = build_decoder(w, kv, cfg, a.max_seq)
        log(f"single-GPU decoder built in {time.perf_counter() - t0:.1f} s: {len(dh.layer.tape)} instructions")
        one = []
        try:
            for i in range(steps):
                one.append(decode_step(dh, toks[i:i + 1].to(torch.int32).to(dev), P + i).cpu())
            dh.layer.check()
        finally:
            teardown_decoder(dh)
        del kv
        errs = [rel_err(t, o) for t, o in zip(tp_logits, one)]
        agree = sum(int(torch.argmax(t) == torch.argmax(o)) for t, o in zip(tp_logits, one))
        it_tp, it_one = iter(tp_logits), iter(one)
        acc_tp = check_steps(lambda tk, p: next(it_tp).to(dev), w, _clone_cache(kv_before), cfg, toks, P)
        acc_one = check_steps(lambda tk, p: next(it_one).to(dev), w, _clone_cache(kv_before), cfg, toks, P)
        log(f"TP vs single-GPU megatape: logits max rel err {max(errs):.2e}, greedy equal at {agree}/{steps} steps")
        for name, acc in (("TP=2", acc_tp), ("single GPU", acc_one)):
            log(f"{name}: vs fp32 max rel err {acc['rel_err_vs_fp32_max']:.2e} (the bf16 reference "
                f"{acc['bf16_ref_vs_fp32_max']:.2e}); criterion {'met' if acc['criterion_met'] else 'NOT MET'} "
                f"({acc['criterion']}); greedy = fp32's at {acc['greedy_agree_decisive']}/{acc['decisive_steps']} "
                "decisive steps")
        e_bf16 = acc_tp.pop("errs")
        acc_one.pop("errs")
        c.results["accuracy"] = dict(acc_tp, layers=cfg.layers, steps=steps, ranks_bitwise_equal=True,
                                     logits_rel_err_max_vs_bf16_ref=max(e_bf16),
                                     tp_vs_single_gpu_rel_err_max=max(errs), tp_vs_single_gpu_greedy_same=agree,
                                     single_gpu=dict(rel_err_vs_fp32_max=acc_one["rel_err_vs_fp32_max"],
                                                     criterion_met=acc_one["criterion_met"]),
                                     greedy_same=agree, greedy_n=steps,
                                     note=f"{cfg.layers} layers of the {a.preset} shape (the depth one GPU holds "
                                          "beside its shards): TP=2 against a single-GPU megatape run of the same "
                                          "full weights and against the fp32 reference")
        # only a gross error stops the run (a wrong shard, wiring or reduction is off by O(1)); a marginal
        # one is reported and the speed stage still runs
        _require(max(errs) <= 0.15, f"TP vs single-GPU megatape: logits rel err {max(errs):.3e} (> 0.15)")
        _require(acc_tp["rel_err_vs_fp32_max"] <= 5 * acc_tp["bf16_ref_vs_fp32_max"] + 1e-3,
                 "TP=2 is far from the fp32 reference (more than 5x the bf16 reference's own error)")
        if max(errs) > 5e-2:
            log(f"WARNING: TP vs single-GPU megatape differ by {max(errs):.2e} (> 5e-2)")
        if not acc_tp["criterion_met"]:
            log("WARNING: TP=2 does NOT meet the fp32 criterion (reported in the JSON; the run goes on)")
        del w, kv_before
    torch.cuda.empty_cache()
    _barrier(c)


def _shard_random(cfg, rank: int, seed: int, dev):
    """Rank ``rank``'s shard of a random model of ``cfg``, generated on ``dev``: its own matrices from
    a rank seed, the replicated tensors (norms, embedding, final norm) from a shared one."""
    import math

    import torch

    from opcodes.reference import make_weights
    from opcodes.tp import shard_config
    sc = shard_config(cfg, rank, 2)
    w = make_weights(sc, seed=seed + 101 * (rank + 1), device=dev)
    g = torch.Generator(device=dev).manual_seed(seed + 7)
    for lw in w["layers"]:
        for k in ("in_norm", "post_norm"):
            lw[k] = (1.0 + 0.1 * torch.randn(cfg.d, generator=g, device=dev)).to(torch.bfloat16)
    w["embed"] = torch.randn(cfg.vocab, cfg.d, generator=g, device=dev).to(torch.bfloat16)
    w["final_norm"] = (1.0 + 0.1 * torch.randn(cfg.d, generator=g, device=dev)).to(torch.bfloat16)
    gl = torch.Generator(device=dev).manual_seed(seed + 13 + rank)
    w["lm_head"] = (torch.randn(cfg.vocab // 2, cfg.d, generator=gl, device=dev) / math.sqrt(cfg.d)).to(torch.bfloat16)
    w["tp"] = {"rank": rank, "size": 2, "full": cfg.to_dict()}
    return w


def shard_bytes_per_step(cfg, pos: int) -> int:
    """HBM bytes one GPU of TP=2 reads per decode step at ``pos``: its shard of every layer (the
    replicated norms included), its KV heads' rows ``0..pos``, one embedding row, the final norm and
    its half of the LM head."""
    from opcodes.tp import shard_config
    sc = shard_config(cfg, 0, 2)
    return cfg.layers * (sc.layer_weight_bytes() + sc.kv_bytes(pos + 1)) + (cfg.vocab // 2) * cfg.d * 2 + 2 * cfg.d * 2


def _median(xs):
    import statistics
    return float(statistics.median(xs))


def stage_speed(c: Ctx) -> None:
    import torch
    import torch.distributed as dist

    from interp.tp import tp_check, tp_decode_step, tp_launch, tp_teardown
    from opcodes.reference import make_kv_cache, rel_err
    from opcodes.tp import shard_config

    from megatape.measure import stream_copy_bandwidth
    from .tp_baseline import TPTorchDecoder, capture_step, nccl_collectives
    a, r, dev, log = c.a, c.rank, c.dev, c.log
    cfg = _speed_cfg(a)
    P, N = a.prefill, a.steps
    pos_last = P + N - 1
    bw = stream_copy_bandwidth(dev) if dev.type == "cuda" else stream_copy_bandwidth(dev, nbytes=1 << 24, iters=3)
    nbytes = shard_bytes_per_step(cfg, pos_last)
    floor_us = nbytes / bw * 1e6
    log(f"{cfg.name}: {nbytes} bytes per GPU per step at pos {pos_last}; stream copy {bw / 1e12:.3f} TB/s; floor "
        f"{floor_us:.1f} us")
    t0 = time.perf_counter()
    w = _shard_random(cfg, r, a.seed, dev)
    kv = make_kv_cache(shard_config(cfg, r, 2), a.max_seq, P, seed=a.seed + 201 + r, device=dev)
    dg = _gather(c, _digest([w["embed"], w["final_norm"], w["layers"][0]["in_norm"], w["layers"][-1]["post_norm"]]))
    _require(dg[0] == dg[1], "the replicated tensors differ between the ranks")
    _sync(dev)
    log(f"random shard generated in {time.perf_counter() - t0:.1f} s"
        + (f"; {torch.cuda.memory_allocated(dev) / 2**30:.1f} GiB allocated" if dev.type == "cuda" else ""))
    tapes = _load_tapes(c, "speed", cfg, wait_s=200)
    h = _build_rank(c, w, kv, cfg, tapes)
    tok0 = 1234 % (cfg.vocab - 3)
    try:
        lg_mt = tp_decode_step(h, tok0, P)                 # checked steps
        for i in range(1, 3):
            tp_decode_step(h, tok0 + i, P + i)
        _same_on_both(c, h.hidden, "the final residual (checked steps)")
        _require(bool(torch.isfinite(lg_mt).all()), "megatape's logits are not finite")
        timer = _Timer(dev, N)
        _sync(dev)
        _barrier(c)
        t_win = time.time()
        us_mt, wall_mt = timer.run(lambda i: tp_launch(h, P + i), N)
        t_win = [t_win, time.time()]       # the timed steps' window (epoch s): bench.ab_table --clocks
        tp_check(h)
        _same_on_both(c, h.hidden, "the final residual (timed steps)")
        log(f"megatape TP=2: median {_median(us_mt):.1f} us/step (events; min {min(us_mt):.1f}, max {max(us_mt):.1f}); "
            f"wall {wall_mt:.1f} us/step over {N} steps")
    finally:
        tp_teardown(h)
    torch.cuda.empty_cache()
    rec = dict(bw=bw, floor_us=floor_us, bytes=nbytes, us_mt=_median(us_mt), wall_mt=wall_mt, window=t_win)
    got = _gather(c, rec)
    if r == 0:
        _write_results(c, cfg, got)                # megatape's numbers, before the baseline runs
    if a.profile:
        _profile_speed(c, w, kv, cfg, tapes, tok0, P)
    if not a.no_baseline:
        # The baseline's collectives are NCCL kernels, which wait for the peer without a bound: the
        # ranks agree that each part worked before the next one issues collectives (a rank that
        # failed alone would leave its peer spinning until the launcher's stage limit).
        all_reduce, all_gather = nccl_collectives(dist.group.WORLD)
        model = TPTorchDecoder(w, kv, cfg, r, a.max_seq, all_reduce, all_gather)
        model.set(tok0, P)
        model.step()
        lg_nccl = model.logits_full()
        _sync(dev)
        e_nccl = rel_err(lg_nccl, lg_mt)
        log(f"NCCL baseline: logits rel err {e_nccl:.2e} against megatape's at position {P} (same token, same shard)")
        _require(bool(torch.isfinite(lg_nccl).all()), "the NCCL baseline's logits are not finite")
        model.set(tok0, P)
        g, why = None, None
        try:
            if dev.type != "cuda":
                raise RuntimeError("no CUDA graphs in a CPU rehearsal")
            g = capture_step(model)
        except Exception as e:
            why = f"{type(e).__name__}: {e}"
        whys = _gather(c, why)
        if any(whys):
            log(f"NCCL baseline: the CUDA graph capture failed "
                f"({'; '.join(f'rank {q}: {x.splitlines()[0]}' for q, x in enumerate(whys) if x)}); "
                "timing the eager steps instead")
        model.set(tok0, P)
        run = g.replay if not any(whys) else model.step
        timer = _Timer(dev, N)
        _sync(dev)
        _barrier(c)
        us_n, wall_n = timer.run(lambda i: run(), N)
        what = "CUDA graph" if not any(whys) else "eager, no graph"
        log(f"NCCL baseline ({what}): median {_median(us_n):.1f} us/step (events), wall {wall_n:.1f} us/step")
        _barrier(c)
        nk = _count_kernels_once(run, dev)
        log(f"NCCL baseline: {nk} kernels per step" if nk else "NCCL baseline: kernel count unavailable")
        rec.update(us_nccl=_median(us_n), wall_nccl=wall_n, kernels_nccl=nk, nccl_rel_err=e_nccl, nccl_graph=not any(whys))
        del g, model
        got = _gather(c, rec)
        if r == 0:
            _write_results(c, cfg, got)
    del w, kv
    torch.cuda.empty_cache()


def _build_rank(c: Ctx, w, kv, cfg, tapes, profile: bool = False):
    """This rank's ``build_tp_decoder`` of ``cfg`` with the bench's tiling (:func:`tp_tiling`), wait
    bound and groups, from the precompiled ``tapes`` (None: compiled and verified here); its size
    logged."""
    import torch.distributed as dist

    from interp.tp import build_tp_decoder
    a = c.a
    t0 = time.perf_counter()
    h = build_tp_decoder(w, kv, cfg, a.max_seq, tapes=tapes, verify_tapes=tapes is None, tiling=tp_tiling(a, cfg),
                         tp_group=dist.group.WORLD, host_group=c.hg, wait_s=a.wait_s, profile=profile)
    k = h.layer
    c.log(f"TP decoder{' (profiling)' if profile else ''} built in {time.perf_counter() - t0:.1f} s: {len(k.tape)} "
          f"instructions on {k.num_sms} SMs, {k.resources.get('n_regs')} registers, {k.resources.get('n_spills')} spills")
    return h


def _profile_speed(c: Ctx, w, kv, cfg, tapes, tok0: int, P: int) -> None:
    """``--profile``: the profiling kernel of the speed stage's build, 3 steps at ``P``..; this rank's
    records (``interp.profile.instruction_rows``: slot, opcode, layer, SM, wait start, exec start, end
    in ns, the instruction) to
    ``<out>/tp-records-rank<r>.json.gz`` and a middle layer's stages in the log."""
    import gzip
    import json

    from interp.profile import instruction_rows, records
    from interp.runtime import profile_records
    from interp.tp import tp_decode_step, tp_teardown
    a, r, dev, log = c.a, c.rank, c.dev, c.log
    if dev.type != "cuda":
        log("profile: skipped (profile records come from a GPU)")
        return
    hp = _build_rank(c, w, kv, cfg, tapes, profile=True)
    try:
        for i in range(3):
            tp_decode_step(hp, tok0 + i, P + i)
        tape = hp.layer.tape
        recs = records(tape, profile_records(hp.layer))
    finally:
        tp_teardown(hp)
    rows = instruction_rows(tape, recs)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with gzip.open(out / f"tp-records-rank{r}.json.gz", "wt") as f:
        json.dump(rows, f)
    t0 = min(x[4] for x in rows)
    span = (max(x[6] for x in rows) - t0) / 1e3
    mid = cfg.layers // 2
    log(f"profile: {len(rows)} instructions, {span:.1f} us traced; layer {mid} (us from the trace's start):")
    names = []
    for x in rows:
        if x[2] == mid and x[1] not in names:
            names.append(x[1])
    for name in names:
        xs = [x for x in rows if x[2] == mid and x[1] == name]
        ex = sorted((x[5] - t0) / 1e3 for x in xs)
        en = sorted((x[6] - t0) / 1e3 for x in xs)
        du = sorted((x[6] - x[5]) / 1e3 for x in xs)
        last = max(xs, key=lambda x: x[6])
        log(f"  {name:14s} n={len(xs):4d} exec {ex[0]:9.2f}..{ex[-1]:9.2f} end {en[0]:9.2f}..{en[-1]:9.2f} "
            f"duration median {_median(du):6.2f} max {du[-1]:6.2f}; last to end: {last[7]}")


def _count_kernels_once(fn, dev):
    """GPU kernels of one ``fn()`` under torch.profiler; ``fn`` runs exactly once whatever happens
    (both ranks must replay the same number of times: NCCL kernels wait for their peer)."""
    import warnings

    from .baselines import _is_gpu_kernel
    if dev.type != "cuda":
        fn()
        return None
    prof = None
    try:
        from torch.profiler import ProfilerActivity, profile
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
            prof.__enter__()
    except Exception:
        prof = None
    fn()
    _sync(dev)
    if prof is None:
        return None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            prof.__exit__(None, None, None)
        return sum(1 for e in prof.events() if _is_gpu_kernel(e)) or None
    except Exception:
        return None


def _write_results(c: Ctx, cfg, got: list) -> None:
    import torch

    from .decoder_bench import table_rows
    a = c.a
    r0 = got[0]
    floor = r0["floor_us"]
    rows = [dict(name="floor (bytes per GPU / stream copy, rank 0)", us_per_step=floor),
            dict(name="megatape TP=2 (one persistent kernel per GPU, peer signals over NVLink)",
                 us_per_step=r0["us_mt"], us_wall=r0["wall_mt"], kernels_per_step=1)]
    if "us_nccl" in r0:
        how = "one CUDA graph per step" if r0.get("nccl_graph") else "eager (the graph capture failed)"
        rows.append(dict(name=f"torch TP=2: per-GPU kernels + NCCL all-reduce after O and down, {how}",
                         us_per_step=r0["us_nccl"], us_wall=r0["wall_nccl"], kernels_per_step=r0["kernels_nccl"]))
    for o in rows:
        o["x_floor"] = o["us_per_step"] / floor
        o["fraction_of_bw"] = floor / o["us_per_step"]
        o.setdefault("us_wall", None)
        o.setdefault("kernels_per_step", None)
    card = torch.cuda.get_device_name(c.dev) + " x2 (NVLink)" if c.dev.type == "cuda" else "CPU rehearsal (interpreter)"
    rep = dict(card=card, date=datetime.date.today().isoformat(),
               preset=a.preset, tp=2, layers=cfg.layers, pos=a.prefill, steps=a.steps, bytes_per_step=r0["bytes"],
               copy_TBps=r0["bw"] / 1e12, floor_us=floor, accuracy=c.results.get("accuracy", {}),
               per_rank=[dict(rank=q, copy_TBps=g["bw"] / 1e12, floor_us=g["floor_us"], megatape_us=g["us_mt"],
                              nccl_us=g.get("us_nccl"), timed_window_s=g.get("window")) for q, g in enumerate(got)],
               nccl_baseline_vs_megatape_logits_rel_err=r0.get("nccl_rel_err"),
               weights="random, generated per shard on each GPU (replicated tensors from a shared seed)",
               tiling=a.tiling or "default", rows=rows)
    acc = rep["accuracy"]
    md = [f"{rep['card']}, {rep['date']}, {a.preset} ({cfg.layers} layers, random weights per shard), TP=2, pos "
          f"{a.prefill}, {a.steps} steps: {r0['bytes']} bytes per GPU per step, stream copy {rep['copy_TBps']:.3f} TB/s "
          f"(rank 0), floor {floor:.1f} us" + (f"; tiling {a.tiling}" if a.tiling else "")]
    if acc:
        md.append(f"Accuracy ({acc['layers']} layers, {acc['steps']} steps): TP=2 vs fp32 {acc['rel_err_vs_fp32_max']:.2e}, "
                  f"the bf16 reference {acc['bf16_ref_vs_fp32_max']:.2e} "
                  f"({'criterion met' if acc['criterion_met'] else 'criterion NOT met'}); TP vs single-GPU megatape "
                  f"{acc['tp_vs_single_gpu_rel_err_max']:.2e}; ranks bitwise equal")
    md += ["", "| what | us/step (events) | us/step (wall) | tokens/s | x floor | fraction of BW | kernels/step |",
           "|---|---|---|---|---|---|---|"]
    md += table_rows(rows, tps_digits=1)
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decoder-{a.preset}-tp2"
    (out / f"{stem}.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / f"{stem}.md").write_text("\n".join(md) + "\n")
    c.log(f"wrote {out / (stem + '.json')} and .md")


STAGE_FNS = {"smoke": stage_smoke, "death": stage_death, "correct": stage_correct, "speed": stage_speed}


def worker(a) -> int:
    _check_env()
    r = a.rank
    t_start = time.monotonic()

    def log(msg: str) -> None:
        for i, line in enumerate(str(msg).splitlines() or [""]):
            print(f"rank {r} +{time.monotonic() - t_start:6.1f}s {'| ' if i else ''}{line}", flush=True)

    log("env " + " ".join(f"{k}={os.environ.get(k)}" for k in {**SAFE_ENV, **DEFAULT_ENV}))
    if a.rehearse:
        os.environ["TRITON_INTERPRET"] = "1"          # before triton is imported
    import torch
    import torch.distributed as dist
    kw = dict(init_method=f"tcp://127.0.0.1:{a.port}", rank=r, world_size=2,
              timeout=datetime.timedelta(seconds=HOST_GROUP_TIMEOUT_S))
    if a.rehearse:
        dev = torch.device("cpu")
        log(f"torch {torch.__version__}: CPU rehearsal (gloo, the Triton interpreter, shared files)")
        dist.init_process_group(backend="gloo", **kw)
        from interp import tp
        tp._SYMMETRIC_ALLOC = _file_alloc(a.workdir)
    else:
        if torch.cuda.device_count() < 2:
            log(f"needs 2 GPUs, sees {torch.cuda.device_count()}")
            return 2
        torch.cuda.set_device(r)
        dev = torch.device("cuda", r)
        log(f"torch {torch.__version__} on {torch.cuda.get_device_name(dev)}; initialising NCCL (port {a.port})")
        try:
            dist.init_process_group(backend="nccl", device_id=dev, **kw)
        except TypeError:                      # a torch without device_id
            dist.init_process_group(backend="nccl", **kw)
        can = torch.cuda.can_device_access_peer(r, 1 - r)
        log(f"peer access to GPU {1 - r}: {can}")
        if not can:
            log("FAIL: the GPUs cannot access each other's memory (no P2P)")
            return 2
    hg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=HOST_GROUP_TIMEOUT_S))
    c = Ctx(a, r, dev, hg, log)
    for st in a.stage_list:
        _barrier(c)
        print(f"{MARK}STAGE {st} BEGIN", flush=True)
        t0 = time.perf_counter()
        try:
            STAGE_FNS[st](c)
        except BaseException as e:
            traceback.print_exc()
            sys.stdout.flush()
            sys.stderr.flush()
            why = " ".join(f"{type(e).__name__}: {e}".split())[:400]
            print(f"{MARK}STAGE {st} FAIL {why}", flush=True)
            os._exit(3)                    # no teardown that could wait on the peer
        import gc
        gc.collect()
        torch.cuda.empty_cache()
        print(f"{MARK}STAGE {st} OK {time.perf_counter() - t0:.1f}", flush=True)
    _barrier(c)
    sys.stdout.flush()
    os._exit(0)                            # skip interpreter teardown (NCCL / symmetric memory finalisers)


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.worker:
        return worker(a)
    if a.precompile:
        return precompile(a)
    return launch(a)


if __name__ == "__main__":
    sys.exit(main())
