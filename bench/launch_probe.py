"""What one launch costs a caller on this machine, by launch path (GPU only).

    python3 -m bench.launch_probe

A trivial kernel with one program per SM, launched four ways, each call followed by
``torch.cuda.synchronize()`` (the wall-clock protocol of ``python -m bench layer``): Triton's launcher,
the driver's ``cuLaunchKernel`` and ``cuLaunchCooperativeKernel`` through a prepared parameter
block (interp/fastlaunch.py), and a CUDA graph replay of the same kernel. Prints the median
microseconds per call of each, and of a bare ``torch.cuda.synchronize()``.
"""
from __future__ import annotations

import statistics
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _touch(p):
    pid = tl.program_id(0)
    tl.store(p + pid, pid)


def _median_us(fn, n: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(ts)


def main() -> int:
    from interp.fastlaunch import FastLauncher
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    buf = torch.zeros(sms, dtype=torch.int32, device=dev)
    ck = _touch.warmup(buf, grid=(sms,))
    ck._init_handles()
    rows = {"torch.cuda.synchronize() alone": _median_us(lambda: None),
            "Triton launcher": _median_us(lambda: _touch[(sms,)](buf))}
    for coop in (False, True):
        fl = FastLauncher(ck, sms, fixed={"p": buf}, dynamic=(), cooperative=coop)
        stream = torch.cuda.current_stream().cuda_stream
        rows[f"driver {'cuLaunchCooperativeKernel' if coop else 'cuLaunchKernel'}"] = _median_us(lambda: fl(stream))
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        _touch[(sms,)](buf)
        with torch.cuda.graph(g, stream=s):
            _touch[(sms,)](buf)
    torch.cuda.current_stream().wait_stream(s)
    rows["CUDA graph replay"] = _median_us(g.replay)
    print(f"{torch.cuda.get_device_name()}: wall-clock us per call (launch + sync), median of 200")
    for k, v in rows.items():
        print(f"  {k:40s} {v:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
