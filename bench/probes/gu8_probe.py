"""Would the 8B's gate/up stream faster as one coarse tile an SM with each row split over a few warps?
python3 -m bench.probes.gu8_probe [--layers N]   (a GPU)

The 8B decoder (d 4096, 8 warps) runs gate/up as 896 tiles of 16 rows (`gu_rows`), ~6.8 an SM, each its own
pipelined column loop (`opcodes.common.gemv_stream`: [16, 512] blocks of gate and of up, summed over K at
the tile's end); its MLP streams at ~90% of the copy bandwidth (run 145). The 1B's row loop with one row a
warp (`Tiling.warp_rows`, v121) does not fit d 4096: the vector replicated in every warp would take 128
registers a thread. Split each row over S = 4 warps instead: 2 rows of gate and of up a 32 KB stage, read
through [2, 4, 4, 256] pointers (the warps on the first two dims), each warp summing its quarter of a row
over its lanes and storing that partial in its own layout (`store_in_place`: no shared memory, no barrier),
the quarters added at the tile's end; the vector is 32 registers a thread. Loaders, the same rows a program
(896 units of 16 rows: 104 programs take 7, 28 take 6), a grid barrier after each layer's stage or none:
  col    the decoder's: one column-loop tile a unit, 6 stages of 32 KB
  split  one loop over the program's units, rows split over 4 warps, 5 stages of 32 KB
Outputs are checked against torch before timing; the cases alternate in one process.
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
from bench.probes.stage_probe import _barrier
from opcodes.common import gemv_stream, store_in_place

D, FFN, UNIT, WARPS, S, RB = 4096, 14336, 16, 8, 4, 2
LOADERS = ("col", "split")


@triton.jit
def split_dot(w_ptr, rows, hv, K: tl.constexpr, S: tl.constexpr):
    # [RB, S] partial dots: row r's quarter s (columns s * K / S ...) summed by one warp
    q = tl.arange(0, S)[None, :, None, None] * (K // S)
    r = tl.arange(0, K // (256 * S))[None, None, :, None] * 256
    c = tl.arange(0, 256)[None, None, None, :]
    w = tl.load(w_ptr + rows[:, None, None, None] * K + q + r + c, eviction_policy="evict_first")
    return tl.sum(tl.sum(w.to(tl.float32) * hv[None, :, :, :], axis=2), axis=2)


@triton.jit
def gu8_kernel(g_ptr, u_ptr, x_ptr, out_ptr, cnt_ptr, scr_ptr, NPROG, NUNIT,
               K: tl.constexpr, FFN: tl.constexpr, LAYERS: tl.constexpr, UNIT: tl.constexpr, RB: tl.constexpr,
               S: tl.constexpr, STAGES: tl.constexpr, SYNC: tl.constexpr, SPIN: tl.constexpr, LOADER: tl.constexpr,
               MAXU: tl.constexpr, INTERP: tl.constexpr):
    pid = tl.program_id(0)
    nu = (NUNIT - pid + NPROG - 1) // NPROG          # this program's units of UNIT rows
    first = pid * (NUNIT // NPROG) + tl.minimum(pid, NUNIT % NPROG)
    hv = tl.load(x_ptr + tl.arange(0, S)[:, None, None] * (K // S) + tl.arange(0, K // (256 * S))[None, :, None] * 256
                 + tl.arange(0, 256)[None, None, :])
    scr = scr_ptr + pid * (2 * MAXU * UNIT * S)
    for layer in range(LAYERS):
        row0 = layer * FFN + first * UNIT
        if LOADER == 0:
            for t in range(nu):
                rows = row0 + t * UNIT + tl.arange(0, UNIT)
                ag, au, _ = gemv_stream(g_ptr, rows, u_ptr, rows, rows >= 0, x_ptr, x_ptr, 0, K, K, UNIT, 512, STAGES,
                                        TWO=True, NORM=False, EVEN=True)
                v = tl.sum(ag, axis=1)
                uv = tl.sum(au, axis=1)
                tl.store(out_ptr + rows, v / (1.0 + tl.exp(-v)) * uv)
        else:
            for b in tl.range(0, nu * (UNIT // RB), num_stages=STAGES):
                rows = row0 + b * RB + tl.arange(0, RB)
                sl = (b * RB + tl.arange(0, RB))[:, None] * S + tl.arange(0, S)[None, :]
                store_in_place(scr + sl, split_dot(g_ptr, rows.to(tl.int64), hv, K, S), sl >= 0, INTERP)
                store_in_place(scr + MAXU * UNIT * S + sl, split_dot(u_ptr, rows.to(tl.int64), hv, K, S), sl >= 0,
                               INTERP)
            tl.debug_barrier()                  # this CTA's partials, visible to all its threads
            tr = tl.arange(0, MAXU * UNIT)
            tm = tr < nu * UNIT
            so = tr[:, None] * S + tl.arange(0, S)[None, :]
            v = tl.sum(tl.load(scr + so, mask=tm[:, None], other=0.0), axis=1)
            uv = tl.sum(tl.load(scr + MAXU * UNIT * S + so, mask=tm[:, None], other=0.0), axis=1)
            tl.store(out_ptr + row0 + tr, v / (1.0 + tl.exp(-v)) * uv, mask=tm)
            tl.debug_barrier()                  # read before the next layer's partials overwrite them
        if SYNC:
            _barrier(cnt_ptr, (layer + 1) * NPROG, SPIN)


def cases(dev: str, nprog: int, layers: int, ffn: int = FFN, d: int = D, syncs=(True, False), loaders=LOADERS):
    """{(loader, sync): (launch, check)} for the gate/up stage of ``layers`` layers of distinct weights."""
    g = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
    u = torch.randn(layers * ffn, d, device=dev, dtype=torch.bfloat16)
    x = torch.randn(d, device=dev) / d ** 0.5
    out = torch.empty(layers * ffn, device=dev)
    cnt = torch.zeros(1, device=dev, dtype=torch.int32)
    nunit = ffn // UNIT
    maxu = triton.next_power_of_2(-(-nunit // nprog))
    scr = torch.empty(nprog * 2 * maxu * UNIT * S, device=dev)
    ref = torch.nn.functional.silu(g.float() @ x) * (u.float() @ x)
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    res = {}
    for ld, sync in itertools.product(loaders, syncs):
        def call(fresh=False, ld=ld, sync=sync):
            if fresh:                       # a row no program stores stays NaN and fails the check
                out.fill_(float("nan"))
            cnt.zero_()
            gu8_kernel[(nprog,)](g, u, x, out, cnt, scr, nprog, nunit, K=d, FFN=ffn, LAYERS=layers, UNIT=UNIT, RB=RB,
                                 S=S, STAGES=6 if ld == "col" else 5, SYNC=sync and not interp, SPIN=1 << 22,
                                 LOADER=LOADERS.index(ld), MAXU=maxu, INTERP=interp, num_warps=WARPS)

        def check(name=f"{ld} sync={sync}"):
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if not err < 1e-2:   # NaN fails too
                raise AssertionError(f"gu8_probe {name}, {nprog} programs: max rel err {err:.2e}")
            return err
        res[(ld, sync)] = (call, check)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python3 -m bench.probes.gu8_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of distinct weights a launch (235 MB each)")
    args = ap.parse_args(argv)
    if not 1 <= args.layers <= 32:
        ap.error(f"--layers: {args.layers} is not between 1 and 32")
    dev, reps, nprog = "cuda", int(os.environ.get("REPS", "7")), 132
    bw = stream_copy_bandwidth(dev, nbytes=512 * 1024**2)
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    cs = cases(dev, nprog, args.layers)
    for call, check in cs.values():
        call(fresh=True); torch.cuda.synchronize(); check()
    times = {k: [] for k in cs}
    for _ in range(reps):
        for k, (call, _) in cs.items():
            e0.record(); call(); e1.record(); torch.cuda.synchronize()
            times[k].append(e0.elapsed_time(e1) * 1e3 / args.layers)
    nbytes = 2 * FFN * D * 2
    print(f"stream copy {bw / 1e12:.3f} TB/s; the 8B's gate/up stage, {nprog} programs, {args.layers} layers a launch")
    for (ld, sync), t in times.items():
        us = statistics.median(t)
        print(f"{ld:5s} sync={int(sync)}: {us:6.2f} us a stage ({nbytes / us / 1e6:5.2f} TB/s, {nbytes / bw * 1e6:5.2f} us at "
              f"copy BW; min {min(t):6.2f} max {max(t):6.2f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
