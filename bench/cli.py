"""The lab's command line: ``python -m bench COMMAND`` from the repository root (GPU benchmarks).

    python -m bench layer   [--preset NAME] [--prefill P] [--steps N] [--baselines eager,compile,cublas]
                            [--tiling SPEC] [--variants 'SPEC;SPEC'] [--profile] ...   (bench/driver.py)
    python -m bench decoder [--preset NAME] [--pos P] [--steps N] [--tiling SPEC] [--variants ...]
                            [--profile] [--no-compile] [--tp 2]          (bench/decoder_bench.py;
                                                                          --tp 2: bench/tp_bench.py)
    python -m bench rows    [--preset NAME] [--B 1,4,8,16,32] [--pos P] [--prompts 128,1024,4096]
                            [--chunks 0,512] [--skip PARTS] [--no-hf]    (bench/rows_bench.py)
    python -m bench serve   [--preset NAME] [--clients 1,8,32] [--prompt N] [--new N]
                                                                         (bench/serve_bench.py)

Every argument is checked here before any GPU work; an argument error is one line naming the
argument, exit status 2. The product's own GPU check is ``megatape run`` (``megatape.measure``).
"""
from __future__ import annotations

import argparse
import sys

from megatape.cli import MAIN_PRESET, _Parser, _positive_int

from . import RESULTS

PROG = "python -m bench"


def _views():
    import megatape.views
    return megatape.views


def _bench_max_seq(a, prog: str, flag: str, extra: int = 0) -> bool:
    """``--pos`` / ``--prefill`` (``flag``: the command's name for it) and ``--max-seq`` of a bench:
    the positions a run writes are ``prefill .. prefill + max(steps, extra) - 1`` (``extra``: how many
    it decodes outside its timed steps). Without ``--max-seq`` the cache is sized for them
    (``megatape.measure.cache_rows``: 1152 and 4224 at the defaults); a given one too small, or a
    negative position, is one line naming the argument. False: the error is printed."""
    from megatape.measure import cache_rows
    n = max(a.steps, extra)
    last = a.prefill + n
    if a.prefill < 0:
        print(f"{prog}: error: {flag} {a.prefill}: a position is >= 0", file=sys.stderr)
        return False
    if a.max_seq is None:
        a.max_seq = cache_rows(a.prefill, n)
    elif a.max_seq < last:
        print(f"{prog}: error: --max-seq {a.max_seq}: the run writes positions up to {last - 1} "
              f"({flag} {a.prefill} and its steps); give --max-seq >= {last} or leave it out", file=sys.stderr)
        return False
    return True


def cmd_layer(a, prog: str = f"{PROG} layer") -> int:
    if not _bench_max_seq(a, prog, "--prefill"):
        return 2
    from .driver import run
    return int(run(a, views=_views()) or 0)


def cmd_decoder(a, prog: str = f"{PROG} decoder") -> int:
    from .decoder_bench import GREEDY_NEW, GREEDY_PROMPT     # its greedy check also decodes from --pos
    if not _bench_max_seq(a, prog, "--pos", extra=GREEDY_PROMPT + GREEDY_NEW):
        return 2
    if a.tp == 2:
        return _decoder_tp(a, prog)
    if a.tiling.strip():        # a bad --tiling is named here, before any GPU work
        from opcodes import ModelConfig
        from opcodes.decoder import DecoderLayout

        from .driver import INT_BUILD_KEYS, parse_variant
        cfg = ModelConfig.from_name(a.preset)
        try:
            til, build = parse_variant(cfg, a.tiling, a.max_seq)     # Tiling fields and build options
            DecoderLayout(cfg, til, a.max_seq, **{k: v for k, v in build.items() if k in INT_BUILD_KEYS})
        except (ValueError, TypeError) as e:
            msg = str(e)
            print(f"{prog}: error: {msg if msg.startswith('--tiling') else '--tiling: ' + msg}", file=sys.stderr)
            return 2
    from .decoder_bench import run
    return int(run(a, views=_views()) or 0)


