"""What sampling on the device costs: greedy (ARGMAX) against SAMPLE (temperature, top-k, top-p),
both one launch per token, on a whole-model decoder with random weights.

    python3 -m bench.sample_bench [--preset llama3.2-1b] [--pos 128] [--tokens 128] [--profile]

For each setting, ``generate`` runs ``--tokens`` tokens after a one-token prompt at ``--pos``
(the KV cache prefilled with random rows before it) and is timed with CUDA events (on a CPU, for
a tiny preset under the Triton interpreter, with the wall clock: only to try the script). Prints
us/token and tokens/s per setting and the sampled settings' ratio to greedy. ``--profile`` (a GPU):
also each setting's last token as the profiling build ran it (``megatape.views``' per-opcode and
per-stage tables), to tell a slower SAMPLE from slower layers.
"""
from __future__ import annotations

import argparse
import time

import torch

from opcodes import PRESETS

SETTINGS = (("greedy", dict(temperature=0.0)),
            ("T 0.8", dict(temperature=0.8, seed=1)),
            ("T 0.8, top-p 0.95", dict(temperature=0.8, top_p=0.95, seed=1)),
            ("T 0.8, top-k 50, top-p 0.95", dict(temperature=0.8, top_k=50, top_p=0.95, seed=1)))


def _time(fn, cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) * 1e-3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.sample_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.2-1b", choices=[n for n, c in PRESETS.items() if c.vocab])
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="also profile each setting's last token (a GPU)")
    a = ap.parse_args(argv)
    if a.profile and not torch.cuda.is_available():
        ap.error("--profile needs a GPU (the profiling build reads %globaltimer)")
    from interp import build_decoder, generate, teardown
    from opcodes.sample import PATHS
    from opcodes.reference import make_kv_cache
    from .decoder_bench import make_decoder_weights
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = PRESETS[a.preset]
    max_seq = a.pos + a.tokens + 1
    w = make_decoder_weights(cfg, 0, dev)
    rows = []
    for name, kw in SETTINGS:
        kv = make_kv_cache(cfg, max_seq, a.pos, device=dev)
        h = build_decoder(w, kv, cfg.to_dict(), max_seq, sampling=kw["temperature"] > 0)
        run = lambda: generate(h, [1], a.tokens, start_pos=a.pos, **kw)   # noqa: E731
        run()                                                              # warm-up
        ts = sorted(_time(run, cuda) for _ in range(a.repeats))
        us = ts[len(ts) // 2] * 1e6 / a.tokens
        path = "-"
        if h.sampling:      # where the last token's thresholds came from (opcodes.sample.mass_words)
            path = PATHS[int(h.layer.scratch["smp_mass"][-1])]
        rows.append((name, us, path))
        teardown(h)
        if a.profile:
            _profile(name, w, cfg, max_seq, kw, a)
    base = rows[0][1]
    print(f"{torch.cuda.get_device_name() if cuda else 'CPU (Triton interpreter)'}, {a.preset}, "
          f"positions {a.pos}..{a.pos + a.tokens}, median of {a.repeats}")
    print("| setting | us/token | tokens/s | vs greedy | SAMPLE's path (last token) |")
    print("|---|---|---|---|---|")
    for name, us, path in rows:
        print(f"| {name} | {us:.1f} | {1e6 / us:.1f} | {us / base:.3f} | {path} |")
    return 0


def _profile(name, w, cfg, max_seq, kw, a) -> None:
    """One setting's last token, profiled: the per-opcode and per-stage tables."""
    from interp import build_decoder, generate, teardown
    from interp.runtime import profile_records
    from megatape import views
    from opcodes.reference import make_kv_cache
    kv = make_kv_cache(cfg, max_seq, a.pos, device=torch.device("cuda"))
    h = build_decoder(w, kv, cfg.to_dict(), max_seq, sampling=kw["temperature"] > 0, profile=True)
    generate(h, [1], 4, start_pos=a.pos, **kw)
    summ = views.summarize(h.layer.tape, profile_records(h.layer), pos=a.pos + 3)
    summ.pop("records", None)
    print(f"--- {name}: the profiled last token", flush=True)
    print(views.format_summary(summ), flush=True)
    teardown(h)


if __name__ == "__main__":
    raise SystemExit(main())
