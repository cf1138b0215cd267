"""Does a gate/up tile stream slower because it reads two matrices?   python3 -m bench.probes.gu_probe (a GPU)

Run 180's profile of the 1B decoder: a gate/up tile (64 rows of gate and 64 of up, 2048 columns, 512 KB)
streams at ~28 GB/s an SM on 128 SMs (3.6 TB/s), an LM head tile (256 rows of one matrix, 1 MB) at ~34 on
132 (4.5 TB/s while all stream), with the same row loop (4 warps, 5 stages of 32 KB). This probe times
one wave of 512 KB tiles per program, REPS waves in sequence (the pipeline drains between tiles, as in
the megakernel), under three layouts of the same bytes:
  two     the decoder's GATE_UP loop (``opcodes.gate_up._gu_rows``): 4 rows of gate and 4 of up a stage,
          from two matrices (two 16 KB streams a stage)
  packed  the same loop over one matrix whose rows are packed [4 gate, 4 up, 4 gate, ...]: each stage
          one contiguous 32 KB (weights prepacked at build time)
  one     one matrix, 8 rows a stage, one dot a row (the LM head's loop), 128 rows a tile
on 128 programs (the 1B's gate/up) and 132 (every SM). Outputs are checked against torch.
"""
from __future__ import annotations

import os
import statistics

import torch
import triton
import triton.language as tl

from opcodes.common import norm_row_vec, rows_dot
from opcodes.gate_up import _gu_rows

D = 2048
GU_ROWS, RB, STAGES, WARPS = 64, 4, 5, 4


@triton.jit
def two_kernel(g_ptr, u_ptr, nw_ptr, x_ptr, out_ptr, REPS, NPROG, D: tl.constexpr, FFN: tl.constexpr,
               GU_ROWS: tl.constexpr, RB: tl.constexpr, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    for r in range(REPS):
        row0 = (r * NPROG + pid) * GU_ROWS
        _gu_rows(row0, GU_ROWS, g_ptr, u_ptr, nw_ptr, x_ptr, out_ptr, D, D, FFN, 1e-5, GU_ROWS, RB, STAGES, False,
                 False, False)


@triton.jit
def matrix_kernel(w_ptr, nw_ptr, x_ptr, out_ptr, REPS, NPROG, D: tl.constexpr, ROWS: tl.constexpr,
                  RB: tl.constexpr, STAGES: tl.constexpr, PACKED: tl.constexpr):
    # one matrix, RB rows a stage: PACKED, gate and up rows packed [RB gate, RB up, ...] (gate row r at
    # packed row 2*RB*(r // RB) + r % RB, up row r RB rows after it), ROWS of each a tile and the
    # activation stored; else ROWS rows a tile and their dots stored (the LM head's loop)
    pid = tl.program_id(0)
    for r in range(REPS):
        row0 = (r * NPROG + pid) * ROWS
        hv, rstd = norm_row_vec(x_ptr, nw_ptr, D, D, 1e-5)
        for b in tl.range(0, ROWS // RB, num_stages=STAGES):
            rows = row0 + b * RB + tl.arange(0, RB)
            if PACKED:
                prow = 2 * (row0 + b * RB) + tl.arange(0, RB)
                gv = rows_dot(w_ptr, prow, rows >= 0, hv, 0, D, D, D, True) * rstd
                uv = rows_dot(w_ptr, prow + RB, rows >= 0, hv, 0, D, D, D, True) * rstd
                tl.store(out_ptr + rows, gv / (1.0 + tl.exp(-gv)) * uv)
            else:
                tl.store(out_ptr + rows, rows_dot(w_ptr, rows, rows >= 0, hv, 0, D, D, D, True) * rstd)


def cases(dev: str, nprog: int, reps: int):
    """{layout: (launch, check)} for ``nprog`` programs, ``reps`` tiles each (fresh random weights)."""
    x = torch.randn(D, device=dev)
    nw = (1 + 0.1 * torch.randn(D, device=dev)).to(torch.bfloat16)
    h = x * nw.float() / torch.sqrt((x * x).mean() + 1e-5)
    n = reps * nprog * GU_ROWS                       # rows of gate (and of up) in all
    g = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
    u = torch.randn(n, D, device=dev, dtype=torch.bfloat16)
    packed = torch.stack([g.view(-1, RB, D), u.view(-1, RB, D)], 1).reshape(2 * n, D)
    one = torch.cat([g, u])                          # the same bytes as one matrix
    out = torch.empty(2 * n, device=dev)
    ref_gu = torch.nn.functional.silu(g.float() @ h) * (u.float() @ h)
    ref_one = one.float() @ h

    def check(name, ref):
        def f():
            err = ((out[:ref.numel()] - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:
                raise AssertionError(f"gu_probe {name}, {nprog} programs: max rel err {err:.2e}")
            return err
        return f
    kw = dict(D=D, STAGES=STAGES, num_warps=WARPS)
    return {
        "two": (lambda: two_kernel[(nprog,)](g, u, nw, x, out, reps, nprog, FFN=n, GU_ROWS=GU_ROWS, RB=RB, **kw),
                check("two", ref_gu)),
        "packed": (lambda: matrix_kernel[(nprog,)](packed, nw, x, out, reps, nprog, ROWS=GU_ROWS, RB=RB,
                                                   PACKED=True, **kw), check("packed", ref_gu)),
        "one": (lambda: matrix_kernel[(nprog,)](one, nw, x, out, reps, nprog, ROWS=2 * GU_ROWS, RB=2 * RB,
                                                PACKED=False, **kw), check("one", ref_one)),
    }


def main():
    dev = "cuda"
    reps = int(os.environ.get("REPS", "8"))
    a = torch.empty(1 << 28, device=dev, dtype=torch.bfloat16); b = torch.empty_like(a)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    ts = []
    for _ in range(10):
        e0.record(); b.copy_(a); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    bw = 2 * a.numel() * 2 / (statistics.median(ts) * 1e-3)
    del a, b
    print(f"stream copy {bw / 1e12:.3f} TB/s; {reps} waves of 512 KB tiles a program, {WARPS} warps, "
          f"{STAGES} stages of 32 KB")
    tile = 2 * GU_ROWS * D * 2
    for nprog in (128, 132):
        cs = cases(dev, nprog, reps)
        for name, (call, check) in cs.items():
            call(); torch.cuda.synchronize(); check()
        times = {k: [] for k in cs}
        for _ in range(9):                           # alternated
            for k, (call, _) in cs.items():
                e0.record(); call(); e1.record(); torch.cuda.synchronize()
                times[k].append(e0.elapsed_time(e1) * 1e3 / reps)
        for k, t in times.items():
            us = statistics.median(t)
            print(f"{k:7s} nprog {nprog}: {us:6.2f} us a 512 KB tile ({tile / us / 1e3:5.1f} GB/s an SM, "
                  f"{nprog * tile / us / 1e6:5.2f} TB/s; at copy BW {nprog * tile / bw * 1e6:5.2f} us)", flush=True)
        del cs


if __name__ == "__main__":
    main()
