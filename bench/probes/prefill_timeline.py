"""Where a prompt's prefill time goes (issue 50): the GPU kernels of one ``prefill`` call, their durations and
the gaps between them, against the wall time the rows bench reports (events around the call).

    python -m bench.probes.prefill_timeline --preset llama3.2-1b --prompts 1024,4096 [--batch 32]
        [--lm-rows 64] [--tiling o_rows=32]

Runs 299-302 (H100): the last 512-row chunk of a 4096 prompt took 3830 us in ``rows_profile`` (10 launches
back to back), yet ``prefill`` took 8.92 ms for 1024 tokens (two chunks, the first with few keys) and
32.14 ms for 4096 (eight): this says whether the rest is kernel time (early chunks slower than the last),
host time between launches, or other kernels.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--prompts", default="1024,4096")
    p.add_argument("--batch", type=int, default=32, help="the decoder's slots (the rows bench's TTFT: 32)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--lm-rows", type=int, default=0,
                   help="vocabulary rows per LM head tile in the buckets past the decode ones (0: the layout's)")
    p.add_argument("--tiling", default="",
                   help="k=v,... Tiling fields set in the buckets past the decode ones (e.g. o_rows=32)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.probes.prefill_timeline: needs a CUDA GPU", file=sys.stderr)
        return 2
    from torch.profiler import ProfilerActivity, profile

    from bench.decoder_bench import make_decoder_weights
    from interp import build_decoder, prefill
    from interp.rows import prefill_chunks
    from opcodes.config import ModelConfig
    from opcodes.reference import make_kv_cache

    if a.lm_rows:
        import interp.rows as ir
        from opcodes.rows import DECODE_BUCKETS
        low = ir.rows_lowering
        ir.rows_lowering = lambda rows, batch: low(rows, batch, lm_rows=a.lm_rows if rows > DECODE_BUCKETS[-1] else 0)
    if a.tiling:
        import interp.rows as ir
        from opcodes.rows import DECODE_BUCKETS
        over = {k: int(v) for k, v in (kv.split("=") for kv in a.tiling.split(","))}
        base = ir.rows_tiling
        ir.rows_tiling = lambda cfg, rows, max_seq, **o: base(cfg, rows, max_seq,
                                                              **({**over, **o} if rows > DECODE_BUCKETS[-1] else o))
    cfg = ModelConfig.from_name(a.preset)
    prompts = [int(x) for x in a.prompts.split(",")]
    max_seq = -(-(max(prompts) + 8) // 128) * 128
    w = make_decoder_weights(cfg, seed=0, device="cuda")
    kv = make_kv_cache(cfg, max_seq, 0, seed=1, device="cuda", batch=a.batch)
    h = build_decoder(w, kv, cfg, max_seq, batch=a.batch)
    g = torch.Generator().manual_seed(3)
    for n in prompts:
        toks = torch.randint(0, cfg.vocab, (n,), generator=g).tolist()
        lg = prefill(h, toks, 0, slot=1)
        torch.cuda.synchronize()
        print(f"prompt {n}: logits argmax {int(lg.argmax())}, sum {float(lg.double().sum()):.6e}", flush=True)
        walls, hosts = [], []
        for _ in range(a.reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            e0.record()
            prefill(h, toks, 0, slot=1)
            e1.record()
            hosts.append((time.perf_counter() - t) * 1e3)
            torch.cuda.synchronize()
            walls.append(e0.elapsed_time(e1))
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            prefill(h, toks, 0, slot=1)
            torch.cuda.synchronize()
        kern = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.time_range.start)
        print(f"prompt {n}: chunks {prefill_chunks(n)}; events around prefill: median {statistics.median(walls):.2f} ms "
              f"(host returns after {statistics.median(hosts):.2f} ms)", flush=True)
        if not kern:
            print("  no CUDA events recorded (profiler without CUPTI?)", flush=True)
            continue
        t0 = kern[0].time_range.start
        busy = 0.0
        prev_end = t0
        for e in kern:
            s, d = e.time_range.start, e.time_range.end - e.time_range.start
            busy += d
            print(f"  +{(s - t0) / 1e3:8.3f} ms  gap {(s - prev_end) / 1e3:7.3f}  {d / 1e3:8.3f} ms  {e.name[:70]}",
                  flush=True)
            prev_end = max(prev_end, e.time_range.end)
        span = (kern[-1].time_range.end - t0) / 1e3
        print(f"  {len(kern)} GPU events, busy {busy / 1e3:.2f} ms of a {span:.2f} ms span", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
