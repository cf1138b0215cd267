"""Does one pipelined loop over an SM's whole queue (waits and signals inside it) take the per-stage
ramp out of a chain of dependent one-wave GEMV stages?   python3 -m bench.probes.chain_probe (a GPU)

The 1B decoder's GEMV stages, 16 layers, without attention or epilogues: per layer QKV (96 tiles of
32 x 2048), O (64 tiles of 32 x 2048), gate/up (128 tiles of 128 x 2048: 64 gate + 64 up rows) and
down (128 tiles of 32 x 4096), tile i of a stage on SM i, each stage waiting for every tile of the
one before (a counter per stage, acquire polls bounded in count) and each tile signalling its own
stage's counter (release). Every tile streams [16, 1024] bf16 blocks (32 KB) through the same body.

    per_tile : a pipelined loop per tile, the wait before it and the signal after it (the megakernel's
               shape today: an SM's pipeline drains at every instruction and refills after its wait)
    flat     : one pipelined loop over every block of the SM's queue, the wait at a tile's first
               block and the signal at its last, so the next tile's first blocks are loaded while
               the SM finishes the current one and while it waits

The floor is the bytes over the stream-copy bandwidth measured in the same run. bench/NOTES.md
("why every load-ahead variant has lost") is the question this answers.
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl

ROWS_, COLS_ = 16, 1024             # a block: 16 rows x 1024 columns of bf16 = 32 KB
BR, BK = tl.constexpr(ROWS_), tl.constexpr(COLS_)
SPIN = tl.constexpr(1 << 22)        # polls before a wait gives up (the run then reports an error)


@triton.jit
def _block(tab, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, WAIT: tl.constexpr, SIG: tl.constexpr):
    # one block: table row j = (weight offset, x offset: what the addresses below compute; wait counter,
    # its target per call, out index, signal counter; -1: none)
    # the weights are packed in table order (block j at j * BR * BK: prepacked per SM queue) and the
    # block's vector is x[(j % 4) * BK :][:BK], so both addresses are arithmetic in j and the software
    # pipeliner streams them (an address loaded from the table is not pipelined: 17 KB of shared memory)
    e = tab + j * 6
    rows = tl.arange(0, BR)
    cols = tl.arange(0, BK)
    w = tl.load(w_ptr + j * (BR * BK) + rows[:, None] * BK + cols[None, :], eviction_policy="evict_first")
    if WAIT:
        wc = tl.load(e + 2)
        if wc >= 0:
            tgt = tl.load(e + 3) * epoch
            seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
            n = 0
            while (seen < tgt) & (n < SPIN):
                seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
                n += 1
            if seen < tgt:
                tl.atomic_add(err_ptr, 1)
    xv = tl.load(x_ptr + (j % 4) * BK + cols, cache_modifier=".cg")
    acc += w.to(tl.float32) * xv[None, :]
    oi = tl.load(e + 4)
    if oi >= 0:
        tl.store(out_ptr + oi * BR + rows, tl.sum(acc, 1))
        acc = tl.zeros([BR, BK], dtype=tl.float32)
    if SIG:
        sc = tl.load(e + 5)
        if sc >= 0:
            tl.atomic_add(cnt_ptr + sc, 1, sem="release", scope="gpu")
    return acc


@triton.jit
def chain_flat(tab_ptr, start_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch, STAGES: tl.constexpr):
    pid = tl.program_id(0)
    b0 = tl.load(start_ptr + pid)
    b1 = tl.load(start_ptr + pid + 1)
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.range(b0, b1, num_stages=STAGES):
        acc = _block(tab_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, True, True)


@triton.jit
def chain_per_tile(tab_ptr, start_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch,
                   STAGES: tl.constexpr):
    # tiles_ptr: the first block of every tile, in queue order; tstart_ptr: each SM's first tile
    pid = tl.program_id(0)
    t0 = tl.load(tstart_ptr + pid)
    t1 = tl.load(tstart_ptr + pid + 1)
    for t in range(t0, t1):
        s = tl.load(tiles_ptr + t)
        s1 = tl.load(tiles_ptr + t + 1)
        e = tab_ptr + s * 6
        wc = tl.load(e + 2)
        if wc >= 0:
            tgt = tl.load(e + 3) * epoch
            seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
            n = 0
            while (seen < tgt) & (n < SPIN):
                seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
                n += 1
            if seen < tgt:
                tl.atomic_add(err_ptr, 1)
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for j in tl.range(s, s1, num_stages=STAGES):
            acc = _block(tab_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, False, False)
        sc = tl.load(tab_ptr + (s1 - 1) * 6 + 5)
        tl.atomic_add(cnt_ptr + sc, 1, sem="release", scope="gpu")


def plan(layers: int, sms: int, stages=((96, 32, 2048), (64, 32, 2048), (128, 128, 2048), (128, 32, 4096))):
    """The block table: per SM its tiles in layer / stage order, each tile's blocks row group by row
    group (the columns of a row group in order, the sum stored at its last block). Returns the table
    [blocks, 6], each SM's first block, the tiles' first blocks, each SM's first tile, the weight
    elements and the output rows."""
    queues = [[] for _ in range(sms)]
    woff = out = 0
    cnt = 0
    for _ in range(layers):
        for si, (ntiles, rows, k) in enumerate(stages):
            if ntiles > sms:
                raise ValueError(f"stage {si}: {ntiles} tiles on {sms} SMs (one wave only)")
            prev = cnt - 1 if cnt > 0 else -1
            prev_tiles = stages[si - 1][0] if si > 0 else stages[-1][0]
            for t in range(ntiles):
                blocks = []
                for rg in range(rows // ROWS_):
                    for cb in range(k // COLS_):
                        last_cb = cb == k // COLS_ - 1
                        blocks.append([woff, cb * COLS_, -1, 0, out if last_cb else -1, -1])
                        woff += ROWS_ * COLS_
                    out += 1
                blocks[0][2], blocks[0][3] = prev, (prev_tiles if prev >= 0 else 0)
                blocks[-1][5] = cnt
                queues[t].append(blocks)
            cnt += 1
    tab, start, tiles, tstart = [], [0], [], [0]
    for q in queues:
        for blocks in q:
            tiles.append(len(tab))
            tab.extend(blocks)
        start.append(len(tab))
        tstart.append(len(tiles))
    tiles.append(len(tab))
    for j, r in enumerate(tab):            # the kernels' addresses: weights in table order, x by j % 4
        r[0], r[1] = j * ROWS_ * COLS_, (j % 4) * COLS_
    return tab, start, tiles, tstart, woff, out, cnt


def run(device="cuda", layers=16, sms=None, steps=20, stages=5, check=True):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    tab, start, tiles, tstart, nw, nout, ncnt = plan(layers, sms)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    tab_t, start_t, tiles_t, tstart_t = i64(tab).reshape(-1), i64(start), i64(tiles), i64(tstart)
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    x = torch.randn(4096, generator=g).to(dev)
    res = {}
    a = torch.empty(1 << 28, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ev = lambda: torch.cuda.Event(enable_timing=True)                   # noqa: E731
    ts = []
    for _ in range(8):
        e0, e1 = ev(), ev()
        e0.record(); b.copy_(a); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    bw = 2 * a.numel() * 2 / (statistics.median(ts) * 1e-3)
    del a, b
    floor_us = nw * 2 / bw * 1e6
    outs = {}
    for name in ("per_tile", "flat", "per_tile", "flat"):
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * ROWS_, dtype=torch.float32, device=dev)
        times = []
        for step in range(1, steps + 1):
            e0, e1 = ev(), ev()
            e0.record()
            if name == "flat":
                chain_flat[(sms,)](tab_t, start_t, x, w, out, cnt, err, step, STAGES=stages, num_warps=8)
            else:
                chain_per_tile[(sms,)](tab_t, start_t, tiles_t, tstart_t, x, w, out, cnt, err, step, STAGES=stages,
                                       num_warps=8)
            e1.record()
            torch.cuda.synchronize()
            times.append(e0.elapsed_time(e1) * 1e3)
        if int(err.item()):
            raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
        outs.setdefault(name, out.clone())
        res.setdefault(name, []).append(statistics.median(times[2:]))
    if check:
        if not torch.equal(outs["flat"], outs["per_tile"]):
            raise RuntimeError("flat and per_tile outputs differ")
    print(f"{torch.cuda.get_device_name(dev)}: {layers} layers of the 1B's GEMV stages on {sms} SMs, "
          f"{nw * 2 / 1e6:.1f} MB, stream copy {bw / 1e12:.3f} TB/s, floor {floor_us:.1f} us, pipeline {stages}")
    for name, v in res.items():
        m = statistics.median(v)
        print(f"  {name:9s} {' / '.join(f'{t:.1f}' for t in v)} us  ({m / floor_us:.3f}x the floor, "
              f"{m / layers:.1f} us per layer)")
    return res, floor_us


if __name__ == "__main__":
    for st in [int(s) for s in (sys.argv[1:] or ["5"])]:
        run(stages=st)
