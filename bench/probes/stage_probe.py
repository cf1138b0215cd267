"""How fast does a one-wave GEMV stage stream, by how its SMs load and where they read?
python3 -m bench.probes.stage_probe [PROGRAMS ...] [--loaders ...] [--layouts ...] [--what ...] [--stages N]   (a GPU)

The 1B decoder's gate/up stage (gate and up, 8192 x 2048 each) and down stage (2048 x 8192), one wave a
stage as the decoder runs them, 16 layers of distinct weights in one launch (1.5 GB: no L2 reuse), with a
grid barrier after every stage (``sync=1``: the dependency the decoder waits on) or without one (``sync=0``:
the stream's steady rate); ``--what qkv,o``: its QKV (3072 x 2048, 96 tiles of 32 rows) and O (2048 x 2048,
128 tiles of 16 rows) stages in the decoder's tiles. Run over fewer programs it separates the SM's bound
from the HBM's (run 211: the CTA row loop's gate/up stops at ~34 GB/s an SM with the HBM idle).
Loaders (bench/NOTES.md runs 208-220):
  ptr       the CTA row loop (``opcodes.common.rows_dot``: 4 warps, 5 stages of 32 KB), each stage's rows
            summed across the warps
  rows      the row loop with one row a warp (``warp_rows_dot``, the decoder's GATE_UP and LM head since
            v121): 58 GB/s an SM where ptr stops at 34 (run 218)
  col       the column loop of QKV, O and DOWN (``gemv_stream``: [tile rows, 256] blocks, summed at the
            tile's end); QKV and O only
  mma       the program's blocks as one tile streamed in 32 KB column chunks through the tensor cores,
            the vector as a bf16 pair (``mma_tile``): 96% of copy unsynced on 132 SMs (run 212)
  mma_nw16  mma with the vector x times a bf16 norm weight read each stage (GATE_UP's form: read
            synchronously, ~5 us a stage more, run 214); mma_nw32 the same weight in fp32 (pipelined)
Layouts of the same blocks: ``contiguous`` (program p streams blocks [p * nb, (p + 1) * nb), the decoder's
tiles) and ``interleaved`` (blocks p, p + P, p + 2P, ...: concurrent requests adjacent; ptr and rows).
TMA loaders (boxes of [4, 2048] and one contiguous 16 KB box a block) lost 20-60% (runs 209-210) and left.
Outputs are checked against torch before timing (a row no block stores stays NaN); every case alternates
in one process.
"""
from __future__ import annotations

import argparse
import itertools
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

from bench.baselines import stream_copy_bandwidth
from opcodes.common import gemv_stream, rows_dot, store_in_place, warp_rows_dot

D, FFN, LAYERS = 2048, 8192, 16
RB, STAGES, WARPS = 4, 5, 4


