"""The ``megatape`` command line: every subcommand's arguments are parsed here.

    megatape compile --preset NAME --sms N [--layers N] [--max-seq N] [--policy cost|round-robin]
                     [--listing] [-o tape.json]
    megatape run     [--sms N] [-o tape.json] [--no-gpu]
    megatape viz     --preset NAME --sms N --out DIR ...   (pictures: megatape.views.viz)
    megatape generate --model DIR [--prompt TEXT | --prompt-file PATH] [--chat] [--max-new-tokens N]
                     [--temperature T] [--top-k K] [--top-p P] [--seed S] [--stop STRING] [--max-seq N]
    megatape serve   --model DIR [--host 127.0.0.1] [--port 8000] [--max-batch N] [--max-queue N] [--max-seq N]
                     [--prefill-chunk N] [--backend auto|kernel|ref] [--model-name NAME]

``compile`` lowers a preset to tile instructions, schedules them on N SMs with the cost model
(list scheduling) and with round-robin, encodes and verifies both tapes, and prints what the
tapes hold and how far each predicted makespan is from the bandwidth lower bound. ``run`` is the
README's main job: the 70B layer's tape and schedule summary on the CPU, a tape-VM check against
the torch reference on a tiny config, and, when a CUDA device is visible, the layer on the GPU:
every step checked against the torch reference and timed beside the stream-copy floor
(``megatape.measure``).
``generate`` is text in, text out from a Hugging Face Llama checkpoint directory
(``interp.textgen``): the text streams to stdout, the counts and timings go to stderr.
``serve`` is an OpenAI-compatible HTTP server over the same checkpoint with continuous batching
(``megatape.serve``; needs the ``serve`` extra: fastapi, uvicorn); progress goes to stderr.

Argument errors print one line naming the argument and exit with status 2.
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

POLICIES = ("cost", "round-robin")
POLICY_HELP = ("the schedule drawn: cost (list scheduling on the critical path with the cost model, the default "
               "and what the kernels run) or round-robin (tiles dealt to the SMs in turn)")
MAIN_PRESET = "llama70b-layer"
DEFAULT_SMS = 132            # an H200's SM count: the default when no GPU is visible


class _Parser(argparse.ArgumentParser):
    """argparse, but an argument error is one line (no usage block) and exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _nonneg_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    if not v >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return v


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("expected a non-empty string, got ''")
    return text


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _number_in(lo: float, hi: float, lo_open: bool, what: str):
    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v <= hi):
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return v
    return parse


def _int_in(lo: int, hi: int, what: str):
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not lo <= v <= hi:
            raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
        return v
    return parse


def _version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("megatape")
        except PackageNotFoundError:
            return "(not installed)"
    except ImportError:       # pragma: no cover
        return "(unknown)"


class _Progress:
    """'[  1.2s] message' lines on stderr, timed from construction."""

    def __init__(self, stream=None):
        self.t0 = time.perf_counter()
        self.stream = stream

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():6.1f}s] {msg}", file=self.stream or sys.stderr, flush=True)


# ---- compile ----------------------------------------------------------------------------------
def _check_output_path(prog: str, path: str | None) -> str | None:
    """An error line if ``-o path`` cannot be written (checked before the work starts)."""
    if path is None:
        return None
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        return f"{prog}: error: argument -o/--output: directory {parent!r} does not exist"
    if os.path.isdir(path):
        return f"{prog}: error: argument -o/--output: {path!r} is a directory"
    return None


def compile_both(cfg, num_sms: int, max_seq: int | None, progress: _Progress, pool_us: float | None = None,
                 tiling=None, lowering=None) -> dict:
    """Compile ``cfg`` under both policies (each verified); returns {policy: Compiled}. ``lowering``: a rows
    program's (``--rows``), else the layers' or the whole model's as ``compile_model`` decides."""
    from schedule import compile_model
    out = {}
    for pol in POLICIES:
        progress(f"{pol}: lower -> schedule -> encode -> verify ...")
        # a config with a vocabulary compiles as a whole model (compile_model decides)
        c = compile_model(cfg, num_sms, max_seq=max_seq, tiling=tiling, policy=pol,
                          pool_us=(pool_us if pol == "cost" else None), lowering=lowering)
        progress(f"{pol}: {len(c.tape)} instructions on {num_sms} SMs verified "
                 f"(compile_model took {c.seconds:.2f} s)")
        out[pol] = c
    return out