def _decoder_tp(a, prog: str = f"{PROG} decoder") -> int:
    """``--tp 2``: bench/tp_bench.py's launcher (two GPUs, one process each; it sets the NCCL /
    symmetric-memory switches that keep NVLink multicast off for itself and its children)."""
    bad = [f for f, on in (("--variants", bool(a.variants.strip())), ("--tiling", bool(a.tiling.strip())),
                           ("--profile", a.profile)) if on]
    if bad:
        print(f"{prog}: error: {', '.join(bad)} are not supported with --tp 2", file=sys.stderr)
        return 2
    from . import tp_bench            # sets NCCL_NVLS_ENABLE=0 / TORCH_SYMM_MEM_DISABLE_MULTICAST=1 first
    argv = ["--out", a.out, "--preset", a.preset, "--pos", str(a.prefill), "--steps", str(a.steps),
            "--max-seq", str(a.max_seq), "--seed", str(a.seed)] + (["--no-baseline"] if a.no_compile else [])
    return int(tp_bench.main(argv) or 0)


#: the parts of the rows bench ``--skip`` can leave out (bench/rows_bench.py)
ROWS_PARTS = ("decode", "accuracy", "invariance", "ttft")


def _int_list(lo: int, hi: int):
    """An argparse type: a comma-separated list of ints in [lo, hi]."""
    def parse(text: str) -> list[int]:
        try:
            vals = [int(x) for x in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
        bad = [v for v in vals if not lo <= v <= hi]
        if bad:
            raise argparse.ArgumentTypeError(f"{bad[0]} is not in [{lo}, {hi}]")
        return vals
    return parse


def _one_int(lo: int, hi: int):
    """An argparse type: one int in [lo, hi]."""
    many = _int_list(lo, hi)

    def parse(text: str) -> int:
        if "," in text:
            raise argparse.ArgumentTypeError(f"expected one integer, got {text!r}")
        return many(text)[0]
    return parse


def _skip_list(text: str) -> list[str]:
    parts = [x for x in text.split(",") if x]
    bad = [x for x in parts if x not in ROWS_PARTS]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not one of {', '.join(ROWS_PARTS)}")
    return parts


def _csv(vals) -> str:
    return ",".join(str(v) for v in vals)


def cmd_rows(a, prog: str = f"{PROG} rows") -> int:
    from . import rows_bench
    argv = ["--preset", a.preset, "--B", _csv(a.B), "--pos", str(a.pos), "--prompts", _csv(a.prompts),
            "--chunks", _csv(a.chunks), "--reps", str(a.reps), "--skip", _csv(a.skip), "--out", a.out] \
        + (["--no-hf"] if a.no_hf else [])
    return int(rows_bench.main(argv) or 0)


def cmd_serve(a, prog: str = f"{PROG} serve") -> int:
    from . import serve_bench
    argv = ["--preset", a.preset, "--clients", _csv(a.clients), "--prompt", str(a.prompt), "--new", str(a.new),
            "--requests-per-client", str(a.requests_per_client), "--out", a.out]
    return int(serve_bench.main(argv) or 0)


COMMANDS = {"layer": cmd_layer, "decoder": cmd_decoder, "rows": cmd_rows, "serve": cmd_serve}


def _add_layer(sub, presets, policies) -> None:
    b = sub.add_parser("layer", help="GPU benchmark of a layer or a stack: correctness, timing, baselines",
                       description="Build, check and time megatape on the GPU beside eager torch, torch.compile "
                       "and cuBLAS (bench/driver.py): every step against the eager reference, the KV rows "
                       "other than the written ones bitwise untouched, CUDA-event medians, kernels per step, "
                       f"x the stream-copy floor. Writes <out>/<preset>[-<tag>].json and .md (default {RESULTS}).")
    b.add_argument("--preset", default=MAIN_PRESET, choices=list(presets), metavar="NAME",
                   help=f"one of {', '.join(presets)} (default {MAIN_PRESET})")
    b.add_argument("--layers", type=_positive_int, default=None, metavar="N", help="override the preset's layer count")
    b.add_argument("--prefill", type=int, default=4096)
    b.add_argument("--steps", type=_positive_int, default=32)
    b.add_argument("--max-seq", type=_positive_int, default=None,
                   help="KV cache length (default: the next multiple of 128 at least 64 past the last position)")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--baselines", default="eager,compile,cublas",
                   help="comma list of eager, compile, cublas (empty: megatape only)")
    b.add_argument("--tiling", default="", help="Tiling overrides of the main row, e.g. gu_rows=16,bk=1024")
    b.add_argument("--variants", default="", help=(
        "extra builds to check and time, ';'-separated, each a ','-list of Tiling fields (attn_stages=4) and "
        "build options: policy=cost|round-robin, bytesmodel=1 / attnmodel=1 (the cost model that orders the "
        "queues), pool=US (the plan's last US microseconds taken by ticket at run time), coop=0 (plain "
        "launch), fast=0 (Triton's launcher)"))
    b.add_argument("--profile", action="store_true", help="also run the profiling kernel and summarise it")
    b.add_argument("--policy", default="cost", choices=policies)
    b.add_argument("--profile-variants", action="store_true",
                   help="profile every variant too and print one line of its measured timeline")
    b.add_argument("--fp32-ref", action="store_true",
                   help="also compare with an all-fp32 reference (always on for more than one layer)")
    b.add_argument("--out", default=RESULTS, metavar="DIR", help=f"results directory (default {RESULTS})")
    b.add_argument("--tag", default="", help="appended to the result files' name: <preset>-<tag>.json")