@triton.jit
def _barrier(cnt_ptr, target, SPIN: tl.constexpr):
    # every program arrives, then waits (bounded) until all have: a stage's dependency
    tl.atomic_add(cnt_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (seen < target) & (n < SPIN):
        seen = tl.atomic_add(cnt_ptr, 0, sem="acquire", scope="gpu")
        n += 1


@triton.jit
def _mma(a, w, acc, F32: tl.constexpr):
    # acc + a @ w^T on the tensor cores; F32: in fp32 (the Triton interpreter's bf16 dot is wrong, as
    # opcodes.common.mma says; this form passes the accumulator to the dot, as runs 212-217 measured it)
    if F32:
        return tl.dot(a.to(tl.float32), tl.trans(w).to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


@triton.jit
def mma_tile(w0_ptr, w1_ptr, row0, nrows, x_ptr, K: tl.constexpr, TR: tl.constexpr, BK: tl.constexpr,
             STAGES: tl.constexpr, TWO: tl.constexpr, F32: tl.constexpr, nw_ptr=None, NW: tl.constexpr = 0):
    # rows [row0, row0 + nrows) of W0 (and W1) dotted with the vector: TR-row tiles streamed in [TR, BK]
    # chunks, each multiplied on the tensor cores by a [16, BK] operand whose row 0 is the vector's chunk in
    # bf16 and row 1 the bf16 of what that rounding lost (rows 2-15 zero), accumulated in fp32: no
    # reduction across threads until the tile's end. NW 1 / 2: the vector is x (read at L2, as the
    # decoder reads x1) times a norm weight read each stage, bf16 (the model's: GATE_UP's form) or fp32
    rows = row0 + tl.arange(0, TR)
    rm = tl.arange(0, TR) < nrows
    i16 = tl.arange(0, 16)[:, None]
    acc0 = tl.zeros([16, TR], tl.float32)
    acc1 = tl.zeros([16, TR], tl.float32)
    for k in tl.range(0, K, BK, num_stages=STAGES):
        cols = k + tl.arange(0, BK)
        if NW == 0:
            xv = tl.load(x_ptr + cols)
        else:
            xv = tl.load(x_ptr + cols, cache_modifier=".cg") * tl.load(nw_ptr + cols).to(tl.float32)
        hi = xv.to(tl.bfloat16)
        lo = (xv - hi.to(tl.float32)).to(tl.bfloat16)
        a = tl.where(i16 == 0, hi[None, :], tl.where(i16 == 1, lo[None, :], tl.zeros_like(lo)[None, :]))
        w0 = tl.load(w0_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rm[:, None], other=0.0)
        acc0 = _mma(a, w0, acc0, F32)
        if TWO:
            w1 = tl.load(w1_ptr + rows[:, None].to(tl.int64) * K + cols[None, :], mask=rm[:, None], other=0.0)
            acc1 = _mma(a, w1, acc1, F32)
    return tl.sum(tl.where(i16 < 2, acc0, 0.0), axis=0), tl.sum(tl.where(i16 < 2, acc1, 0.0), axis=0)


@triton.jit
def stage_kernel(w0_ptr, w1_ptr, x_ptr, out_ptr, cnt_ptr, nw_ptr, NBLK, NPROG, K: tl.constexpr, NROWS: tl.constexpr,
                 LAYERS: tl.constexpr, RB: tl.constexpr, STAGES: tl.constexpr, TWO: tl.constexpr,
                 INTERLEAVE: tl.constexpr, SYNC: tl.constexpr, SPIN: tl.constexpr, LOADER: tl.constexpr,
                 TILE_BLOCKS: tl.constexpr, INTERP: tl.constexpr):
    # one stage a layer: the blocks of RB rows (of w0, and of w1 if TWO) split over the programs. LOADER 0:
    # the CTA row loop; 1: the program's blocks as one tile (contiguous layout only), streamed in column
    # chunks through the tensor cores (``mma_tile``); 2, 3: that with a bf16 / fp32 norm weight read each
    # stage; 4: the row loop with one row a warp (the decoder's since v121); 5: the column loop
    pid = tl.program_id(0)
    nb = (NBLK - pid + NPROG - 1) // NPROG          # this program's blocks (the first NBLK % NPROG get one more)
    first = pid * (NBLK // NPROG) + tl.minimum(pid, NBLK % NPROG)
    cols = tl.arange(0, K)
    hv = tl.load(x_ptr + cols)
    hv3 = tl.load(x_ptr + tl.arange(0, K // 256)[:, None] * 256 + tl.arange(0, 256)[None, :])
    for layer in range(LAYERS):
        if LOADER == 5:
            # the column loop of QKV, O and DOWN (opcodes.common.gemv_stream): the program's rows as one
            # tile, [TR, 256] blocks, summed over K at the tile's end
            TR: tl.constexpr = RB * TILE_BLOCKS
            rows = layer * NROWS + first * RB + tl.arange(0, TR)
            acc, _, _ = gemv_stream(w0_ptr, rows, w0_ptr, rows, rows >= 0, x_ptr, nw_ptr, 0, K, K, TR, 256, STAGES,
                                    TWO=False, NORM=False, EVEN=True)
            tl.store(out_ptr + rows, tl.sum(acc, axis=1))
        elif LOADER <= 3 and LOADER >= 1:
            TR: tl.constexpr = RB * TILE_BLOCKS
            r0 = layer * NROWS + first * RB
            v, uv = mma_tile(w0_ptr, w1_ptr, r0, nb * RB, x_ptr, K, TR, 32768 // (2 * TR * (1 + TWO)), STAGES, TWO,
                             INTERP, nw_ptr, LOADER - 1)
            if TWO:
                v = v / (1.0 + tl.exp(-v)) * uv
            tl.store(out_ptr + r0 + tl.arange(0, TR), v, mask=tl.arange(0, TR) < nb * RB)
        else:
            for b in tl.range(0, nb, num_stages=STAGES):
                if INTERLEAVE:
                    blk = b * NPROG + pid
                else:
                    blk = first + b
                rows = layer * NROWS + blk * RB + tl.arange(0, RB)
                rm = rows >= 0
                if LOADER == 4:
                    v = warp_rows_dot(w0_ptr, rows.to(tl.int64), rm, hv3, K, True)
                    if TWO:
                        uv = warp_rows_dot(w1_ptr, rows.to(tl.int64), rm, hv3, K, True)
                        v = v / (1.0 + tl.exp(-v)) * uv
                    store_in_place(out_ptr + rows, v, rm, INTERP)
                else:
                    v = rows_dot(w0_ptr, rows, rm, hv, 0, K, K, K, True)
                    if TWO:
                        uv = rows_dot(w1_ptr, rows, rm, hv, 0, K, K, K, True)
                        v = v / (1.0 + tl.exp(-v)) * uv
                    tl.store(out_ptr + rows, v)
        if SYNC:
            _barrier(cnt_ptr, (layer + 1) * NPROG, SPIN)


LOADERS = ("ptr", "mma", "mma_nw16", "mma_nw32", "rows", "col")
STAGE_NAMES = ("gate_up", "down", "qkv", "o")


def cases(dev: str, nprog: int, layers: int = LAYERS, ffn: int = FFN, d: int = D, syncs=(True, False),
          loaders=LOADERS, layouts=("contiguous", "interleaved"), stages: int = STAGES, warps: int = WARPS,
          which=STAGE_NAMES):
    """{(stage, loader, layout, sync): (launch, check, bytes, programs)}: gate/up, down, QKV and O stages (``which``), each
    layout, with the barrier and without it (``syncs``; the Triton interpreter runs programs one after
    another, so it cannot sync). QKV (1.5 d rows: q, k and v of the 1B's GQA 4) and O (d rows) run the
    decoder's tiles whatever ``nprog`` is: 32 rows a program (QKV's 96 on the 1B) and 16 (O's 128), in
    stages of 8 rows for the row loops; the column loop (``col``) runs only there and mma does not."""
    g = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
    u = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
    w = torch.randn(layers * d, ffn, device=dev, dtype=torch.bfloat16)
    wq = torch.randn(layers * (3 * d // 2), d, device=dev, dtype=torch.bfloat16) if "qkv" in which else g
    wo = torch.randn(layers * d, d, device=dev, dtype=torch.bfloat16) if "o" in which else g
    xg = torch.randn(d, device=dev) / d ** 0.5
    xd = torch.randn(ffn, device=dev) / ffn ** 0.5
    nw16 = (1 + 0.1 * torch.randn(max(d, ffn), device=dev)).to(torch.bfloat16)
    nw32 = nw16.float()
    out = torch.empty(layers * max(ffn, d), device=dev)
    cnt = torch.zeros(1, device=dev, dtype=torch.int32)
    res = {}
    all_stages = {"gate_up": (g, u, xg, d, ffn, RB, True, nprog), "down": (w, w, xd, ffn, d, 2, False, nprog),
                  "qkv": (wq, wq, xg, d, 3 * d // 2, 8, False, 3 * d // 64), "o": (wo, wo, xg, d, d, 8, False, d // 16)}
    for stage, (w0, w1, x, K, nrows, rb, two, np_) in {k: all_stages[k] for k in which}.items():
        for ld, lay, sync in itertools.product(loaders, layouts, syncs):
            if (ld.startswith("mma") or stage in ("qkv", "o")) and lay != "contiguous":   # tiles: contiguous rows
                continue
            if (ld == "col") != (stage in ("qkv", "o")) and (ld == "col" or ld.startswith("mma")):
                continue                        # the column loop only for QKV and O, the tensor cores not there
            h = x * nw32[:K] if ld.startswith("mma_nw") else x
            ref = torch.nn.functional.silu(w0.float() @ h) * (w1.float() @ h) if two else w0.float() @ h
            nw = nw32 if ld == "mma_nw32" else nw16
            def call(fresh=False, w0=w0, w1=w1, x=x, K=K, nrows=nrows, rb=rb, two=two, lay=lay, sync=sync, ld=ld, nw=nw,
                     nprog=np_):
                if fresh:                       # a row no block stores stays NaN and fails the check
                    out.fill_(float("nan"))
                cnt.zero_()                     # (inside the timed window: ~0.2 us a stage, every case alike)
                stage_kernel[(nprog,)](w0, w1, x, out, cnt, nw, nrows // rb, nprog, K=K, NROWS=nrows, LAYERS=layers,
                                       RB=rb, STAGES=stages, TWO=two, INTERLEAVE=lay == "interleaved",
                                       SYNC=sync, SPIN=1 << 22, LOADER=LOADERS.index(ld),
                                       TILE_BLOCKS=triton.next_power_of_2(-(-(nrows // rb) // nprog)),
                                       INTERP=os.environ.get("TRITON_INTERPRET") == "1",
                                       num_warps=warps)

            def check(ref=ref, name=f"{stage} {ld} {lay} sync={sync}", nprog=np_):
                err = ((out[:ref.numel()] - ref).abs().max() / ref.abs().max()).item()
                if not err < 1e-2:   # NaN fails too
                    raise AssertionError(f"stage_probe {name}, {nprog} programs: max rel err {err:.2e}")
                return err
            res[(stage, ld, lay, sync)] = (call, check, w0[:nrows].numel() * 2 * (1 + two), np_)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m bench.probes.stage_probe", description=__doc__.splitlines()[0])
    ap.add_argument("nprog", nargs="*", type=int, default=[128, 132], help="programs (one an SM), each a run")
    ap.add_argument("--loaders", default=",".join(LOADERS), help=f"comma-separated, of {', '.join(LOADERS)}")
    ap.add_argument("--layouts", default="contiguous,interleaved", help="comma-separated: contiguous, interleaved")
    ap.add_argument("--stages", type=int, default=STAGES, help="the loop's pipeline stages (num_stages)")
    ap.add_argument("--warps", type=int, default=WARPS, help="warps a program (the 1B decoder's kernel runs 4)")
    ap.add_argument("--what", default="gate_up,down", help=f"comma-separated stages, of {', '.join(STAGE_NAMES)}")
    args = ap.parse_args(argv)
    loaders, layouts, which = args.loaders.split(","), args.layouts.split(","), args.what.split(",")
    for v in which:
        if v not in STAGE_NAMES:
            ap.error(f"--what: unknown stage {v!r} (have {', '.join(STAGE_NAMES)})")
    for v in loaders:
        if v not in LOADERS:
            ap.error(f"--loaders: unknown loader {v!r} (have {', '.join(LOADERS)})")
    for v in layouts:
        if v not in ("contiguous", "interleaved"):
            ap.error(f"--layouts: unknown layout {v!r} (have contiguous, interleaved)")
    for n in args.nprog:
        if not 1 <= n <= 132:
            ap.error(f"nprog: {n} is not between 1 and 132 (one program an SM, co-resident for the barrier)")
    if args.warps not in (1, 2, 4, 8):
        ap.error(f"--warps: {args.warps} is not 1, 2, 4 or 8")
    if not 2 <= args.stages <= 6:
        ap.error(f"--stages: {args.stages} is not between 2 and 6 (32 KB a stage in shared memory)")
    dev = "cuda"
    reps = int(os.environ.get("REPS", "9"))
    bw = stream_copy_bandwidth(dev, nbytes=512 * 1024**2)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    print(f"stream copy {bw / 1e12:.3f} TB/s; {LAYERS} stages in one launch, {args.warps} warps, {args.stages} pipeline stages")
    for nprog in args.nprog:
        cs = cases(dev, nprog, loaders=loaders, layouts=layouts, stages=args.stages, warps=args.warps, which=which)
        for name, (call, check, _, _) in cs.items():
            call(fresh=True); torch.cuda.synchronize(); check()
        times = {k: [] for k in cs}
        for _ in range(reps):                       # alternated
            for k, (call, _, _, _) in cs.items():
                e0.record(); call(); e1.record(); torch.cuda.synchronize()
                times[k].append(e0.elapsed_time(e1) * 1e3 / LAYERS)
        for (stage, ld, lay, sync), t in times.items():
            us = statistics.median(t)
            nbytes, progs = cs[(stage, ld, lay, sync)][2:]     # QKV and O run their own program counts
            print(f"nprog {progs} {stage:7s} {ld:5s} {lay:11s} sync={int(sync)}: {us:6.2f} us a stage "
                  f"({nbytes / us / 1e6:5.2f} TB/s, {nbytes / progs / us / 1e3:5.1f} GB/s an SM, {nbytes / bw * 1e6:5.2f} "
                  f"us at copy BW; min {min(t):6.2f} max {max(t):6.2f})", flush=True)
        del cs
    return 0


if __name__ == "__main__":
    sys.exit(main())
