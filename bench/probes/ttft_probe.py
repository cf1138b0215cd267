"""Where a prompt's time to first token goes beyond its chunks' kernels (issue 50).

    python -m bench.probes.ttft_probe [--preset llama3.2-1b] [--prompt 1024] [--batch 32]

Runs 326-327 (H100) measured a 1024-token prompt's ``prefill`` at 6.44 ms on the 1B (8B: 33.05) where
``rows_profile`` timed its one chunk at 5.28 ms (8B: ~31.9) without the LM head: ~1.1 ms on both models, so
not the GEMMs. This times, on one warm decoder handle (``build_decoder``, as ``bench.rows_bench`` builds it):
the whole ``prefill`` call between CUDA events (as the TTFT bench), its host time alone (no synchronisation) and
its parts (the call with its launch stubbed, the rows' copy, a launch),
each chunk's launch back to back with and without the LM head's one group, and a ``torch.profiler`` table of
one call's device work (kernels, copies) with their times.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="llama3.2-1b")
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--reps", type=int, default=10)
    a = p.parse_args(argv)
    import torch
    from bench.rows_bench import _events_ms, back_to_back_us
    from interp import build_decoder, prefill, runtime
    from interp.rows import prefill_chunks, rows_handle
    from opcodes import ModelConfig
    from bench.decoder_bench import make_decoder_weights
    from opcodes.reference import make_kv_cache
    from opcodes.rows import LOGIT_GROUP, rows_state

    cfg = ModelConfig.from_name(a.preset)
    max_seq = -(-(a.prompt + 8) // 128) * 128
    w = make_decoder_weights(cfg, seed=0, device="cuda")
    kv = make_kv_cache(cfg, max_seq, 0, seed=1, device="cuda", batch=a.batch)
    h = build_decoder(w, kv, cfg, max_seq, batch=a.batch)
    toks = torch.randint(0, cfg.vocab, (a.prompt,), generator=torch.Generator().manual_seed(3)).tolist()
    t = time.time()
    prefill(h, toks, 0, slot=1)
    torch.cuda.synchronize()
    print(f"{torch.cuda.get_device_name()}: {a.preset}, prompt {a.prompt}, batch {a.batch}, max_seq {max_seq}; "
          f"first call {time.time() - t:.1f} s; chunks {prefill_chunks(a.prompt)}", flush=True)
    ms = _events_ms(lambda: prefill(h, toks, 0, slot=1), a.reps)
    print(f"prefill between events: median {statistics.median(ms):.3f} ms ({min(ms):.3f} .. {max(ms):.3f})", flush=True)
    def host_ms(fn) -> list[float]:
        """``fn``'s host time (ms) per call, ``a.reps`` calls, each after the device is idle, none waited for."""
        out = []
        for _ in range(a.reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        torch.cuda.synchronize()
        return out

    host = host_ms(lambda: prefill(h, toks, 0, slot=1))
    print(f"prefill host time, no synchronisation: median {statistics.median(host):.3f} ms "
          f"({min(host):.3f} .. {max(host):.3f})", flush=True)
    # the host time's parts: the call with no launch (checks, metadata, the rows' copy, the logits' copy of a
    # kernel that did not run), the rows' copy alone, a launch alone
    real = runtime.launch
    runtime.launch = lambda *args, **kw: None
    try:
        part = host_ms(lambda: prefill(h, toks, 0, slot=1))
    finally:
        runtime.launch = real
    hr = rows_handle(h, prefill_chunks(a.prompt)[0][1])
    st = hr.state["rows"].cpu()
    cp = host_ms(lambda: hr.state["rows"].copy_(st))
    ln = host_ms(lambda: runtime.launch(hr, h.x0, 0, h.hidden))
    print(f"  of it: the call without its launch {statistics.median(part):.3f} ms; the rows' copy alone "
          f"{statistics.median(cp):.3f} ms; a launch alone {statistics.median(ln):.3f} ms (medians)", flush=True)
    for c0, n in prefill_chunks(a.prompt):
        hr = rows_handle(h, n)
        last = c0 + n == a.prompt
        pos = list(range(c0, c0 + n))
        for lg in ((False, True) if last else (False,)):
            st = rows_state(hr.lay.rows, [1] * n, pos, toks[c0:c0 + n], logits=lg,
                            group=(n - 1) // LOGIT_GROUP if lg else None)
            hr.state["rows"].copy_(st)
            for _ in range(2):
                runtime.launch(hr, h.x0, 0, h.hidden)
            torch.cuda.synchronize()
            us = back_to_back_us(lambda: runtime.launch(hr, h.x0, 0, h.hidden), a.reps)
            print(f"chunk [{c0}, {c0 + n}) bucket {hr.lay.rows}, LM head {'one group' if lg else 'off'}: "
                  f"{statistics.median(us):.1f} us a launch back to back ({min(us):.1f} .. {max(us):.1f})", flush=True)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill(h, toks, 0, slot=1)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60), flush=True)
    evs = sorted((e for e in prof.events() if e.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    for e in evs[:40]:
        print(f"  device {e.time_range.start - t0:10.1f} .. {e.time_range.end - t0:10.1f} us  {e.name[:90]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
