"""Host cost of decoding with megatape: plain launches against CUDA-graph blocks of K tokens.

    python3 -m bench.host_cost [--preset llama3.2-1b] [--pos 128] [--tokens 256] [--blocks 1,8,32] [--sampling]

For the whole-model decoder, ``generate`` runs ``--tokens`` greedy tokens (a) with one host launch
per token and (b) as replays of a captured graph of K launches (the call count and the position
live on the device, so the same launch replays correctly). Per token it reports the GPU time
between two CUDA events, the wall time to a synchronised finish, and the host time spent inside
``generate`` (wall before the synchronisation), and checks that every variant produced the same
tokens. ``--sampling``: a decoder that ends in SAMPLE (temperature 0.8, top-k 50, top-p 0.95,
seed 1), whose draws are seeded by the position the kernel takes from the device. Prints a
Markdown table; ``--out`` also writes it as JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from opcodes import PRESETS


SAMPLING = dict(temperature=0.8, top_k=50, top_p=0.95, seed=1)


def _measure(h, prompt, n: int, block: int, pos: int, kw: dict) -> tuple[float, float, float, torch.Tensor]:
    from interp import generate
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    start.record()
    toks = generate(h, prompt, n, start_pos=pos, graph_block=block, **kw)
    end.record()
    t_host = time.perf_counter() - t0
    torch.cuda.synchronize()
    t_wall = time.perf_counter() - t0
    return start.elapsed_time(end) * 1e3 / n, t_wall * 1e6 / n, t_host * 1e6 / n, toks.cpu()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.host_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--pos", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--blocks", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sampling", action="store_true", help="SAMPLE instead of the greedy ARGMAX")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    from interp import build_decoder, teardown
    from opcodes.reference import make_kv_cache
    from .decoder_bench import make_decoder_weights
    cfg = PRESETS[a.preset]
    dev = torch.device("cuda")
    max_seq = a.pos + a.tokens + 8
    w = make_decoder_weights(cfg, 0, dev)
    kv = make_kv_cache(cfg, max_seq, a.pos, device=dev)
    h = build_decoder(w, kv, cfg.to_dict(), max_seq, sampling=a.sampling)
    kw = SAMPLING if a.sampling else {}
    prompt = [1]
    blocks = [0] + [int(b) for b in a.blocks.split(",") if b]
    rows, first = [], None
    for b in blocks:
        _measure(h, prompt, max(b, 1) * 2, b, a.pos, kw)             # warm-up (captures the graph)
        runs = [_measure(h, prompt, a.tokens, b, a.pos, kw) for _ in range(a.repeats)]
        ev, wall, host = (statistics.median(r[i] for r in runs) for i in range(3))
        toks = runs[-1][3]
        if first is None:
            first = toks
        same = bool(torch.equal(toks, first))
        rows.append({"launch": "plain (one host launch per token)" if b == 0 else f"CUDA graph, {b} tokens per replay",
                     "events_us_per_token": ev, "wall_us_per_token": wall, "host_us_per_token": host,
                     "wall_over_events": wall / ev, "same_tokens": same})
    teardown(h)
    print(f"{torch.cuda.get_device_name()}, {a.preset} ({'sampled' if a.sampling else 'greedy'}), "
          f"tokens {a.pos}..{a.pos + a.tokens}, "
          f"median of {a.repeats} runs of {a.tokens} tokens")
    print("| launch | events us/token | wall us/token | host us/token | wall / events | same tokens |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['launch']} | {r['events_us_per_token']:.1f} | {r['wall_us_per_token']:.1f} | "
              f"{r['host_us_per_token']:.1f} | {r['wall_over_events']:.3f} | {r['same_tokens']} |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"card": torch.cuda.get_device_name(), "preset": a.preset, "pos": a.pos,
                       "sampling": a.sampling, "rows": rows}, f, indent=1)
    return 0 if all(r["same_tokens"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
