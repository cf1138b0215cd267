"""v184's probe: do TMA descriptor loads make the prefill buckets' GEMM tiles faster than the pointer loads
(cp.async) of ``opcodes.common_rows.rows_stream``? (bench/notes/s49.md)

    python -m bench.probes.tma_gemm [--preset llama3.2-1b] [--reps 20]     (a GPU)

The 1024-row bucket's tiles (``opcodes.rows.rows_tiling``): 8 warps, K blocks of 64, 256 token columns a tile,
4 pipeline stages; GATE_UP pairs 64 gate and 64 up rows (K = d), DOWN 64 rows over a K chunk of ffn / 2. Each
tile is timed three ways, persistent over the SMs (program p takes tiles p, p + G, ...; no waits, every launch
bounded): ``ptr`` (rows_stream's loop), ``tma`` (a device-side tensor descriptor a matrix a program, made once),
``tma_tile`` (made again for every tile, as an interpreter instruction would), and cuBLAS (``torch.matmul``) on
the same GEMM. Each result is checked against torch in fp32 first (a wrong result fails the run).

PREDICTION (before any GPU run): run 314's profile has GATE_UP's tiles at ~56% and DOWN's at ~46% of an H100 SM's
dense bf16 peak in the megakernel. Here, with nothing else in the kernel: ``ptr`` GATE_UP 550-650 TFLOP/s, DOWN
450-550 (its [64, 256] tile does 51 flops a byte of operand traffic, GATE_UP's 85); ``tma`` +5..+15% on both (one
thread issues a block's copy; no per-thread address math or cp.async issue slots in the wgmma loop),
``tma_tile`` within 2% of ``tma`` (a descriptor is 128 bytes written once a tile of ~30 us). Go (v184 in the
interpreter: ``rows_stream`` on descriptors in the prefill buckets) if ``tma_tile`` beats ``ptr`` by >= 8% on
both shapes; kill otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton
import triton.language as tl

from opcodes import PRESETS

SHAPES = ("gate_up", "down")


@triton.jit
def ptr_kernel(w_ptr, x_ptr, y_ptr, m_rows, n_tiles, K: tl.constexpr, M: tl.constexpr, NT: tl.constexpr,
               BK: tl.constexpr, ST: tl.constexpr, TWO: tl.constexpr, XS: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    ncol = tl.arange(0, NT)
    for t in range(pid, (m_rows // M) * n_tiles, G):
        rows1 = (t // n_tiles) * M + tl.arange(0, M)
        n0 = (t % n_tiles) * NT
        acc1 = tl.zeros([M, NT], tl.float32)
        acc2 = tl.zeros([M, NT], tl.float32)
        for kk in tl.range(0, K, BK, num_stages=ST):
            ks = kk + tl.arange(0, BK)
            xt = tl.load(x_ptr + ks[:, None].to(tl.int64) * XS + n0 + ncol[None, :], cache_modifier=".cg")
            w1 = tl.load(w_ptr + rows1[:, None].to(tl.int64) * K + ks[None, :], eviction_policy="evict_first")
            acc1 = tl.dot(w1, xt, acc1)
            if TWO:
                w2 = tl.load(w_ptr + (rows1 + m_rows)[:, None].to(tl.int64) * K + ks[None, :],
                             eviction_policy="evict_first")
                acc2 = tl.dot(w2, xt, acc2)
        y = y_ptr + rows1[:, None].to(tl.int64) * XS + n0 + ncol[None, :]
        tl.store(y, acc1)
        if TWO:
            tl.store(y + m_rows * XS, acc2)


@triton.jit
def tma_kernel(w_ptr, x_ptr, y_ptr, m_rows, n_tiles, K: tl.constexpr, M: tl.constexpr, NT: tl.constexpr,
               BK: tl.constexpr, ST: tl.constexpr, TWO: tl.constexpr, XS: tl.constexpr, PER_TILE: tl.constexpr):
    pid = tl.program_id(0)
    G = tl.num_programs(0)
    ncol = tl.arange(0, NT)
    rows_all = m_rows * (2 if TWO else 1)
    wd = tl.make_tensor_descriptor(w_ptr, shape=[rows_all, K], strides=[K, 1], block_shape=[M, BK])
    xd = tl.make_tensor_descriptor(x_ptr, shape=[K, XS], strides=[XS, 1], block_shape=[BK, NT])
    for t in range(pid, (m_rows // M) * n_tiles, G):
        if PER_TILE:
            wd = tl.make_tensor_descriptor(w_ptr, shape=[rows_all, K], strides=[K, 1], block_shape=[M, BK])
            xd = tl.make_tensor_descriptor(x_ptr, shape=[K, XS], strides=[XS, 1], block_shape=[BK, NT])
        r0 = (t // n_tiles) * M
        n0 = (t % n_tiles) * NT
        acc1 = tl.zeros([M, NT], tl.float32)
        acc2 = tl.zeros([M, NT], tl.float32)
        for kk in tl.range(0, K, BK, num_stages=ST):
            xt = xd.load([kk, n0])
            acc1 = tl.dot(wd.load([r0, kk]), xt, acc1)
            if TWO:
                acc2 = tl.dot(wd.load([r0 + m_rows, kk]), xt, acc2)
        rows1 = r0 + tl.arange(0, M)
        y = y_ptr + rows1[:, None].to(tl.int64) * XS + n0 + ncol[None, :]
        tl.store(y, acc1)
        if TWO:
            tl.store(y + m_rows * XS, acc2)


def shape_of(cfg, name: str) -> tuple[int, int, bool]:
    """(weight rows, K, TWO) of a layer GEMM as the 1024-row bucket tiles it (DOWN: one K chunk of ffn / 2)."""
    if name == "gate_up":
        return 2 * cfg.ffn, cfg.d, True
    return cfg.d, cfg.ffn // 2, False


def run(kind: str, w, x, y, m_rows, K, two, grid, *, M=64, NT=256, BK=64, ST=4, warps=8):
    XS = x.shape[1]
    n_tiles = XS // NT
    if kind == "ptr":
        ptr_kernel[(grid,)](w, x, y, m_rows, n_tiles, K=K, M=M, NT=NT, BK=BK, ST=ST, TWO=two, XS=XS, num_warps=warps)
    else:
        tma_kernel[(grid,)](w, x, y, m_rows, n_tiles, K=K, M=M, NT=NT, BK=BK, ST=ST, TWO=two, XS=XS,
                            PER_TILE=kind == "tma_tile", num_warps=warps)


def timed(fn, reps: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.tma_gemm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, default=1024, help="token columns (default 1024)")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tma_gemm: needs a GPU", file=sys.stderr)
        return 2
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    cfg = PRESETS[a.preset]
    grid = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}: {a.preset}, {a.rows} token columns, grid {grid}")
    torch.manual_seed(0)
    for name in SHAPES:
        rows, K, two = shape_of(cfg, name)
        w = (torch.randn(rows, K, device="cuda") / K ** 0.5).to(torch.bfloat16)
        x = torch.randn(K, a.rows, device="cuda").to(torch.bfloat16)
        ref = w.float() @ x.float()
        flops = 2 * rows * K * a.rows
        tc = timed(lambda: torch.matmul(w, x), a.reps)
        line = [f"{name:8s} [{rows} x {K}] . [{K} x {a.rows}]: cuBLAS {tc:8.1f} us {flops / tc / 1e6:6.1f} TFLOP/s"]
        for kind in ("ptr", "tma", "tma_tile"):
            y = torch.zeros(rows, a.rows, device="cuda")
            m_rows = rows // 2 if two else rows
            run(kind, w, x, y, m_rows, K, two, grid)
            torch.cuda.synchronize()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"{name} {kind}: wrong result, max err {err:.2e}", file=sys.stderr)
                return 1
            t = timed(lambda: run(kind, w, x, y, m_rows, K, two, grid), a.reps)
            line.append(f"{kind} {t:8.1f} us {flops / t / 1e6:6.1f} TFLOP/s ({tc / t:.2f}x cuBLAS)")
        print("\n  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