def _fmt_bytes(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= k:
            return f"{n / k:.2f} {unit}"
    return f"{n:.0f} B"


def summary_lines(comps: dict, selected: str) -> list[str]:
    """The schedule summary of ``compile_both``'s result, as lines."""
    from opcodes import REGISTRY
    from schedule import CostModel

    sel = comps[selected]
    prog, lay = sel.prog, sel.prog.lay
    cfg, t = lay.cfg, lay.tiling
    model = CostModel()
    lines = []
    shape = " ".join(f"{k}={v}" for k, v in cfg.to_dict().items())
    lines.append(f"model   {cfg.name}: {shape}")
    rows = getattr(lay, "rows", None)         # a rows program (--rows): its bucket and cache slots
    lines.append(f"layout  max_seq {lay.max_seq}; " + (f"rows {rows} a step (a bucket), batch {lay.batch} slots; "
                                                          if rows else "") + "tiling " +
                 " ".join(f"{k}={v}" for k, v in t.__dict__.items()))
    lines.append(f"target  {sel.tape.num_sms} SMs; cost model: HBM {model.hbm_bw / 1e12:.2f} TB/s, "
                 f"L2 {model.l2_bw_sm / 1e9:.0f} GB/s per SM, {model.overhead * 1e6:.2f} us per instruction")
    if not model.by_bytes:
        from opcodes import Timing
        from opcodes.attn_partial import ATTN_LATENCY_H200
        t0, rt, pb = (v * 1e6 for v in ATTN_LATENCY_H200)
        lines.append(f"        attention splits by loaded HBM round trips: {t0:.1f} + {rt:.1f} x trips + "
                     f"{pb:.1f} x blocks us (H200 fit); " +
                     ", ".join(f"{c.NAME} {c.FIXED_S * 1e6:.1f} us" for c in REGISTRY.values()
                               if c.TIMING == Timing.FIXED and c.FIXED_S is not None) + " (measured)")
    # instructions per opcode
    lines.append("")
    lines.append("instructions per opcode:")
    lines.append(f"  {'opcode':<14}{'#':>3}  {'count':>8}  {'HBM bytes':>12}  {'share':>6}")
    counts = {name: 0 for name in REGISTRY}
    hbm = {name: 0 for name in REGISTRY}
    for ins in prog.instrs:
        counts[ins.NAME] += 1
        hbm[ins.NAME] += ins.cost(lay).hbm_bytes
    total_hbm = sum(hbm.values()) or 1
    for name, cls in REGISTRY.items():     # the program's opcodes; the others once, by name
        if counts[name]:
            lines.append(f"  {name:<14}{cls.OPCODE:>3}  {counts[name]:>8}  {_fmt_bytes(hbm[name]):>12}  "
                         f"{100 * hbm[name] / total_hbm:5.1f}%")
    lines.append(f"  {'total':<14}{'':>3}  {len(prog):>8}  {_fmt_bytes(total_hbm):>12}")
    unused = [name for name in REGISTRY if not counts[name]]
    if unused:
        lines.append(f"  (not in this program: {', '.join(unused)})")
    # counters
    kinds: dict[str, int] = {}
    for name in prog.counters:
        k = name.split("[")[0]
        kinds[k] = kinds.get(k, 0) + 1
    targets = prog.targets()
    n_waits = sum(len(w) for w in prog.waits)
    lines.append("")
    lines.append(f"counters used: {len(prog.counters)} (" +
                 ", ".join(f"{k} x{v}" for k, v in kinds.items()) + ")")
    if targets:
        lines.append(f"  per-call wait targets (producers per counter): min {min(targets)}, "
                     f"max {max(targets)}; {n_waits} waits in all, none reset between calls")
    q_waits, repeated = sel.tape.repeated_waits()
    lines.append(f"  {repeated} of the {q_waits} waits on the SM queues repeat a wait of an earlier instruction of "
                 f"the same SM on the same counter (met before they are polled)")
    # verifier
    lines.append("")
    lines.append("verifier:")
    for pol, c in comps.items():
        lines.append(f"  {pol:<12} {c.report}")
    # the pool
    lines.append("")
    for pol, c in comps.items():
        if c.sched.pool:
            lines.append(f"pool    {pol}: the plan's last {c.sched.policy.split('pool(')[-1].rstrip(')')}: "
                         f"{len(c.sched.pool)} instructions taken by atomic ticket as SMs finish their queues")
        else:
            lines.append(f"pool    {pol}: none (static queues only)")
    # per-SM busy time
    lines.append("")
    lines.append("per-SM predicted busy time (us) and instructions per SM, min / median / max over SMs:")
    for pol, c in comps.items():
        busy = [b * 1e6 for b in c.sched.busy(model)]
        n_per = [len(q) for q in c.sched.per_sm()]
        util = sum(busy) / (len(busy) * c.sched.makespan * 1e6) if c.sched.makespan > 0 else float("nan")
        lines.append(f"  {pol:<12} busy {min(busy):8.1f} / {statistics.median(busy):8.1f} / {max(busy):8.1f}   "
                     f"instructions {min(n_per)} / {statistics.median(n_per):g} / {max(n_per)}   "
                     f"mean utilisation {100 * util:.1f}%")
    # makespan vs lower bound: the H200 model first (what the tape is expected to take), then the
    # per-SM model the queues were ordered with
    from schedule.fluid import FluidModel
    fm = FluidModel.h200(lay)
    flb = sel.expected_lower_bound(prog)
    lines.append("")
    caps = sorted({round(v / 1e9) for v in fm.cap.values()})
    lines.append(f"expected makespan (H200 shared-bandwidth model: chip {fm.hbm_bw / 1e12:.2f} TB/s of reads, an SM "
                 f"streams <= {'/'.join(map(str, caps))} GB/s with {t.stages - 1} blocks in flight, {fm.noise:.0%} "
                 f"jitter, {fm.ticket * 1e6:.1f} us a ticket;")
    lines.append(f"  fitted to H200 runs of the 70B layer) vs its bandwidth lower bound "
                 f"({total_hbm:,} HBM bytes / {fm.hbm_bw / 1e12:.2f} TB/s = {flb * 1e6:.1f} us):")
    for pol, c in comps.items():
        mark = "  <- tape" if pol == selected else ""
        e = c.expected_makespan()
        lines.append(f"  {pol:<12} expected {e * 1e6:9.1f} us   lower bound {flb * 1e6:9.1f} us   ratio {e / flb:6.3f}{mark}")
    lb = model.lower_bound(prog)
    lines.append("")
    lines.append(f"per-SM plan model (orders the queues; every SM at 1/{sel.tape.num_sms} of the bandwidth) vs "
                 f"its lower bound ({total_hbm:,} HBM bytes / {model.hbm_bw / 1e12:.2f} TB/s = {lb * 1e6:.1f} us):")
    for pol, c in comps.items():
        mark = "  <- tape" if pol == selected else ""
        lines.append(f"  {pol:<12} makespan {c.sched.makespan * 1e6:9.1f} us   lower bound {lb * 1e6:9.1f} us   "
                     f"ratio {c.sched.makespan / lb:6.3f}{mark}")
    return lines


def tape_target(a, cfg):
    """(tiling, lowering, what) of ``compile`` / ``viz``'s arguments: ``--tiling`` over the preset's defaults, or with
    ``--rows R`` the rows kernel's program of an R-row step (``opcodes.rows``: the bucket that holds R, ``--batch``
    cache slots) and its tiling. ValueError names the argument."""
    from opcodes import Tiling
    if a.rows is None:
        if a.batch is not None:
            raise ValueError("argument --batch: only with --rows (the cache slots of a rows program)")
        try:
            return (Tiling.from_spec(cfg, a.tiling, max_seq=a.max_seq) if a.tiling else None), None, ""
        except ValueError as e:
            raise ValueError(f"{'' if str(e).startswith('--tiling') else 'argument --tiling: '}{e}") from None
    from interp.rows import bucket
    from opcodes.rows import rows_tiling
    from schedule.compile import default_max_seq
    from schedule.rows_program import rows_lowering
    if not cfg.vocab:
        raise ValueError(f"argument --rows: a rows program is a whole model's (embedding to logits): the preset needs a "
                         f"vocabulary; {a.preset} has none (whole-model presets: llama3.2-1b, llama3.1-8b, llama3.1-70b)")
    b = bucket(a.rows)
    over = Tiling.parse_spec(a.tiling) if a.tiling else {}
    max_seq = a.max_seq or default_max_seq(cfg)
    batch = a.batch or 1
    if a.rows > batch * max_seq:
        raise ValueError(f"argument --rows: a step's rows are distinct (slot, position) pairs, at most --batch x "
                         f"--max-seq = {batch} x {max_seq}, got {a.rows}")
    try:
        til = rows_tiling(cfg, b, max_seq, **over)
    except ValueError as e:
        raise ValueError(f"argument --tiling: {e}") from None
    return til, rows_lowering(b, batch), f"a step of {a.rows} row(s) in the {b}-row bucket, {batch} cache slot(s)"


def cmd_compile(a, prog: str = "megatape compile") -> int:
    from opcodes import ModelConfig
    from schedule import TapeError

    err = _check_output_path(prog, a.output)
    if err:
        print(err, file=sys.stderr)
        return 2
    progress = _Progress()
    cfg = ModelConfig.from_name(a.preset)
    if a.layers:
        cfg = cfg.with_layers(a.layers)
    try:        # (before any progress line: a bad argument is one line)
        tiling, lowering, what = tape_target(a, cfg)
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    progress(f"{prog}: {cfg.name}, {cfg.layers} layer(s), {a.sms} SMs" + (f"; {what}" if what else ""))
    try:
        comps = compile_both(cfg, a.sms, a.max_seq, progress, getattr(a, "pool_us", None), tiling, lowering)
    except TapeError as e:
        print(f"{prog}: the verifier rejected the tape (a compiler bug):\n{e}", file=sys.stderr)
        return 1
    except ValueError as e:          # shape/tiling problems of this preset and arguments
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    sel = comps[a.policy]
    print("\n".join(summary_lines(comps, a.policy)))
    if a.listing:
        progress("listing ...")
        print()
        print(sel.tape.listing())
    if a.output:
        from schedule import CostModel
        model = CostModel()
        tape = sel.tape
        tape.meta.update({
            "compiler": f"megatape {_version()}", "preset": a.preset, "cfg_name": cfg.name,
            "num_sms": a.sms, "max_seq": tape.lay.max_seq, "policy": a.policy,
            "predicted_makespan_us": sel.sched.makespan * 1e6,
            "expected_makespan_us": sel.expected_makespan() * 1e6,
            "expected_lower_bound_us": sel.expected_lower_bound(sel.prog) * 1e6,
            "lower_bound_us": model.lower_bound(sel.prog) * 1e6,
            "cost_model": {"hbm_bw": model.hbm_bw, "l2_bw_sm": model.l2_bw_sm, "overhead": model.overhead},
        })
        tape.save(a.output)
        progress(f"wrote {a.output} ({os.path.getsize(a.output):,} bytes)")
    print(f"\ntime taken: {progress.elapsed():.2f} s (both schedules compiled and verified)")
    return 0


# ---- run: the README's main job ---------------------------------------------------------------
def vm_check(preset: str = "tiny", num_sms: int = 3, seeds=(0, 1, 2), max_seq: int = 64, prefill: int = 37):
    """Run the ``cost`` tape of ``preset`` in the tape VM under several interleavings; return the
    largest relative error against the torch reference."""
    import torch

    from opcodes import ModelConfig
    from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
    from schedule import compile_model
    from schedule.vm import run_tape

    cfg = ModelConfig.from_name(preset)
    tape = compile_model(cfg, num_sms, max_seq=max_seq).tape
    w = make_weights(cfg, seed=0)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    worst = 0.0
    for seed in seeds:
        kv = make_kv_cache(cfg, max_seq, prefill, seed=1)
        kv_ref = make_kv_cache(cfg, max_seq, prefill, seed=1)
        out = run_tape(tape, w, kv, x, prefill, seed=seed)
        ref = model_ref(w, kv_ref, cfg, x, prefill)
        worst = max(worst, rel_err(out, ref))
    return worst


def _gpu_available() -> bool:
    import torch
    return torch.cuda.is_available()


def cmd_run(a) -> int:
    cuda = not a.no_gpu and _gpu_available()
    sms = a.sms
    if sms is None:
        if cuda:
            import torch
            sms = torch.cuda.get_device_properties(0).multi_processor_count
        else:
            sms = DEFAULT_SMS
    ns = argparse.Namespace(preset=MAIN_PRESET, sms=sms, layers=None, max_seq=None, tiling="", rows=None, batch=None,
                            policy="cost", listing=False, output=a.output)
    rc = cmd_compile(ns, prog="megatape run")
    if rc:
        return rc
    tol = 1.5e-2
    t0 = time.perf_counter()
    err = vm_check()
    ok = err <= tol
    print(f"tape VM check (tiny preset, 3 SMs, 3 random interleavings, pos 37): max rel err {err:.2e} "
          f"vs the torch reference (tolerance {tol:g}): {'PASS' if ok else 'FAIL'} "
          f"({time.perf_counter() - t0:.1f} s)")
    if not ok:
        return 1
    if not cuda:
        why = "--no-gpu given" if a.no_gpu else "no CUDA device visible"
        print(f"GPU benchmark not run ({why})")
        return 0
    return gpu_benchmark(MAIN_PRESET)


def gpu_benchmark(preset: str, prefill: int = 4096, steps: int = 32) -> int:
    """``preset``'s default build on the GPU (``megatape.measure.measure_layer``): ``steps`` decode
    steps from position ``prefill`` checked against the torch reference, then timed; printed beside
    the floor. Exit status 1 if a check fails."""
    from megatape import measure
    from opcodes import ModelConfig

    cfg = ModelConfig.from_name(preset)
    print(f"\nGPU benchmark: {cfg.name}, {steps} decode steps from position {prefill}", flush=True)
    r = measure.measure_layer(cfg, prefill=prefill, steps=steps)
    ok = bool(r["correct"])
    print(f"{r['device']}: {r['instructions']} instructions on {r['num_sms']} SMs; stream copy "
          f"{r['stream_copy_Bps'] / 1e12:.3f} TB/s; {r['bytes_per_step']:,} bytes/step; floor {r['floor_us']:.1f} us")
    print(f"check: max rel err {r['rel_err_max']:.2e} vs the torch reference, written KV rows "
          f"{r['kv_rows_rel_err']:.2e} (tolerance {measure.TOL:g}), other rows untouched: "
          f"{r['kv_untouched_bitwise']}: {'PASS' if ok else 'FAIL'}")
    print(f"time: {r['us_event']:.1f} us/step (median of CUDA events), {r['us_wall']:.1f} us with a host sync; "
          f"{1e6 / r['us_event']:.0f} tokens/s; x floor {r['x_floor']:.3f}")
    return 0 if ok else 1


# ---- viz -----------------------------------------------------------------------------------------
def cmd_viz(a, prog: str = "megatape viz") -> int:
    from opcodes import ModelConfig
    try:
        from megatape.views.viz import render
    except ModuleNotFoundError as e:
        if e.name == "matplotlib" or (e.name or "").startswith("matplotlib."):
            print(f"{prog}: needs matplotlib (pip install 'megatape[plots]')", file=sys.stderr)
            return 2
        raise
    try:
        cfg = ModelConfig.from_name(a.preset)
        if a.layers is not None:
            cfg = cfg.with_layers(a.layers)
        tiling, lowering, _ = tape_target(a, cfg)
        render(cfg, a.sms, a.out, max_seq=a.max_seq, policy=a.policy, stage=a.stage, layer=a.layer, sm=a.sm,
               max_nodes=a.max_nodes, aggregate=a.aggregate, svg=not a.no_svg, tiling=tiling, lowering=lowering)
    except ValueError as e:     # bad stage, SM, layer count...: a message, not a traceback
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    return 0


# ---- generate ------------------------------------------------------------------------------------
def _interpret_if_no_gpu() -> None:
    """Before triton is first imported: with no CUDA device, kernels run in the Triton interpreter."""
    import torch
    if not torch.cuda.is_available() and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def _read_prompt(a) -> tuple[str | None, str | None]:
    """(the prompt, or None and an error line)."""
    if a.prompt is not None:
        return a.prompt, None
    if a.prompt_file is not None:
        try:
            with open(a.prompt_file, encoding="utf-8") as f:
                return f.read(), None
        except (OSError, UnicodeDecodeError) as e:
            return None, f"argument --prompt-file: cannot read {a.prompt_file!r}: {e}"
    return sys.stdin.read(), None


def cmd_generate(a, prog: str = "megatape generate") -> int:
    import torch

    from interp.runtime import teardown
    from interp.textgen import Checkpoint, floor_seconds, generate_text
    from opcodes import next_pow2

    def fail(msg: str) -> int:
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return 2

    text, err = _read_prompt(a)
    if err:
        return fail(err)
    try:
        ck = Checkpoint.open(a.model)
    except (FileNotFoundError, ValueError, ImportError) as e:
        return fail(f"argument --model: {e}")
    try:
        ids = ck.encode(text, chat=a.chat)
    except ValueError as e:
        return fail(f"argument --chat: {str(e)[len('chat: '):]}" if str(e).startswith("chat:") else f"{e}")
    if a.max_seq is not None and ck.context is not None and a.max_seq > ck.context:
        return fail(f"argument --max-seq: {a.max_seq} is past the model's context of {ck.context} positions "
                    "(config.json's max_position_embeddings)")
    ctx = a.max_seq or ck.context or len(ids) + a.max_new_tokens
    src = "--max-seq" if a.max_seq else ("config.json's max_position_embeddings" if ck.context else "")
    if len(ids) > ctx:
        return fail(f"prompt: {len(ids)} tokens, longer than the context of {ctx} positions ({src})")
    n_new = min(a.max_new_tokens, ctx - len(ids) + 1)
    if n_new < a.max_new_tokens:
        print(f"{prog}: note: at most {n_new} new tokens fit the context of {ctx} positions ({src})", file=sys.stderr)
    max_seq = min(ctx, next_pow2(max(len(ids) + n_new, 16)))     # few distinct kernels across runs
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    t0 = time.perf_counter()
    try:
        ck.load_weights(device)
    except (FileNotFoundError, ValueError) as e:       # a missing shard or tensor, a shape config.json contradicts
        return fail(f"argument --model: {e}")
    try:
        h = ck.build(max_seq, sampling=a.temperature > 0, device=device)
    except (ValueError, TypeError) as e:
        return fail(e)
    t_build = time.perf_counter() - t0
    try:
        gen = generate_text(h, ck.tokenizer, ids, n_new, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p,
                            seed=a.seed, eos_token_ids=ck.eos_token_ids, stop=a.stop or ())
        for piece in gen:
            sys.stdout.write(piece)
            sys.stdout.flush()
        if sys.stdout.isatty():
            sys.stdout.write("\n")
            sys.stdout.flush()
    finally:
        teardown(h.layer)
    st = gen.stats
    mode = "greedy" if a.temperature == 0 else \
        f"sampled: temperature {a.temperature:g}, top-k {a.top_k or 'off'}, top-p {a.top_p:g}, seed {a.seed}"
    reason = {"eos": "an EOS token", "stop": "a --stop string", "max_new_tokens": "--max-new-tokens"}[st.stop_reason]
    lines = [f"{prog}: {ck.path}: {len(h.tape)} instructions on {h.layer.num_sms} SM(s) "
             f"{'(GPU)' if cuda else '(CPU, Triton interpreter)'}, built in {t_build:.2f} s; {mode}",
             f"  prompt tokens {st.prompt_tokens}, new tokens {st.new_tokens} (stopped by {reason})",
             f"  time to first token {st.first_token_s:.3f} s ({st.prompt_tokens} prompt steps)"]
    per_token = st.decode_s / (st.new_tokens - 1) if st.new_tokens > 1 else float("nan")
    tps = st.decode_tokens_per_s
    lines.append(f"  decode {tps:.2f} tokens/s" + (f" ({1e3 * per_token:.2f} ms/token over {st.new_tokens - 1} "
                                                  "tokens)" if st.new_tokens > 1 else " (n/a: fewer than 2 tokens)"))
    if cuda and st.new_tokens > 1:
        from megatape.measure import stream_copy_bandwidth
        bw = stream_copy_bandwidth(h.device, nbytes=1 << 30)
        fl = floor_seconds(ck.cfg, st.last_pos, bw)
        lines.append(f"  x floor {per_token / fl:.3f} (floor {fl * 1e6:.1f} us/step at position {st.last_pos}: "
                     f"bytes per step over {bw / 1e12:.3f} TB/s stream copy)")
    else:
        lines.append("  x floor n/a (no GPU)" if not cuda else "  x floor n/a (fewer than 2 new tokens)")
    print("\n".join(lines), file=sys.stderr)
    return 0


# ---- serve ---------------------------------------------------------------------------------------
DEFAULT_SERVE_SEQ = 2048     # positions per slot when --max-seq is not given (at most the model's context)


def _chat_encoder(ck):
    """messages -> token ids through the tokenizer's chat template (None if it has none)."""
    tok = ck.tokenizer
    if not getattr(tok, "chat_template", None):
        return None

    def chat(messages: list[dict]) -> list[int]:
        try:
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:            # jinja's TemplateError (raise_exception in a template), ...
            raise ValueError(f"the chat template rejects them: {type(e).__name__}: {e}") from None
        if isinstance(ids, dict) or hasattr(ids, "keys"):     # a BatchEncoding
            ids = ids["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("the chat template made no tokens")
        return ids
    return chat


class _Log:
    """One-line progress messages on stderr, prefixed with the command's name."""

    def __init__(self, prog: str):
        self.prog = prog

    def __call__(self, line: str) -> None:
        if not line.startswith(self.prog.split()[0]):
            line = f"{self.prog}: {line}"
        print(line, file=sys.stderr, flush=True)


def cmd_serve(a, prog: str = "megatape serve") -> int:
    import signal
    import socket

    import torch

    def fail(msg: str, status: int = 2) -> int:
        print(f"{prog}: error: {' '.join(str(msg).split())}", file=sys.stderr)
        return status

    try:
        import uvicorn

        from megatape.serve.app import create_app
    except ImportError as e:
        return fail(f"serving needs the 'serve' extra (pip install 'megatape[serve]'): {e}")
    from interp.textgen import Checkpoint
    from megatape.serve import Engine, KernelBackend, RefBackend, batched_kernel_available

    log = _Log(prog)
    try:
        ck = Checkpoint.open(a.model)
    except (FileNotFoundError, ValueError, ImportError) as e:
        return fail(f"argument --model: {e}")
    ctx = ck.context
    if a.max_seq is not None:
        if ctx is not None and a.max_seq > ctx:
            return fail(f"argument --max-seq: {a.max_seq} is past the model's context of {ctx} positions "
                        "(config.json's max_position_embeddings)")
        max_seq = a.max_seq
    else:
        max_seq = min(ctx or DEFAULT_SERVE_SEQ, DEFAULT_SERVE_SEQ)
        if ctx is None or ctx > max_seq:
            log(f"note: {max_seq} positions per sequence (--max-seq; the model's context is "
                f"{ctx if ctx else 'not given'})")
    cuda = torch.cuda.is_available()
    kernel_ok = batched_kernel_available()
    backend_name = a.backend
    if backend_name == "kernel" and not kernel_ok:
        return fail("argument --backend: kernel needs interp's batched prefill / decode_step, which this "
                    "build does not have; use --backend ref")
    if backend_name == "auto":
        backend_name = "kernel" if kernel_ok and cuda else "ref"
        if backend_name == "ref":
            why = "this build has no batched kernel API" if not kernel_ok else "no GPU"
            log(f"note: the ref backend (the torch reference of the batched decoder; {why})")
    device = "cuda" if cuda else "cpu"
    log(f"loading {ck.path} ({ck.cfg['layers']} layers, d {ck.cfg['d']}, vocabulary {ck.cfg['vocab']}) on {device}")
    try:
        weights = ck.load_weights(device)
    except (FileNotFoundError, ValueError) as e:
        return fail(f"argument --model: {e}")
    try:
        if backend_name == "kernel":
            log("building the rows kernels (a bucket per step size up to the slots or the prefill chunk)")
            backend = KernelBackend(weights, ck.cfg, a.max_batch, max_seq, device=device,
                                    prefill_chunk=a.prefill_chunk, log=log)
        else:
            backend = RefBackend(weights, ck.cfg, a.max_batch, max_seq, device=device)
    except (ValueError, TypeError, RuntimeError) as e:
        return fail(f"argument --backend: {backend_name}: {e}")
    engine = Engine(backend, ck.tokenizer, ck.eos_token_ids, prefill_chunk=a.prefill_chunk, max_queue=a.max_queue,
                    step_delay_s=a.step_delay_ms / 1e3, log=log)
    model_id = a.model_name or str(a.model)
    app = create_app(engine, model_id=model_id, encode=ck.encode, chat=_chat_encoder(ck), context=max_seq, log=log)

    try:
        family = socket.getaddrinfo(a.host, a.port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as e:
        return fail(f"argument --host: {a.host!r}: {e}")
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((a.host, a.port))
    except OSError as e:
        sock.close()
        return fail(f"argument --port: cannot listen on {a.host}:{a.port}: {e.strerror or e}", 1)
    sock.listen(2048)
    sock.set_inheritable(True)
    port = sock.getsockname()[1]

    class Server(uvicorn.Server):
        draining = False

        def handle_exit(self, sig, frame):
            """SIGTERM / SIGINT: new requests (and /health) get 503 while the running and queued ones finish;
            then uvicorn's graceful shutdown (the socket closes only then: a load balancer sees the 503, not a
            refused connection) and exit 0, without re-raising the signal afterwards. A second SIGINT quits
            without waiting."""
            if self.draining and sig == signal.SIGINT:
                self.force_exit = self.should_exit = True
                return
            if self.draining:
                return
            st = engine.stats()
            log(f"{signal.Signals(sig).name}: draining ({st['running']} running, {st['queued']} queued); "
                "new requests get 503")
            engine.drain()
            self.draining = True

        async def on_tick(self, counter: int) -> bool:
            if await super().on_tick(counter):
                return True
            if self.draining:       # (every 0.1 s) the accepted requests done: stop listening, then exit
                st = engine.stats()
                self.should_exit = st["running"] == 0 and st["queued"] == 0
            return self.should_exit

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on", timeout_keep_alive=5)
    server = Server(config)
    host = f"[{a.host}]" if ":" in a.host else a.host
    log(f"{model_id}: backend {backend.name}, {backend.max_batch} slots x {max_seq} positions, prefill chunks of "
        f"{a.prefill_chunk} tokens, queue of {a.max_queue}")
    log(f"listening on http://{host}:{port} (SIGTERM or Ctrl-C: finish the running requests and stop)")
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        engine.shutdown(wait=not server.force_exit, timeout=None if not server.force_exit else 1.0)
        backend.close()
    st = engine.stats()
    log(f"stopped: {st['finished']} requests finished, {st['cancelled']} cancelled, {st['refused']} refused, "
        f"{st['failed']} failed")
    return 0


COMMANDS = {"compile": cmd_compile, "run": cmd_run, "viz": cmd_viz, "generate": cmd_generate, "serve": cmd_serve}


def _add_tape_args(p, presets) -> None:
    """What a tape is compiled for: --preset, --sms, --layers, --max-seq (compile and viz)."""
    p.add_argument("--preset", required=True, choices=list(presets), metavar="NAME",
                   help=f"model preset, one of: {', '.join(presets)}")
    p.add_argument("--sms", required=True, type=_positive_int, metavar="N", help="number of SMs (queues)")
    p.add_argument("--layers", type=_positive_int, default=None, metavar="N",
                   help="override the preset's layer count")
    p.add_argument("--max-seq", type=_positive_int, default=None, metavar="N",
                   help="KV cache length the tape is compiled for (default: 4224 for d >= 1024, else 256)")
    p.add_argument("--tiling", default="", metavar="SPEC",
                   help="Tiling fields over the preset's defaults, e.g. 'gu_rows=32,res_fold=1' (opcodes.Tiling)")
    p.add_argument("--rows", type=_int_in(1, 1024, "an integer in [1, 1024]"), default=None, metavar="R",
                   help="the many-rows kernel's tape of a step of R rows (batched decode or a prefill chunk; the "
                        "bucket of 16 ... 1024 rows that holds R; a whole-model preset)")
    p.add_argument("--batch", type=_positive_int, default=None, metavar="B",
                   help="with --rows: the KV cache's sequence slots (default 1)")


def _add_viz(sub, presets) -> None:
    v = sub.add_parser("viz", help="pictures of a schedule: the DAG, zooms, the planned Gantt chart and trace",
                       description="Compile a preset and write into --out: dag.png/.svg (the tile DAG, "
                       "aggregated), dag_zoom_*.png/.svg (with --stage/--layer/--sm), dag.dot/.graphml and "
                       "dag_agg.dot (graph files), plan_gantt.png (the planned schedule, one row per SM) "
                       "and plan_trace.json (the plan as a Chrome / Perfetto trace).")
    _add_tape_args(v, presets)
    v.add_argument("--policy", default="cost", choices=POLICIES, help=POLICY_HELP)
    v.add_argument("--out", required=True, metavar="DIR", help="output directory (created)")
    v.add_argument("--stage", default=None, help="zoom: tiles of one stage (opcode name or stage number)")
    v.add_argument("--layer", type=int, default=None, help="zoom: tiles of one layer")
    v.add_argument("--sm", type=int, default=None, help="zoom: tiles on one SM, in queue order")
    v.add_argument("--max-nodes", type=_positive_int, default=120, metavar="N", help="zoom: most tiles drawn (default 120)")
    v.add_argument("--aggregate", default="auto", choices=("auto", "signal", "opcode"),
                   help="aggregate DAG: group tiles by (layer, opcode, counter signalled) or (layer, opcode)")
    v.add_argument("--no-svg", action="store_true", help="skip the SVGs")


def _add_generate(sub) -> None:
    g = sub.add_parser("generate", help="text in, text out: generate from a Hugging Face Llama checkpoint",
                       description="Read config.json, the safetensors and tokenizer.json of a Hugging Face Llama "
                       "checkpoint directory, run the prompt (--prompt, --prompt-file, or stdin) one launch per "
                       "token and stream the generated text to stdout; counts, time to first token, decode "
                       "tokens/s and x floor go to stderr. Greedy by default (the ARGMAX opcode); --temperature "
                       "> 0 samples on the device (the SAMPLE opcode: top-k, top-p, Philox seeded by --seed and "
                       "the position). Stops at the checkpoint's EOS tokens, a --stop string (not printed) or "
                       "--max-new-tokens. Without a GPU it runs in the Triton interpreter (tiny models only).")
    g.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json)")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="the prompt (default: read stdin)")
    src.add_argument("--prompt-file", metavar="PATH", help="read the prompt from a file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template (one user "
                   "message, then the assistant's turn)")
    g.add_argument("--max-new-tokens", type=_positive_int, default=128, metavar="N", help="default 128")
    g.add_argument("--temperature", type=_number_in(0.0, math.inf, False, "a number >= 0"), default=0.0, metavar="T",
                   help="0 (default): greedy; > 0: sample from softmax(logits / T)")
    g.add_argument("--top-k", type=_int_in(0, 2**31 - 1, "an integer >= 0"), default=0, metavar="K",
                   help="sample among the K largest logits (0, default: off)")
    g.add_argument("--top-p", type=_number_in(0.0, 1.0, True, "a number in (0, 1]"), default=1.0, metavar="P",
                   help="sample among the fewest tokens whose probability reaches P (1, default: off)")
    g.add_argument("--seed", type=_int_in(0, 2**31 - 1, "an integer in [0, 2**31)"), default=0, metavar="S",
                   help="the sampler's seed (default 0): the same seed and prompt give the same text")
    g.add_argument("--stop", action="append", type=_nonempty, metavar="STRING",
                   help="stop before this string (repeatable)")
    g.add_argument("--max-seq", type=_positive_int, default=None, metavar="N", help="context length in positions "
                   "(default: config.json's max_position_embeddings)")


def _add_serve(sub) -> None:
    g = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with continuous batching",
                       description="Serve a Hugging Face Llama checkpoint directory over HTTP with the OpenAI API: "
                       "POST /v1/completions and /v1/chat/completions (streamed as server-sent events or not), "
                       "GET /v1/models and /health. Requests join the running batch between steps and leave "
                       "when done; prompts are prefilled in chunks between the decode steps; temperature, "
                       "top_p, top_k, seed, stop and max_tokens as the OpenAI API defines them. A full queue "
                       "answers 429; SIGTERM stops taking requests (503), finishes the accepted ones and exits 0.")
    g.add_argument("--model", required=True, metavar="DIR", help="checkpoint directory (config.json, *.safetensors, "
                   "tokenizer.json)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=_int_in(0, 65535, "a port in [0, 65535]"), default=8000,
                   help="port (default 8000; 0: any free port, printed on stderr)")
    g.add_argument("--max-batch", type=_positive_int, default=8, metavar="N",
                   help="sequences decoded together: the KV cache's slots (default 8)")
    g.add_argument("--max-queue", type=_int_in(0, 2**31 - 1, "an integer >= 0"), default=256, metavar="N",
                   help="requests waiting for a slot before new ones get 429 (default 256)")
    g.add_argument("--max-seq", type=_positive_int, default=None, metavar="N",
                   help=f"positions per sequence, prompt and completion (default: config.json's "
                   f"max_position_embeddings, at most {DEFAULT_SERVE_SEQ})")
    g.add_argument("--prefill-chunk", type=_positive_int, default=128, metavar="N",
                   help="prompt tokens per prefill call; one call per step beside the decodes (default 128)")
    g.add_argument("--backend", choices=("auto", "kernel", "ref"), default="auto",
                   help="kernel: the batched megakernel; ref: the torch reference of the same steps; auto "
                   "(default): kernel where it is available and there is a GPU, else ref")
    g.add_argument("--model-name", metavar="NAME", default=None,
                   help="the model id clients name (default: --model as given)")
    g.add_argument("--step-delay-ms", type=_nonneg_float, default=0.0, metavar="MS",
                   help="pause after every step (demonstrations and tests of batching and draining; default 0)")


def build_parser() -> argparse.ArgumentParser:
    from opcodes import PRESETS

    ap = _Parser(prog="megatape", description="megatape: compile, verify and run instruction tapes "
                 "for a persistent Triton decode megakernel.")
    ap.add_argument("--version", action="version", version=f"megatape {_version()}")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    c = sub.add_parser("compile", help="compile a preset to a verified tape and print its schedule summary",
                       description="Compile a preset to a verified instruction tape for N SMs; print "
                       "instructions per opcode, counters, the verifier's report, per-SM busy time and the "
                       "predicted makespan beside the bandwidth lower bound, for the cost-model schedule "
                       "and for round-robin.")
    _add_tape_args(c, PRESETS)
    c.add_argument("--policy", choices=POLICIES, default="cost",
                   help="schedule written by --listing / -o (both are always compiled and compared)")
    c.add_argument("--pool-us", type=_nonneg_float, default=None, metavar="US",
                   help="the cost schedule's last US microseconds go to a pool taken by ticket at run time "
                        "(default 60; 0: static queues only)")
    c.add_argument("--listing", action="store_true", help="print the human-readable tape")
    c.add_argument("-o", "--output", metavar="PATH", help="write the tape with its metadata as JSON")
    r = sub.add_parser("run", help=f"the main job: compile {MAIN_PRESET} and summarise it on the CPU, check "
                       "the tape VM, and check and time the layer on the GPU when one is visible",
                       description=f"The main job. Compile the 70B-class decoder layer ({MAIN_PRESET}) to a verified "
                       f"tape for the GPU's SM count (--sms; {DEFAULT_SMS} without a GPU) and print its schedule "
                       "summary (as 'megatape compile'); run a tiny preset's tape in the tape VM under 3 random SM "
                       "interleavings against the torch reference (tolerance 1.5e-2); then, with a GPU, build the "
                       "layer's megakernel, check 32 decode steps from position 4096 against the reference (the KV "
                       "cache written in place, its other rows untouched) and time them beside the HBM floor. "
                       "Exit status 1 if a check fails.")
    r.add_argument("--sms", type=_positive_int, metavar="N",
                   help=f"SMs to compile for (default: the GPU's, or {DEFAULT_SMS} without one)")
    r.add_argument("-o", "--output", metavar="PATH", help="write the tape with its metadata as JSON")
    r.add_argument("--no-gpu", action="store_true", help="do not check and time the layer on the GPU even if one "
                   "is visible")
    _add_viz(sub, PRESETS)
    _add_generate(sub)
    _add_serve(sub)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["generate"], ["serve"]):
        _interpret_if_no_gpu()
    return dispatch(build_parser(), COMMANDS, argv, "megatape")


def dispatch(ap, commands: dict, argv: list, prog: str) -> int:
    """Parse ``argv`` with ``ap`` and run its subcommand from ``commands`` (name -> function of the parsed
    arguments, returning the exit status): --help and argument errors return their status, an OSError is a
    one-line message naming the path (status 1), no subcommand prints the help (status 2). ``python -m bench``
    runs its commands through this too."""
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:          # --help, --version, argument errors: return the status
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if a.cmd in commands:
        try:
            return commands[a.cmd](a)
        except OSError as e:      # a path that cannot be written or read: a message, not a traceback
            where = f": {e.filename}" if e.filename else ""
            print(f"{prog} {a.cmd}: error: {e.strerror or e}{where}", file=sys.stderr)
            return 1
    ap.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
