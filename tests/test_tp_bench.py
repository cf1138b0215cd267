"""The two-GPU tensor-parallel bench (bench/tp_bench.py) and its NCCL baseline (bench/tp_baseline.py),
as far as they run without GPUs: the launcher's environment (NVLink multicast off in every child),
its supervision (a stage past its limit, a failed worker: everything killed, process groups
included), the arguments, the baseline model's math against the TP reference (two threads as the two
ranks), the per-GPU byte count, the precompiled tapes, and the per-rank runtime's failure exchange
(two gloo processes with stand-in kernels: a failure on one rank raises on both, both reset).
Nothing here ran on a GPU."""
from __future__ import annotations

import dataclasses
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from opcodes import PRESETS
from opcodes.reference import layer_shapes, make_kv_cache, rel_err
from opcodes.tp import shard_config, shard_kv_cache, shard_weights, tp_argmax, tp_decoder_ref

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _env(**extra):
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)
    env.update(extra)
    return env


def _two_ranks(script, source: str, extra: list, timeout: float) -> list:
    """``source`` written to ``script`` and run as ranks 0 and 1 (argv: rank, a free port, ``extra``):
    [(return code, output)] per rank; a process still running after ``timeout`` s is killed."""
    from bench.tp_bench import _free_port
    script.write_text(source)
    port = str(_free_port())
    ps = [subprocess.Popen([sys.executable, str(script), str(r), port] + extra, cwd=ROOT, env=_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = []
    for p in ps:
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        finally:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out) for p, out in zip(ps, outs)]


# ---- the environment ---------------------------------------------------------------------------------
def test_the_module_and_its_children_turn_multicast_off():
    code = ("import os; os.environ['NCCL_NVLS_ENABLE'] = '1'; os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'] = '0'\n"
            "import bench.tp_bench as t\n"
            "assert os.environ['NCCL_NVLS_ENABLE'] == '0' and os.environ['TORCH_SYMM_MEM_DISABLE_MULTICAST'] == '1'\n"
            "os.environ['NCCL_NVLS_ENABLE'] = '1'\n"
            "e = t.child_env({'X': '1'})\n"
            "assert e['NCCL_NVLS_ENABLE'] == '0' and e['TORCH_SYMM_MEM_DISABLE_MULTICAST'] == '1' and e['X'] == '1'\n"
            "assert 'TRITON_INTERPRET' not in e and e['PYTHONUNBUFFERED'] == '1'\n"
            "try:\n    t._check_env()\nexcept SystemExit as x:\n    print('refused', x)\n")
    r = subprocess.run([sys.executable, "-c", code], env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "refused" in r.stdout and "NCCL_NVLS_ENABLE" in r.stdout


def test_the_launcher_gives_its_workers_the_switches_and_fails_without_gpus(tmp_path):
    """On this machine (no GPU) the workers report their environment and stop: the launcher reports the
    failure and exits 1, even if its own environment had multicast on."""
    r = subprocess.run([sys.executable, "-m", "bench.tp_bench", "--stages", "smoke", "--out", str(tmp_path),
                        "--total-timeout", "200"], cwd=ROOT,
                       env=_env(NCCL_NVLS_ENABLE="1", TORCH_SYMM_MEM_DISABLE_MULTICAST="0", CUDA_VISIBLE_DEVICES=""),
                       capture_output=True, text=True, timeout=300)
    out = r.stdout
    assert r.returncode == 1, out + r.stderr
    for rank in (0, 1):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"[rank{rank} ") and "env " in ln)
        assert "NCCL_NVLS_ENABLE=0" in line and "TORCH_SYMM_MEM_DISABLE_MULTICAST=1" in line
    assert "needs 2 GPUs" in out and "FAILED" in out
    assert "precompile" not in out          # the smoke stage alone needs no precompiled tapes