def _whole_model_args(p, presets) -> None:
    """The ``--preset`` (a whole-model preset) and ``--out`` arguments of the whole-model benches."""
    whole = [n for n, c in presets.items() if c.vocab]
    p.add_argument("--preset", default="llama3.2-1b", choices=whole, metavar="NAME",
                   help=f"a whole-model preset, one of: {', '.join(whole)} (default llama3.2-1b)")
    p.add_argument("--out", default=RESULTS, metavar="DIR", help=f"results directory (default {RESULTS})")


def _add_decoder(sub, presets) -> None:
    d = sub.add_parser("decoder", help="whole-model GPU benchmark: logits, greedy tokens, timing",
                       description="A whole model (embedding, layers, final norm, LM head) on the GPU "
                       "(bench/decoder_bench.py): logits against the eager reference, greedy tokens of "
                       "generate, timing beside torch.compile. Writes <out>/decoder-<preset>-pos<P>.json and .md "
                       f"(default {RESULTS}).")
    _whole_model_args(d, presets)
    d.add_argument("--pos", "--prefill", dest="prefill", type=int, default=1024, metavar="P",
                   help="the first decode position (the KV cache holds P random rows; default 1024)")
    d.add_argument("--steps", type=_positive_int, default=32)
    d.add_argument("--max-seq", type=_positive_int, default=None,
                   help="KV cache length (default: the next multiple of 128 at least 64 past the last position "
                   "written: 1152 at the default --pos)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--no-compile", action="store_true",
                   help="skip the baselines (torch.compile of a static-cache decoder, transformers' generate)")
    d.add_argument("--variants", default="", help="extra tilings/build options to time, ';'-separated "
                   f"(as for {PROG} layer --variants)")
    d.add_argument("--tiling", default="", metavar="SPEC", help="the main build's tiling overrides and build "
                   "options, 'name=value,...' as one --variants entry (default: the preset's Tiling.for_config); "
                   "--profile profiles this build")
    d.add_argument("--profile", action="store_true", help="profile the main build and summarise it")
    d.add_argument("--tp", type=int, choices=(1, 2), default=1,
                   help="2: tensor parallel over two GPUs, one process each (bench/tp_bench.py: smoke, peer-death, "
                   "correctness and speed stages; writes <out>/decoder-<preset>-tp2.json and .md; --no-compile "
                   "skips the NCCL baseline)")


