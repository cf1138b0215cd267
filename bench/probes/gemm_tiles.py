"""The prefill buckets' GEMM tiles alone: which tile shape runs ``rows_stream``'s loop fastest on the 1024-row
bucket's GATE_UP and DOWN (bench/notes/s49.md v184, v185)?

    python -m bench.probes.gemm_tiles [--preset llama3.2-1b] [--tiles 64x256,128x128] [--reps 20]     (a GPU)

Each tile ``MxNT`` (weight rows x token columns; GATE_UP pairs M gate and M up rows) streams K blocks of 64,
8 warps, as many pipeline stages (<= 4) as 200 KB of shared memory holds, persistent over the SMs (program p takes
tiles p, p + G, ...; no waits, every launch bounded), beside cuBLAS (``torch.matmul``) on the same GEMM; GATE_UP
with K = d, DOWN one K chunk of ffn / 2 (the 1024-row bucket's). Each result is checked against torch in fp32 first
(a wrong result fails the run).

v184 (run 316, H100; TMA descriptor loads in this loop, killed, the code in git at 0836bc5): GATE_UP +2..+4%,
DOWN -7..-22% against the pointer loads; the pointer loop alone at 0.83-0.87x cuBLAS on GATE_UP, 0.70 (8B) -
0.83x (1B) on DOWN.

PREDICTION (v185, before any GPU run): DOWN's [64, 256] tile does 51 flops a byte of operand traffic, a
[128, 128] tile 64 with the same accumulator registers (64 a thread on 8 warps) and a quarter less operand
traffic a flop: DOWN 128x128 +8..+15% TFLOP/s over 64x256 on both models (8B 446 -> ~490-510, 1B 336 -> ~365-385).
128x256 (85 flops a byte; 128 accumulator registers a thread: 199 registers alone on sm_90a, no spill, but 1252
bytes of spill in the megakernel, s47.md v179) +15..+25% here. GATE_UP 64x256 (85 flops a byte) beats 64x128.
Go (DOWN_R / DOWN_RES_R tiles of 128 rows over half a column block in the 1024-row bucket) if 128x128 beats 64x256
by >= 8% on both models' DOWN; kill otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from bench.probes import rows_gemm
from bench.rows_bench import _events_ms
from opcodes import PRESETS

SHAPES = ("gate_up", "down")


def shape_of(cfg, name: str) -> tuple[int, int, bool]:
    """(weight rows, K, TWO) of a layer GEMM as the 1024-row bucket tiles it (DOWN: one K chunk of ffn / 2)."""
    if name == "gate_up":
        return 2 * cfg.ffn, cfg.d, True
    return cfg.d, cfg.ffn // 2, False


def stages_for(M: int, NT: int, two: bool, BK: int = 64) -> int:
    """The pipeline depth ``rows_tiling`` would give the tile: as many stages (2-4) as ``rows_gemm.SMEM_BUDGET``
    (200 KB) holds."""
    return max(2, min(4, rows_gemm.SMEM_BUDGET // (2 * BK * ((2 if two else 1) * M + NT))))


def run(w, x, y, m_rows, K, two, grid, *, M=64, NT=256, BK=64, ST=4, warps=8):
    """``y = W . x`` by ``rows_gemm``'s persistent probe kernel (``rows_stream``'s loop; with ``two`` rows r
    and r + m_rows paired, ``m_rows`` = half of ``w``'s); ``m_rows`` and ``K`` are ``w``'s, checked there."""
    assert m_rows == (w.shape[0] // 2 if two else w.shape[0]) and K == w.shape[1]
    rows_gemm.launch(w, x, y, x.shape[1], m=M, n_tile=NT, bk=BK, stages=ST, warps=warps, grid=grid, two=two)


def timed(fn, reps: int) -> float:
    """Median us of ``reps`` launches (CUDA events, ``bench.rows_bench``'s) after 3 warm-ups."""
    for _ in range(3):
        fn()
    return statistics.median(_events_ms(fn, reps)) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.gemm_tiles", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3.2-1b", choices=sorted(PRESETS))
    ap.add_argument("--rows", type=int, default=1024, help="token columns (default 1024)")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--tiles", default="64x256,128x128,128x256,64x128",
                    help="MxNT tiles (default 64x256,128x128,128x256,64x128)")
    a = ap.parse_args(argv)
    try:
        tiles = [tuple(int(v) for v in t.split("x")) for t in a.tiles.split(",")]
        assert all(len(t) == 2 for t in tiles) and all(m >= 16 and nt >= 16 and a.rows % nt == 0 for m, nt in tiles)
    except (ValueError, AssertionError):
        ap.error(f"--tiles: MxNT pairs, each >= 16, NT dividing --rows {a.rows}; got {a.tiles!r}")
    if not torch.cuda.is_available():
        print("gemm_tiles: needs a GPU", file=sys.stderr)
        return 2
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
        m_rows = rows // 2 if two else rows
        for M, NT in tiles:
            if m_rows % M:
                continue
            kind = f"{M}x{NT}"
            st = stages_for(M, NT, two)
            y = torch.zeros(rows, a.rows, device="cuda")
            run(w, x, y, m_rows, K, two, grid, M=M, NT=NT, ST=st)
            torch.cuda.synchronize()
            err = ((y - ref).abs().max() / ref.abs().max()).item()
            if err > 1e-2:
                print(f"{name} {kind}: wrong result, max err {err:.2e}", file=sys.stderr)
                return 1
            t = timed(lambda: run(w, x, y, m_rows, K, two, grid, M=M, NT=NT, ST=st), a.reps)
            line.append(f"{kind} ({st} stages) {t:8.1f} us {flops / t / 1e6:6.1f} TFLOP/s ({tc / t:.2f}x cuBLAS)")
        print("\n  ".join(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