# ---- supervision ---------------------------------------------------------------------------------------
def _fake(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-u", "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True, env=_env())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:       # a zombie (exited, not yet reaped by its parent) counts as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_a_stage_past_its_limit_kills_every_process_group():
    from bench.tp_bench import supervise
    sleeper = """
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        print("grandchild", child.pid, flush=True)
        print("@@STAGE smoke BEGIN", flush=True)
        time.sleep(120)
    """
    ws = {"rank0": _fake(sleeper), "rank1": _fake(sleeper)}
    lines = []

    class Out:
        def write(self, s):
            lines.append(s)

        def flush(self):
            pass

    ok, msg, done = supervise(ws, {}, {"smoke": 2.0}, 60, out=Out())
    assert not ok and "stage smoke ran past its time limit of 2 s" in msg and done == {}
    # stopped by a signal, not by their own end (each sleeps 120 s)
    assert all(p.poll() is not None and p.returncode < 0 for p in ws.values()), [p.returncode for p in ws.values()]
    text = "".join(lines)
    kids = [int(ln.split("grandchild ")[1].split()[0]) for ln in text.splitlines() if "grandchild " in ln]
    assert len(kids) == 2
    # the signal reaches the grandchildren at once; the bound only keeps a failure from hanging the test
    t_end = time.monotonic() + 60
    while any(_alive(k) for k in kids) and time.monotonic() < t_end:
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), "a grandchild survived the process-group kill"


def test_a_failed_stage_stops_the_other_worker():
    from bench.tp_bench import supervise
    failing = """
        import os, time
        print("@@STAGE smoke BEGIN", flush=True)
        time.sleep(0.5)
        print("@@STAGE smoke FAIL AssertionError: the ranks' tensors differ", flush=True)
        os._exit(3)
    """
    waiting = """
        import time
        print("@@STAGE smoke BEGIN", flush=True)
        time.sleep(120)
    """
    ws = {"rank0": _fake(failing), "rank1": _fake(waiting)}
    ok, msg, _ = supervise(ws, {}, {"smoke": 60}, 60, out=open(os.devnull, "w"))
    assert not ok and "stage smoke failed on rank0" in msg and "the ranks' tensors differ" in msg
    assert ws["rank0"].returncode == 3
    # rank 1 was stopped by a signal when rank 0 failed, not at its own end (it sleeps 120 s)
    assert ws["rank1"].poll() is not None and ws["rank1"].returncode < 0, ws["rank1"].returncode


def test_workers_that_pass_every_stage():
    from bench.tp_bench import supervise
    good = """
        for st in ("smoke", "death"):
            print(f"@@STAGE {st} BEGIN", flush=True)
            print(f"@@STAGE {st} OK 0.1", flush=True)
    """
    helper = _fake("import time; time.sleep(120)")
    ws = {"rank0": _fake(good), "rank1": _fake(good)}
    ok, msg, done = supervise(ws, {"precompile": helper}, {"smoke": 30, "death": 30}, 60, out=open(os.devnull, "w"))
    assert ok and msg == "all stages passed" and set(done) == {"smoke", "death"}
    assert helper.poll() is not None          # helpers are stopped at the end


# ---- arguments --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv, what", [
    (["--stages", "smoke,bogus"], "--stages"),
    (["--stages", "speed,smoke"], "in the order"),
    (["--stages", "death"], "include smoke"),
    (["--stage-timeout", "smoke"], "--stage-timeout"),
    (["--stage-timeout", "later=3"], "--stage-timeout"),
    (["--steps", "0"], "--steps"),
    (["--pos", "1100", "--steps", "64", "--max-seq", "1152"], "max_seq"),
    (["--wait-s", "0"], "--wait-s"),
])
def test_argument_errors(argv, what, capsys):
    from bench.tp_bench import parse_args
    with pytest.raises(SystemExit) as ei:
        parse_args(argv)
    assert ei.value.code == 2
    assert what in capsys.readouterr().err


def test_arguments():
    from bench.tp_bench import STAGE_TIMEOUT_S, parse_args
    a = parse_args(["--stages", "smoke,speed", "--stage-timeout", "speed=100", "--steps", "40"])
    assert a.stage_list == ["smoke", "speed"] and a.timeouts["speed"] == 100
    assert a.timeouts["smoke"] == STAGE_TIMEOUT_S["smoke"] and a.steps == 40 and a.preset == "llama3.1-70b"
    # results: the GPU run's beside the others; a CPU rehearsal's out of the results tree unless told
    from bench import RESULTS
    from bench.tp_bench import REHEARSAL_OUT
    assert parse_args([]).out == RESULTS and parse_args(["--rehearse"]).out == REHEARSAL_OUT != RESULTS
    assert parse_args(["--rehearse", "--out", "x"]).out == "x"