def _add_rows(sub, presets) -> None:
    from opcodes.rows import BUCKETS
    r = sub.add_parser("rows", help="many rows per step: batched decode, time to first token, accuracy, invariance",
                       description="The many-rows kernels on the GPU (bench/rows_bench.py): batched decode "
                       "tokens/s at each B beside the one-row kernel's B=1, time to the first token of each prompt "
                       "length beside transformers' forward over the prompt, every row's accuracy against the "
                       "fp32 reference, a row's logits alone and in a batch. Writes <out>/rows-<preset>.json "
                       f"(default {RESULTS}).")
    _whole_model_args(r, presets)
    r.add_argument("--B", type=_int_list(1, BUCKETS[-1]), default=[1, 4, 8, 16, 32],
                   help=f"batch sizes of the decode part, each in [1, {BUCKETS[-1]}] (default 1,4,8,16,32)")
    r.add_argument("--pos", type=_one_int(0, 1 << 20), default=1024,
                   help="the decode rows' position (the KV cache holds that many random rows; default 1024)")
    r.add_argument("--prompts", type=_int_list(1, 1 << 20), default=[128, 1024, 4096],
                   help="prompt lengths of the time-to-first-token part (default 128,1024,4096)")
    r.add_argument("--chunks", type=_int_list(0, BUCKETS[-1]), default=[0],
                   help=f"prefill chunk sizes each prompt is timed with, each in [0, {BUCKETS[-1]}] (0: prefill's "
                        "default chunks; default 0)")
    r.add_argument("--reps", type=_positive_int, default=10, help="timed repetitions of each prefill (default 10)")
    r.add_argument("--skip", type=_skip_list, default=[],
                   help=f"parts to leave out, comma-separated: {', '.join(ROWS_PARTS)}")
    r.add_argument("--no-hf", action="store_true", help="no transformers baseline")


def _add_serve(sub, presets) -> None:
    s = sub.add_parser("serve", help="the serving engine under 1 / 8 / 32 concurrent clients",
                       description="megatape serve's engine over the kernel backend on the GPU "
                       "(bench/serve_bench.py): tokens/s and time to first token (p50 / p99) at each number of "
                       "concurrent clients beside single-stream generate. Writes <out>/serve-<preset>.json "
                       f"(default {RESULTS}).")
    _whole_model_args(s, presets)
    s.add_argument("--clients", type=_int_list(1, 512), default=[1, 8, 32],
                   help="numbers of concurrent clients, each in [1, 512] (default 1,8,32)")
    s.add_argument("--prompt", type=_positive_int, default=128, help="prompt tokens a request (default 128)")
    s.add_argument("--new", type=_positive_int, default=64, help="new tokens a request (default 64)")
    s.add_argument("--requests-per-client", type=_positive_int, default=2)


def build_parser() -> argparse.ArgumentParser:
    from opcodes import PRESETS
    from schedule.compile import POLICIES

    ap = _Parser(prog=PROG, description="megatape's benchmarks on the GPU (the lab; run from the repository "
                 "root). The product's own check on a GPU is 'megatape run'.")
    sub = ap.add_subparsers(dest="cmd", metavar="COMMAND")
    _add_layer(sub, PRESETS, POLICIES)
    _add_decoder(sub, PRESETS)
    _add_rows(sub, PRESETS)
    _add_serve(sub, PRESETS)
    return ap


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from megatape.cli import dispatch
    return dispatch(build_parser(), COMMANDS, argv, PROG)


if __name__ == "__main__":
    sys.exit(main())
