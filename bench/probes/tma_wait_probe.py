"""Can a one-wave GEMV tile issue its weights' prologue before its wait, if the prologue is TMA?
    python3 -m bench.probes.tma_wait_probe [stages...]      (a GPU (H200); default 5)

bench/NOTES.md v97 and bench/probes/poll_probe.py: a poll issued after a tile's cp.async prologue returns
only once the prologue has landed (the acquire waits behind the SM's own copies), so a wait placed
after the prologue buys nothing; after a TMA prologue the poll returns well before the data lands. This
probe asks whether that carries into Triton's pipelined row loop: chain_probe's row-block chain (the 1B's
four GEMV stages a layer, 16 layers, one wave each, every tile waiting for all tiles of the stage before;
blocks of 8 rows x 2048 columns = 32 KB; `chain_probe.plan_rows`), four loops of one tile each:

    rows_per_tile : chain_probe's (the megakernel's GATE_UP today): wait, vector, then the pipelined loop
    rows_in_cp    : the wait and the vector in the loop's first iteration (after the cp.async prologue)
    rows_tma      : the weights through a TMA descriptor (a block = one [64, 256] box), wait before
                    (`rows_tma` with INSIDE=0)
    rows_in_tma   : TMA, and the wait in the first iteration: the prologue's boxes in flight while it polls
                    (`rows_tma` with INSIDE=1)

Each variant is checked against rows_per_tile's outputs (fp32 sums in another order: rtol 1e-4), then
timed alternated (medians of CUDA events over the calls), us a layer against the floor of the run.
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.probes import chain_probe as cp

RR, KR = cp.RR, cp.KR                      # a block: 8 rows x 2048 bf16
BOX_R, BOX_C = 64, 256                     # the block as one TMA box: 64 rows of 256 (the same 32 KB)
NW = 4                                     # the 1B decoder's warps


@triton.jit
def _dot_tma(w, hv2):
    # a [64, 256] box = the block's 8 rows of 2048 as 8 x 8 pieces of 256; hv2: the vector as [8, 256]
    w3 = tl.reshape(w, [8, 8, 256]).to(tl.float32)
    return tl.sum(tl.sum(w3 * hv2[None, :, :], 2), 1)


@triton.jit
def rows_in_cp(tab_ptr, start_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch,
               STAGES: tl.constexpr):
    t0, t1 = cp._sm_span(tstart_ptr)
    rows = tl.arange(0, RR)
    cols = tl.arange(0, KR)
    for t in range(t0, t1):
        s = tl.load(tiles_ptr + t)
        s1 = tl.load(tiles_ptr + t + 1)
        hv = tl.zeros([1, KR], dtype=tl.float32)
        for j in tl.range(s, s1, num_stages=STAGES):
            if j == s:                          # the poll and the vector before this block's copies are awaited
                cp._tile_wait(tab_ptr + j * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
                hv = tl.load(x_ptr + cols, cache_modifier=".cg")[None, :]
            cp.row_block(tab_ptr, w_ptr, out_ptr, j, rows, cols, hv)
        cp._tile_signal(tab_ptr, s1, cnt_ptr)


@triton.jit
def rows_tma(tab_ptr, start_ptr, tiles_ptr, tstart_ptr, x_ptr, w_desc, out_ptr, cnt_ptr, err_ptr, epoch,
             STAGES: tl.constexpr, INSIDE: tl.constexpr):
    # the weights through the descriptor; INSIDE: the wait and the vector in the first iteration
    t0, t1 = cp._sm_span(tstart_ptr)
    r8 = tl.arange(0, 8)
    for t in range(t0, t1):
        if INSIDE:
            s = tl.load(tiles_ptr + t)
            s1 = tl.load(tiles_ptr + t + 1)
            hv2 = tl.zeros([8, 256], dtype=tl.float32)
        else:
            s, s1 = cp._tile_start(tab_ptr, tiles_ptr, t, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
            hv2 = tl.load(x_ptr + r8[:, None] * 256 + tl.arange(0, 256)[None, :], cache_modifier=".cg")
        for j in tl.range(s, s1, num_stages=STAGES):
            if INSIDE:
                if j == s:
                    cp._tile_wait(tab_ptr + j * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
                    hv2 = tl.load(x_ptr + r8[:, None] * 256 + tl.arange(0, 256)[None, :], cache_modifier=".cg")
            w = w_desc.load([tl.cast(j * 64, tl.int32), 0])
            tl.store(out_ptr + tl.load(tab_ptr + j * 6 + 4) * RR + r8, _dot_tma(w, hv2))
        cp._tile_signal(tab_ptr, s1, cnt_ptr)


NAMES = ("rows_per_tile", "rows_in_cp", "rows_tma", "rows_in_tma")


def launch(name, tables, x, w, desc, out, cnt, err, epoch, sms, stages):
    tab_t, start_t, tiles_t, tstart_t = tables
    if name == "rows_per_tile":
        cp.rows_per_tile[(sms,)](tab_t, start_t, tiles_t, tstart_t, x, w, out, cnt, err, epoch, STAGES=stages,
                                 num_warps=NW)
    elif name == "rows_in_cp":
        rows_in_cp[(sms,)](tab_t, start_t, tiles_t, tstart_t, x, w, out, cnt, err, epoch, STAGES=stages,
                           num_warps=NW)
    else:
        rows_tma[(sms,)](tab_t, start_t, tiles_t, tstart_t, x, desc, out, cnt, err, epoch, STAGES=stages,
                         INSIDE=name == "rows_in_tma", num_warps=NW)


def run(device="cuda", layers=16, sms=None, steps=20, stages=5):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    bw = cp.stream_bw(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_rows(layers, sms)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    desc = TensorDescriptor.from_tensor(w.view(-1, BOX_C), [BOX_R, BOX_C])
    tables = (i64(tab).reshape(-1), i64(start), i64(tiles), i64(tstart))
    res, outs = {}, {}
    for name in NAMES + NAMES[::-1]:
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * RR.value, dtype=torch.float32, device=dev)
        t = cp.timed_median(lambda step: launch(name, tables, x, w, desc, out, cnt, err, step, sms, stages), steps)
        if int(err.item()):
            raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
        outs.setdefault(name, out.clone())
        res.setdefault(name, []).append(t)
    ref = outs["rows_per_tile"]
    for name in NAMES[1:]:
        if not torch.allclose(outs[name], ref, rtol=1e-4, atol=1e-4):
            raise RuntimeError(f"{name}: outputs differ from rows_per_tile's (max {(outs[name] - ref).abs().max():.3g})")
    floor_us = cp.report(dev, layers, sms, w.numel() * 2, bw, f"pipeline {stages}, {NW} warps", res, 13)
    return res, floor_us


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    bad = [a for a in args if not a.isdigit() or int(a) < 2]
    if bad:
        print(f"{bad[0]!r}: a pipeline depth is an integer >= 2 (usage: python3 -m bench.probes.tma_wait_probe "
              "[stages...])", file=sys.stderr)
        return 2
    for st in [int(a) for a in args] or [5]:
        run(stages=st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