# ---- the NCCL baseline's model, on the CPU --------------------------------------------------------------
class _TwoRanks:
    """all_reduce / all_gather between two threads (rank order, fp32), the collectives' semantics."""

    def __init__(self):
        self.b = threading.Barrier(2, timeout=60)
        self.slots = [None, None]

    def _swap(self, r, t):
        self.slots[r] = t.clone()
        self.b.wait()
        got = list(self.slots)
        self.b.wait()
        return got

    def fns(self, r):
        def all_reduce(t):
            a, b = self._swap(r, t)
            t.copy_(a + b)

        def all_gather(t):
            return torch.stack(self._swap(r, t))
        return all_reduce, all_gather


def _decoder_cfg(vocab=200):
    return dataclasses.replace(PRESETS["small-2layer"], vocab=vocab, name=f"small-2layer-v{vocab}")


def test_the_nccl_baseline_model_computes_the_tp_reference():
    """Rank 0 and rank 1 of bench.tp_baseline.TPTorchDecoder in two threads, the collectives between
    them: the logits within 2e-2 of tp_decoder_ref over 3 steps (each step's token the previous one's
    greedy token, held on the 'device'), the same greedy token on both ranks and as the reference's."""
    from bench.decoder_bench import make_decoder_weights
    from bench.tp_baseline import TPTorchDecoder
    cfg = _decoder_cfg()
    MAX_SEQ, POS, STEPS = 64, 19, 3
    w = make_decoder_weights(cfg, 0, "cpu", tied=False)
    kv = make_kv_cache(cfg, MAX_SEQ, POS, seed=1)
    shards = [shard_weights(w, cfg, r, 2) for r in range(2)]
    ref_caches = [shard_kv_cache(kv, cfg, r, 2) for r in range(2)]
    pair = _TwoRanks()
    models = [TPTorchDecoder(shards[r], shard_kv_cache(kv, cfg, r, 2), cfg, r, MAX_SEQ, *pair.fns(r)) for r in range(2)]
    for m in models:
        m.set(17, POS)
    results = [[], []]
    errors = []

    def run(r):
        try:
            for _ in range(STEPS):
                models[r].step()
                results[r].append((models[r].logits_full().clone(), int(models[r].tok), int(models[r].pos)))
        except BaseException as e:        # reported below
            errors.append(e)
            pair.b.abort()

    ts = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    tok = 17
    for i in range(STEPS):
        ref = tp_decoder_ref(shards, ref_caches, cfg, tok, POS + i)
        want = tp_argmax([ref[:, :cfg.vocab // 2], ref[:, cfg.vocab // 2:]])
        (l0, t0, p0), (l1, t1, p1) = results[0][i], results[1][i]
        assert torch.equal(l0, l1) and t0 == t1 and p0 == p1 == POS + i + 1
        e = rel_err(l0, ref)
        assert e <= 2e-2, f"step {i}: logits rel err {e:.3e} against tp_decoder_ref"
        assert t0 == want, f"step {i}: token {t0}, the reference's {want}"
        tok = t0
    # the K/V rows it wrote are the reference's
    for r in range(2):
        for l in range(cfg.layers):
            for j in range(2):
                got = models[r].layers[l].k_cache if j == 0 else models[r].layers[l].v_cache
                assert rel_err(got[:, :, POS:POS + STEPS], ref_caches[r][l][j][:, :, POS:POS + STEPS]) <= 2e-2


def test_the_baseline_needs_its_all_reduce():
    """Without the all-reduce (each rank adds only its own partials) the logits are far from the
    reference: the test above can fail."""
    from bench.decoder_bench import make_decoder_weights
    from bench.tp_baseline import TPTorchDecoder
    cfg = _decoder_cfg()
    w = make_decoder_weights(cfg, 0, "cpu", tied=False)
    kv = make_kv_cache(cfg, 64, 19, seed=1)
    shards = [shard_weights(w, cfg, r, 2) for r in range(2)]
    m = TPTorchDecoder(shards[0], shard_kv_cache(kv, cfg, 0, 2), cfg, 0, 64, lambda t: None,
                       lambda t: torch.stack([t, t]))
    m.set(17, 19)
    m.step()
    ref = tp_decoder_ref(shards, [shard_kv_cache(kv, cfg, r, 2) for r in range(2)], cfg, 17, 19)
    assert rel_err(m.logits, ref[:, :cfg.vocab // 2]) > 0.1


# ---- bytes, tapes ------------------------------------------------------------------------------------------
def test_bytes_per_gpu():
    """What one GPU of TP=2 reads per step, counted from the shard's tensors."""
    from bench.tp_bench import shard_bytes_per_step
    cfg = PRESETS["llama3.1-70b"]
    assert (cfg.layers, cfg.d, cfg.ffn, cfg.n_q, cfg.n_kv, cfg.hd, cfg.vocab) == (80, 8192, 28672, 64, 8, 128, 128256)
    sc = shard_config(cfg, 1, 2)
    pos = 1055
    per_layer = sum(2 * torch.Size(s).numel() for s in layer_shapes(sc).values())
    kv = 2 * 2 * sc.n_kv * sc.hd * (pos + 1)
    want = cfg.layers * (per_layer + kv) + 2 * (cfg.vocab // 2) * cfg.d + 2 * cfg.d + 2 * cfg.d
    assert shard_bytes_per_step(cfg, pos) == want
    assert 0.49 < want / cfg.bytes_per_step(pos) < 0.51        # about half the model's bytes


def test_precompiled_tapes_round_trip(tmp_path):
    from bench.tp_bench import _tape_file, save_tapes
    from schedule import compile_model
    import pickle
    cfg = _decoder_cfg()
    c = compile_model(cfg, 3, max_seq=64, tp=2)
    path = _tape_file(str(tmp_path), "correct")
    save_tapes(path, c.tapes, dict(cfg=cfg.to_dict(), max_seq=64, num_sms=3, verified=True))
    d = pickle.loads(path.read_bytes())
    assert d["meta"]["num_sms"] == 3 and len(d["tapes"]) == 2
    for a, b in zip(c.tapes, d["tapes"]):
        assert torch.equal(a.words, b.words) and torch.equal(a.offsets, b.offsets) and a.lay == b.lay
        assert a.counters == b.counters
    assert not list(tmp_path.glob("*.tmp*"))


def test_verify_tapes_false_skips_the_cross_rank_check(monkeypatch):
    """build_tp_*(tapes=..., verify_tapes=False): tapes compile_model verified are not verified again
    (verify_tp takes ~a minute for 80 layers of the 70B shape); by default they are."""
    import interp.tp as tp
    from opcodes.reference import make_weights
    from schedule import compile_model
    cfg = PRESETS["small-2layer"]
    tapes = compile_model(cfg, 1, max_seq=64, decoder=False, sequential=True, tp=2).tapes
    w = make_weights(cfg)
    kv = make_kv_cache(cfg, 64, 19)
    calls = []
    monkeypatch.setattr(tp, "verify_tp", lambda t: calls.append(len(t)))
    args = ([shard_weights(w, cfg, r, 2) for r in range(2)], [shard_kv_cache(kv, cfg, r, 2) for r in range(2)], cfg, 64)
    tp.tp_teardown(tp.build_tp_layers(*args, tapes=tapes, verify_tapes=False))
    assert calls == []
    tp.tp_teardown(tp.build_tp_layers(*args, tapes=tapes))
    assert calls == [2]


# ---- the per-rank runtime without GPUs ------------------------------------------------------------------
def test_per_rank_build_argument_errors():
    import interp.tp as tp
    from interp.decoder import build_decoder
    cfg = PRESETS["small-2layer"]
    with pytest.raises(RuntimeError, match="not initialised"):
        tp.build_tp_layers({"layers": []}, [], cfg, 64, tp_group=object())
    with pytest.raises(ValueError, match="sampling"):
        build_decoder({}, [], _decoder_cfg(), 64, tp_group=object(), sampling=True)
    import torch.distributed as dist
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with pytest.raises(ValueError, match="a group of 2 processes"):
            tp.build_tp_layers({"layers": []}, [], cfg, 64, tp_group=dist.group.WORLD)
    finally:
        dist.destroy_process_group()


_EXCHANGE = r'''
import os, sys, datetime
import torch, torch.distributed as dist
from interp import tp
from interp.runtime import MegakernelError
r = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=r, world_size=2,
                        timeout=datetime.timedelta(seconds=60))

class FakeLayer:            # a rank's kernel handle: check() as LayerHandle's (it resets itself when it failed)
    device = torch.device("cpu")
    def __init__(self, fail):
        self.fail = fail
        self.status = torch.ones(3, 8, dtype=torch.int32)
        self.counters = torch.full((5,), 7, dtype=torch.int32)
        self.ctl = torch.ones(4, dtype=torch.int32)
    def check(self, sync=True):
        if self.fail:
            self.counters.zero_()
            raise MegakernelError("megakernel stopped: 1 SM(s) gave up waiting after 2 s (the time bound):\n"
                                  "  tp_reduce layer=0: waited on counter 9 (recv_o[0,0]) for 2 (call 1), saw 0",
                                  [(0, 5, "tp_reduce", "9 (recv_o[0,0])", 2, 0, 1, 4)])

hg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
h = tp.TPRankHandle(layer=FakeLayer(fail=(r == 0)), cfg=None, rank=r, group=None, host_group=hg, epoch_limit=100,
                    calls=3)
try:
    tp.tp_check(h)
    print("NO ERROR")
except MegakernelError as e:
    ok = ("rank 0: megakernel stopped" in str(e) and "recv_o" in str(e) and "rank 1:" not in str(e)
          and e.stuck == [(0, 0, 5, "tp_reduce", "9 (recv_o[0,0])", 2, 0, 1, 4)])
    reset = h.calls == 0 and not h.layer.counters.any() and not h.layer.status.any() and not h.layer.ctl.any()
    print("RAISED", ok, reset)
h.layer.fail = False                          # both fine now: no error on either rank
h.layer.counters.fill_(3)
tp.tp_check(h)
print("CLEAN", int(h.layer.counters.sum()) == 15)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)
'''


def test_a_failure_on_one_rank_raises_on_both_and_both_reset(tmp_path):
    """tp_check's exchange over a gloo host group (two processes, stand-in kernel handles): rank 0's
    kernel stopped on a wait, rank 1's finished; both raise MegakernelError with rank 0's report and
    both reset their counters, status and call count; a clean step after it raises nowhere."""
    for r, (rc, out) in enumerate(_two_ranks(tmp_path / "exchange.py", _EXCHANGE, [], 240)):
        assert rc == 0, f"rank {r}:\n{out}"
        assert "RAISED True True" in out and "CLEAN True" in out, f"rank {r}:\n{out}"


# ---- the CLI and the results file ---------------------------------------------------------------------
def test_bench_decoder_tp2_calls_the_launcher(monkeypatch, capsys):
    """``python -m bench decoder --tp 2`` (bench/cli.py) hands its arguments to the launcher."""
    import bench.tp_bench
    from bench.cli import main
    seen = []
    monkeypatch.setattr(bench.tp_bench, "main", lambda argv: seen.append(argv) or 0)
    assert main(["decoder", "--preset", "llama3.1-70b", "--tp", "2", "--out", "x", "--steps", "16"]) == 0
    a = bench.tp_bench.parse_args(seen[0])
    assert (a.preset, a.out, a.steps, a.prefill, a.max_seq, a.no_baseline) == ("llama3.1-70b", "x", 16, 1024, 1152, False)
    assert main(["decoder", "--preset", "llama3.1-70b", "--tp", "2", "--no-compile"]) == 0
    assert bench.tp_bench.parse_args(seen[1]).no_baseline
    assert main(["decoder", "--preset", "llama3.1-70b", "--tp", "2", "--profile"]) == 2
    assert "--profile" in capsys.readouterr().err and len(seen) == 2
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"


def test_results_file_format(tmp_path):
    """decoder-<preset>-tp2.json: the latency issue's keys (card, date, preset, pos, bytes_per_step,
    copy_TBps, floor_us, accuracy, rows of name / us_per_step / x_floor / fraction_of_bw /
    kernels_per_step) and the Markdown table."""
    import json
    from bench.tp_bench import Ctx, _write_results, parse_args
    a = parse_args(["--out", str(tmp_path)])
    c = Ctx(a, 0, torch.device("cpu"), None, lambda m: None)
    c.results["accuracy"] = dict(layers=8, steps=8, rel_err_vs_fp32_max=0.02, bf16_ref_vs_fp32_max=0.021,
                                 criterion_met=True, tp_vs_single_gpu_rel_err_max=0.01)
    rec = dict(bw=4.0e12, floor_us=16500.0, bytes=66_000_000_000, us_mt=17000.0, wall_mt=17010.0, us_nccl=20000.0,
               wall_nccl=20100.0, kernels_nccl=1700, nccl_rel_err=0.01, nccl_graph=True, window=[100.0, 100.5])
    import unittest.mock as um
    with um.patch("torch.cuda.get_device_name", lambda *_: "NVIDIA H200"):
        _write_results(c, PRESETS["llama3.1-70b"], [rec, dict(rec, us_mt=17001.0)])
    got = json.loads((tmp_path / "decoder-llama3.1-70b-tp2.json").read_text())
    assert {"card", "date", "preset", "pos", "bytes_per_step", "copy_TBps", "floor_us", "accuracy", "rows"} <= set(got)
    assert got["preset"] == "llama3.1-70b" and got["pos"] == 1024 and got["copy_TBps"] == 4.0
    names = [r["name"] for r in got["rows"]]
    assert names[0].startswith("floor") and names[1].startswith("megatape TP=2") and "NCCL" in names[2]
    mt = got["rows"][1]
    assert (mt["us_per_step"], mt["kernels_per_step"]) == (17000.0, 1)
    assert abs(mt["x_floor"] - 17000 / 16500) < 1e-12 and abs(mt["fraction_of_bw"] - 16500 / 17000) < 1e-12
    assert got["rows"][2]["kernels_per_step"] == 1700 and got["per_rank"][1]["megatape_us"] == 17001.0
    assert got["per_rank"][0]["timed_window_s"] == [100.0, 100.5]      # bench.ab_table --clocks
    md = (tmp_path / "decoder-llama3.1-70b-tp2.md").read_text()
    assert "| megatape TP=2" in md and "| 17000.0 | 17010.0 | 58.8 | 1.030 | 97.1% | 1 |" in md
    assert "criterion met" in md


_REHEARSAL = r'''
import dataclasses, datetime, os, pathlib, sys
os.environ["TRITON_INTERPRET"] = "1"
import torch, torch.distributed as dist
from interp import tp
from interp.codegen import FAIL_TIME
from interp.decoder import build_decoder, decode_step
from interp.runtime import MegakernelError
from opcodes import PRESETS
from opcodes.reference import make_kv_cache, make_weights, rel_err
from opcodes.tp import shard_kv_cache, shard_weights, tp_model_ref
from schedule import compile_model
from schedule.vm import run_tp_decoder
from bench.decoder_bench import make_decoder_weights
r, port, d = int(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=r, world_size=2,
                        timeout=datetime.timedelta(seconds=300))
hg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=300))
n_alloc = [0]

def file_alloc(total, device, rank, group, hg_):     # symmetric memory's stand-in: two shared files
    k = n_alloc[0]
    n_alloc[0] += 1
    paths = [d / f"symm{k}-{q}.bin" for q in range(2)]
    with open(paths[rank], "wb") as f:
        f.truncate(total)
    dist.barrier(group=hg_)
    return (torch.from_file(str(paths[rank]), shared=True, size=total, dtype=torch.uint8),
            torch.from_file(str(paths[1 - rank]), shared=True, size=total, dtype=torch.uint8), None)

tp._SYMMETRIC_ALLOC = file_alloc

def gather(t):
    out = [None, None]
    dist.all_gather_object(out, t, group=hg)
    return out

cfg = PRESETS["small-2layer"]
MAX_SEQ, POS = 64, 19
w = make_weights(cfg)
kv = make_kv_cache(cfg, MAX_SEQ, POS)
x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
ref_sh = [shard_weights(w, cfg, q, 2) for q in range(2)]
ref_c = [shard_kv_cache(kv, cfg, q, 2) for q in range(2)]
h = tp.build_tp_layers(shard_weights(w, cfg, r, 2), shard_kv_cache(kv, cfg, r, 2), cfg, MAX_SEQ,
                       tp_group=dist.group.WORLD, host_group=hg, wait_s=120)
assert isinstance(h, tp.TPRankHandle) and h.rank == r and h.layer.num_sms == 1
xin, xref, ok = x, x, True
for call in range(2):                                  # receive slots 1, 0
    out = tp.tp_layer_step(h, xin, POS + call)
    o = gather(out)
    xref = tp_model_ref(ref_sh, ref_c, cfg, xref, POS + call)
    ok &= torch.equal(o[0], o[1]) and rel_err(out, xref) <= 1.5e-2
    xin = out
print("STEPS", ok, h.calls == 2, flush=True)
tp.set_wait(h, 2.0)                                    # rank 1 never launches
try:
    tp.tp_layer_step(h, x, POS, launch=(r == 0))
    print("DEATH no error", flush=True)
except MegakernelError as e:
    msg = str(e)
    print("DEATH", "rank 0:" in msg and "(the time bound)" in msg and "rank 1:" not in msg and "recv_" in msg
          and all(s[0] == 0 for s in e.stuck), all(s[-1] == FAIL_TIME for s in e.stuck),      # the time bound, not polls
          h.calls == 0 and int(h.layer.counters.abs().sum()) == 0, flush=True)
tp.set_wait(h, 120)
out = tp.tp_layer_step(h, x, POS)
o = gather(out)
ref = tp_model_ref(ref_sh, [shard_kv_cache(make_kv_cache(cfg, MAX_SEQ, POS), cfg, q, 2) for q in range(2)], cfg, x, POS)
print("AGAIN", torch.equal(o[0], o[1]) and rel_err(out, ref) <= 1.5e-2, flush=True)
tp.tp_teardown(h)
cv = dataclasses.replace(cfg, vocab=200, name="small-2layer-v200")
wv = make_decoder_weights(cv, 0, "cpu", tied=False)
kvv = make_kv_cache(cv, MAX_SEQ, POS)
tapes = compile_model(cv, 1, max_seq=MAX_SEQ, tp=2, sequential=True).tapes
vm = run_tp_decoder(tapes, wv, [tuple(t.clone() for t in p) for p in kvv], 17, POS, calls=2, return_all=True)
hd = build_decoder(shard_weights(wv, cv, r, 2), shard_kv_cache(kvv, cv, r, 2), cv, MAX_SEQ, tp_group=dist.group.WORLD,
                   host_group=hg, wait_s=120, tapes=tapes, verify_tapes=False)
lg = decode_step(hd, torch.tensor([17]), POS)
toks = tp.tokens(hd)
new = tp.tp_generate(hd, [toks[0]], 1, start_pos=POS + 1)
hid = gather(hd.hidden.clone())
print("DECODER", lg.shape == (1, 200) and rel_err(lg, torch.cat(vm[0][0], -1)) <= 2e-2, toks == [vm[0][1]] * 2,
      new == [vm[1][1]], torch.equal(hid[0], hid[1]), flush=True)
tp.tp_teardown(hd)
dist.destroy_process_group()
sys.stdout.flush()
os._exit(0)         # as the bench's workers: no interpreter teardown (c10d's threads abort it now and then)
'''


@pytest.mark.slow     # 14 s: the two-GPU lab bench end to end; its pieces (precompile, supervise, the stages) run by default
def test_the_per_process_path_rehearsed_on_the_cpu(tmp_path):
    """interp.tp's one-rank-per-process path (what runs on the two GPUs) in two CPU processes under the
    Triton interpreter, a gloo group as tp_group and host_group, two shared files standing in for
    symmetric memory (interp.tp._SYMMETRIC_ALLOC): the layers over two calls (bitwise equal ranks,
    the TP reference), rank 1 not launching (both raise within the 2 s time bound, named; both reset),
    the same handle again, and the decoder through interp.decoder.build_decoder(..., tp_group=) against
    the two-rank VM."""
    for r, (rc, out) in enumerate(_two_ranks(tmp_path / "rehearsal.py", _REHEARSAL, [str(tmp_path)], 600)):
        assert rc == 0, f"rank {r}:\n{out[-4000:]}"
        for want in ("STEPS True True", "DEATH True True True", "AGAIN True", "DECODER True True True True"):
            assert want in out, f"rank {r}: no {want!r} in\n{out[-4000:]}"


@pytest.mark.slow     # 37 s on two cores: the lab's two-GPU bench end to end, every stage
def test_every_stage_rehearsed_on_the_cpu(tmp_path):
    """``python3 -m bench.tp_bench --rehearse``: the launcher, both workers and every stage's code (smoke,
    death, correct, speed with the NCCL baseline eager) on the CPU: gloo for NCCL, the Triton interpreter
    for the GPUs, shared files for symmetric memory, small-2layer (vocab 200) for every model. Passes,
    and writes the results file."""
    import json
    # --wait-s 60 (the bound's maximum): a working peer's waits in the interpreter, two ranks on a host that may
    # be busy, are far from any bound (the death stage has its own, --death-wait-s)
    r = subprocess.run([sys.executable, "-m", "bench.tp_bench", "--rehearse", "--wait-s", "60", "--out", str(tmp_path)],
                       cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    out = r.stdout
    assert r.returncode == 0 and "PASSED: all stages passed" in out, out[-6000:] + r.stderr[-2000:]
    for st in ("smoke", "death", "correct", "speed"):
        assert f"{st:8s} ok in" in out
    assert "gave up waiting after 2 s (the time bound)" in out            # the death stage's error
    got = json.loads((tmp_path / "decoder-small-2layer-v200-tp2.json").read_text())
    assert got["accuracy"]["ranks_bitwise_equal"] and got["accuracy"]["criterion_met"]
    assert [r["kernels_per_step"] for r in got["rows"][:2]] == [None, 1] and len(got["rows"]) == 3


def test_precompiled_tapes_are_found_and_checked(tmp_path):
    """The launcher's CPU process compiles the correct / speed stages' tapes (verified) into the work
    folder; a worker takes them only for its model, cache length and SM count."""
    from bench.tp_bench import Ctx, _correct_cfg, _load_tapes, _speed_cfg, parse_args, precompile
    argv = ["--workdir", str(tmp_path), "--sms", "1", "--correct-layers", "1", "--speed-layers", "2", "--max-seq", "1152"]
    a = parse_args(argv)
    assert precompile(a) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tapes-correct.pkl", "tapes-speed.pkl"]
    c = Ctx(a, 0, torch.device("cpu"), None, lambda m: None)
    t = _load_tapes(c, "speed", _speed_cfg(a), wait_s=1)
    assert t is not None and len(t) == 2 and t[0].lay.cfg.layers == 2 and t[1].lay.tp_rank == 1
    assert _load_tapes(c, "correct", _correct_cfg(a), wait_s=1)[0].lay.cfg.layers == 1
    assert _load_tapes(c, "correct", _speed_cfg(a), wait_s=1) is None           # another model
    b = parse_args(argv[:-1] + ["2048"])
    assert _load_tapes(Ctx(b, 0, torch.device("cpu"), None, lambda m: None), "speed", _speed_cfg(b), wait_s=1) is None
    b = parse_args(argv + ["--no-precompile"])
    assert _load_tapes(Ctx(b, 0, torch.device("cpu"), None, lambda m: None), "speed", _speed_cfg(b), wait_s=1) is None


def test_workers_that_never_start_a_stage_are_stopped():
    from bench.tp_bench import supervise
    ws = {"rank0": _fake("import time; time.sleep(120)"), "rank1": _fake("import time; time.sleep(120)")}
    ok, msg, _ = supervise(ws, {}, {"startup": 1.5}, 60, out=open(os.devnull, "w"))
    assert not ok and "did not start their first stage within 2 s" in msg
    # stopped by a signal, not by their own end (each sleeps 120 s)
    assert all(p.poll() is not None and p.returncode < 0 for p in ws.values()), [p.returncode for p in ws.values()]


def test_tiling_option_reaches_the_shard_tiling_and_names_a_bad_field():
    from bench import tp_bench
    from opcodes import ModelConfig
    a = tp_bench.parse_args(["--tiling", "qkv_rows=16,o_k=2048"])
    cfg = ModelConfig.from_name("llama3.1-70b")
    t = tp_bench.tp_tiling(a, cfg)
    assert (t.qkv_rows, t.kv_rows, t.o_k) == (16, 8, 2048)          # K/V tiles: half the Q tiles' rows
    assert tp_bench.tp_tiling(tp_bench.parse_args(["--tiling", "o_k=2048"]), cfg).kv_rows == 16
    assert t.down_k == 7168 and shard_config(cfg, 0, 2).ffn == 14336       # the shard's defaults for the rest
    assert tp_bench.tp_tiling(tp_bench.parse_args([]), cfg) is None
    with pytest.raises(ValueError, match="qkv_rowz"):
        tp_bench.tp_tiling(tp_bench.parse_args(["--tiling", "qkv_rowz=16"]), cfg)
