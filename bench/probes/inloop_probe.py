"""Which of the chain's stages gain from a wait inside the pipelined loop, alone and together?
    python3 -m bench.probes.inloop_probe [MASK...]      (a GPU (H200); default: 0 4 2 15)

bench/NOTES.md v96-v100: in the 1B decoder, GATE_UP alone (v96) and O alone (v99) waiting inside their
pipelined loop (the prologue issued before the poll) lost 0.3-1.5%; in chain_probe's shapes every stage
waiting inside won 3.3-4.2 us a layer (v98, run 167), and run 171 (this probe's first form, below) had it
win 5 us a layer with the decoder's stage shapes. This probe asks which stages the gain comes from: is
the chain a model of v96's loss, or does the gain need every stage inside?

The chain is chain_probe's row-block chain with the 1B decoder's GEMV stages (per layer: QKV 96 tiles
of 32 rows, O 128 of 16, gate/up 128 of 128, down 128 of 64 rows of 2048; 16 layers), blocks of 8 rows x
2048 (32 KB), one tile per SM a stage, every tile waiting for all tiles of the stage before. A MASK
names the stages whose tiles wait inside (QKV 1, O 2, gate/up 4, down 8; 0: all before, the
megakernel's shape today); each tile reads its mode from its first block's table row, so one kernel runs
every mask. Outputs are checked against mask 0's (bitwise), then every mask is timed alternated
(medians of CUDA events), us a layer against the floor of the run.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from bench.probes import chain_probe as cp

RR, KR = cp.RR, cp.KR                      # a block: 8 rows x 2048 bf16 = 32 KB
NW = 4                                     # the 1B decoder's warps
#: the 1B decoder's GEMV stages a layer: (tiles, rows, K); a mask's bit s is stage s
SHAPES = ((96, 32, 2048), (128, 16, 2048), (128, 128, 2048), (128, 64, 2048))
BEFORE, INSIDE = 1, 2                      # a tile's mode, in its first block's table row (column 1)


@triton.jit
def tile_loop(tab_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch,
              STAGES: tl.constexpr):
    # program p runs queue p; a tile whose mode is INSIDE waits (and reads its vector) in its loop's first
    # iteration, after the prologue's copies are issued; BEFORE: ahead of the loop
    t0, t1 = cp._sm_span(tstart_ptr)
    rows = tl.arange(0, RR)
    cols = tl.arange(0, KR)
    for t in range(t0, t1):
        s = tl.load(tiles_ptr + t)
        s1 = tl.load(tiles_ptr + t + 1)
        inside = tl.load(tab_ptr + s * 6 + 1) == 2
        hv = tl.zeros([1, KR], dtype=tl.float32)
        if not inside:
            cp._tile_wait(tab_ptr + s * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
            hv = tl.load(x_ptr + cols, cache_modifier=".cg")[None, :]
        for j in tl.range(s, s1, num_stages=STAGES):
            if inside & (j == s):
                cp._tile_wait(tab_ptr + j * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
                hv = tl.load(x_ptr + cols, cache_modifier=".cg")[None, :]
            cp.row_block(tab_ptr, w_ptr, out_ptr, j, rows, cols, hv)
        cp._tile_signal(tab_ptr, s1, cnt_ptr)


def plan(layers: int, sms: int, mask: int, stages=SHAPES):
    """chain_probe.plan_rows with each tile's mode in its first block's row (column 1): INSIDE where
    bit s of ``mask`` is set for its stage s, else BEFORE."""
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < 1 << len(stages):
        raise ValueError(f"mask must be an int in [0, {1 << len(stages)}), got {mask!r}")
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_rows(layers, sms, stages)
    for t in range(len(tiles) - 1):
        stage = tab[tiles[t + 1] - 1][5] % len(stages)          # its signal counter: layer * stages + stage
        tab[tiles[t]][1] = INSIDE if mask >> stage & 1 else BEFORE
    return tab, tiles, tstart, nw, nout, ncnt


def launch(tables, x, w, out, cnt, err, epoch, sms, stages):
    tab_t, tiles_t, tstart_t = tables
    tile_loop[(sms,)](tab_t, tiles_t, tstart_t, x, w, out, cnt, err, epoch, STAGES=stages, num_warps=NW)


def run(masks=(0, 4, 2, 15), device="cuda", layers=16, sms=None, steps=20, stages=4):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    bw = cp.stream_bw(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    tables, w, nout, ncnt = {}, None, 0, 0
    for m in masks:
        tab, tiles, tstart, nw, nout, ncnt = plan(layers, sms, m)
        tables[m] = (i64(tab).reshape(-1), i64(tiles), i64(tstart))
        if w is None:
            w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    res, outs = {}, {}
    for m in list(masks) + list(masks)[::-1]:
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * cp.RR_, dtype=torch.float32, device=dev)
        t = cp.timed_median(lambda step: launch(tables[m], x, w, out, cnt, err, step, sms, stages), steps)
        if int(err.item()):
            raise RuntimeError(f"mask {m}: {int(err.item())} waits gave up")
        outs.setdefault(m, out.clone())
        res.setdefault(f"mask {m}", []).append(t)
    for m in masks[1:]:
        if not torch.equal(outs[m], outs[masks[0]]):
            raise RuntimeError(f"mask {m}: outputs differ from mask {masks[0]}'s")
    floor_us = cp.report(dev, layers, sms, w.numel() * 2, bw, f"pipeline {stages}, {NW} warps "
                         "(mask bits: QKV 1, O 2, gate/up 4, down 8)", res, 8)
    return res, floor_us


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    bad = [a for a in args if not a.isdigit() or int(a) >= 1 << len(SHAPES)]
    if bad:
        print(f"{bad[0]!r}: a mask is an integer in [0, {1 << len(SHAPES)}) (usage: python3 -m "
              "bench.probes.inloop_probe [MASK...]; bits QKV 1, O 2, gate/up 4, down 8)", file=sys.stderr)
        return 2
    run(tuple(int(a) for a in args) or (0, 4, 2, 15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
