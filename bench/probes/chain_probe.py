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

A gap (``gaps``: nanoseconds per counter; the ``GAP`` constexpr, 0 compiles none): after a tile's wait
on a counter with a gap, the SM spins that long on the clock before it goes on, a phase that streams
nothing, as the 1B's attention between its QKV and O stages (~6 us a layer, NOTES "where the 1B's HBM
sits idle"). ``per_tile`` idles through it; ``flat`` has its next blocks in flight.
"""
from __future__ import annotations

import statistics
import sys

import torch
import triton
import triton.language as tl

from interp.sync import clock_ns

ROWS_, COLS_ = 16, 1024             # a block: 16 rows x 1024 columns of bf16 = 32 KB
BR, BK = tl.constexpr(ROWS_), tl.constexpr(COLS_)
SPIN = tl.constexpr(1 << 22)        # polls before a wait gives up (the run then reports an error)


@triton.jit
def _wait(cnt_ptr, err_ptr, wc, tgt):
    seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
    n = 0
    while (seen < tgt) & (n < SPIN):
        seen = tl.atomic_add(cnt_ptr + wc, 0, sem="acquire", scope="gpu")
        n += 1
    if seen < tgt:
        tl.atomic_add(err_ptr, 1)


@triton.jit
def _gap_on(gap_ptr, wc, INTERP: tl.constexpr):
    # counter wc's gap: spin gap_ptr[wc] ns on the clock (the globaltimer; the host's under the interpreter)
    ns = tl.load(gap_ptr + wc)
    t0 = clock_ns(INTERP)
    t = t0
    while t - t0 < ns:
        t = clock_ns(INTERP)


@triton.jit
def _tile_wait(e, cnt_ptr, err_ptr, epoch, gap_ptr, GAP: tl.constexpr, INTERP: tl.constexpr):
    # the wait of table row e (a tile's first block): counter e[2] (-1: none) to e[3] per call, then the
    # counter's gap (GAP 0: no code; gap_ptr is then never read)
    wc = tl.load(e + 2)
    if wc >= 0:
        _wait(cnt_ptr, err_ptr, wc, tl.load(e + 3) * epoch)
        if GAP:
            _gap_on(gap_ptr, wc, INTERP)


@triton.jit
def _sm_span(off_ptr):
    # this SM's [lo, hi) of a per-SM offset table (its blocks, or its tiles)
    pid = tl.program_id(0)
    return tl.load(off_ptr + pid), tl.load(off_ptr + pid + 1)


@triton.jit
def _tile_start(tab_ptr, tiles_ptr, t, cnt_ptr, err_ptr, epoch, gap_ptr, GAP: tl.constexpr, INTERP: tl.constexpr):
    # tile t of the per-tile plans: its blocks [s, s1) (tiles_ptr: every tile's first block), after its wait
    s = tl.load(tiles_ptr + t)
    s1 = tl.load(tiles_ptr + t + 1)
    _tile_wait(tab_ptr + s * 6, cnt_ptr, err_ptr, epoch, gap_ptr, GAP, INTERP)
    return s, s1


@triton.jit
def _tile_signal(tab_ptr, s1, cnt_ptr):
    # the per-tile plans' signal: the counter of the tile's last block (table row s1 - 1)
    tl.atomic_add(cnt_ptr + tl.load(tab_ptr + (s1 - 1) * 6 + 5), 1, sem="release", scope="gpu")


@triton.jit
def _block(tab, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, WAIT: tl.constexpr, SIG: tl.constexpr,
           gap_ptr, GAP: tl.constexpr, INTERP: tl.constexpr):
    # one block: table row j = (weight offset, x offset: what the addresses below compute; wait counter,
    # its target per call, out index, signal counter; -1: none)
    # the weights are packed in table order (block j at j * BR * BK: prepacked per SM queue) and the
    # block's vector is x[(j % 4) * BK :][:BK]: both addresses are arithmetic in j (an address loaded
    # from the table pipelines too, given tl.multiple_of hints: NOTES, "The rewrite the probes point to")
    e = tab + j * 6
    rows = tl.arange(0, BR)
    cols = tl.arange(0, BK)
    w = tl.load(w_ptr + j * (BR * BK) + rows[:, None] * BK + cols[None, :], eviction_policy="evict_first")
    if WAIT:
        _tile_wait(e, cnt_ptr, err_ptr, epoch, gap_ptr, GAP, INTERP)
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
def chain_flat(tab_ptr, start_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch, gap_ptr, STAGES: tl.constexpr,
               GAP: tl.constexpr, INTERP: tl.constexpr):
    b0, b1 = _sm_span(start_ptr)
    acc = tl.zeros([BR, BK], dtype=tl.float32)
    for j in tl.range(b0, b1, num_stages=STAGES):
        acc = _block(tab_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, True, True, gap_ptr, GAP, INTERP)


@triton.jit
def chain_per_tile(tab_ptr, start_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch,
                   gap_ptr, STAGES: tl.constexpr, GAP: tl.constexpr, INTERP: tl.constexpr):
    # tiles_ptr: the first block of every tile, in queue order; tstart_ptr: each SM's first tile
    t0, t1 = _sm_span(tstart_ptr)
    for t in range(t0, t1):
        s, s1 = _tile_start(tab_ptr, tiles_ptr, t, cnt_ptr, err_ptr, epoch, gap_ptr, GAP, INTERP)
        acc = tl.zeros([BR, BK], dtype=tl.float32)
        for j in tl.range(s, s1, num_stages=STAGES):
            acc = _block(tab_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, j, acc, epoch, False, False, gap_ptr, 0,
                         INTERP)
        _tile_signal(tab_ptr, s1, cnt_ptr)


# the 1B decoder's GEMV stages per layer: (tiles, rows, K); down's 32 x 4096 tiles as 64 x 2048 (the same
# 256 KB), so that every tile is whole rows of 2048 columns for the row-block variants
STAGE_SHAPES = ((96, 32, 2048), (64, 32, 2048), (128, 128, 2048), (128, 64, 2048))
RR_ = 8                             # a row block: 8 rows x 2048 columns of bf16 = 32 KB
RR = tl.constexpr(RR_)
KR = tl.constexpr(2048)


@triton.jit
def rows_flat(tab_ptr, start_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch, STAGES: tl.constexpr):
    # one pipelined loop over the SM's row blocks; a tile's vector is loaded once, after its wait, at
    # its first block (inside a branch: not pipelined, so never read before the wait), and carried
    b0, b1 = _sm_span(start_ptr)
    rows = tl.arange(0, RR)
    cols = tl.arange(0, KR)
    hv = tl.zeros([KR], dtype=tl.float32)
    for j in tl.range(b0, b1, num_stages=STAGES):
        e = tab_ptr + j * 6
        w = tl.load(w_ptr + j * (RR * KR) + rows[:, None] * KR + cols[None, :], eviction_policy="evict_first")
        if tl.load(e + 1) != 0:                 # a tile's first block
            _tile_wait(e, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
            hv = tl.load(x_ptr + cols, cache_modifier=".cg")
        tl.store(out_ptr + tl.load(e + 4) * RR + rows, tl.sum(w.to(tl.float32) * hv[None, :], 1))
        sc = tl.load(e + 5)
        if sc >= 0:
            tl.atomic_add(cnt_ptr + sc, 1, sem="release", scope="gpu")


@triton.jit
def row_block(tab_ptr, w_ptr, out_ptr, j, rows, cols, hv):
    # one RR-row block of the row chain: block j's weights (table order, arithmetic in j so that the
    # pipeliner issues them ahead) dotted with the [1, KR] vector, stored at the block's output index
    w = tl.load(w_ptr + j * (RR * KR) + rows[:, None] * KR + cols[None, :], eviction_policy="evict_first")
    tl.store(out_ptr + tl.load(tab_ptr + j * 6 + 4) * RR + rows, tl.sum(w.to(tl.float32) * hv, 1))


@triton.jit
def rows_per_tile(tab_ptr, start_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch,
                  STAGES: tl.constexpr):
    # the row loop of today's GATE_UP / LM_HEAD: wait, the vector, a pipelined loop per tile, the signal
    t0, t1 = _sm_span(tstart_ptr)
    rows = tl.arange(0, RR)
    cols = tl.arange(0, KR)
    for t in range(t0, t1):
        s, s1 = _tile_start(tab_ptr, tiles_ptr, t, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
        hv = tl.load(x_ptr + cols, cache_modifier=".cg")
        for j in tl.range(s, s1, num_stages=STAGES):
            w = tl.load(w_ptr + j * (RR * KR) + rows[:, None] * KR + cols[None, :], eviction_policy="evict_first")
            tl.store(out_ptr + tl.load(tab_ptr + j * 6 + 4) * RR + rows, tl.sum(w.to(tl.float32) * hv[None, :], 1))
        _tile_signal(tab_ptr, s1, cnt_ptr)


def _flatten(queues):
    """The SMs' queues of tiles (lists of block rows) as one table: the blocks in SM order, each SM's
    first block (and the end), each tile's first block (and the end), each SM's first tile."""
    tab, start, tiles, tstart = [], [0], [], [0]
    for q in queues:
        for blocks in q:
            tiles.append(len(tab))
            tab.extend(blocks)
        start.append(len(tab))
        tstart.append(len(tiles))
    tiles.append(len(tab))
    return tab, start, tiles, tstart


def plan_rows(layers: int, sms: int, stages=STAGE_SHAPES):
    """:func:`plan` for the row-block kernels: a block is RR whole rows (column 1: 1 at a tile's first
    block; column 4: the block's output index, RR rows from index * RR)."""
    queues = [[] for _ in range(sms)]
    cnt = 0
    for _ in range(layers):
        for si, (ntiles, rows, k) in enumerate(stages):
            if ntiles > sms or k != KR.value:
                raise ValueError(f"stage {si}: {ntiles} tiles of K {k} on {sms} SMs (one wave of K {KR.value})")
            prev_tiles = stages[si - 1][0] if si > 0 else stages[-1][0]
            for t in range(ntiles):
                blocks = [[0, 0, -1, 0, 0, -1] for _ in range(rows // RR_)]
                blocks[0][1] = 1
                if cnt > 0:
                    blocks[0][2], blocks[0][3] = cnt - 1, prev_tiles
                blocks[-1][5] = cnt
                queues[t].append(blocks)
            cnt += 1
    tab, start, tiles, tstart = _flatten(queues)
    for j, r in enumerate(tab):
        r[0], r[4] = j * RR_ * KR.value, j
    return tab, start, tiles, tstart, len(tab) * RR_ * KR.value, len(tab), cnt


def plan(layers: int, sms: int, stages=STAGE_SHAPES):
    """The block table: per SM its tiles in layer / stage order, each tile's blocks row group by row
    group (the columns of a row group in order, the sum stored at its last block). A stage is (tiles,
    rows a tile, K). Returns the table [blocks, 6], each SM's first block, the tiles' first blocks, each
    SM's first tile, the weight elements and the output rows."""
    return _plan(layers, sms, stages, lambda ntiles, rows, t: rows // ROWS_)


#: the 1B decoder's GEMV stages as its default tiling cuts them at a short cache (``Tiling.for_config``,
#: s42): per layer (tiles, the stage's rows, K): QKV 96 tiles of 32 rows, O 128 of 16, gate/up 132 tiles of
#: ~124 rows (62 gate + 62 up on every SM: ragged, 7 or 8 groups of 16), down 128 tiles of 16 rows x 8192
#: (one K chunk); 121.6 MB a layer, STAGE_SHAPES' 121.6 MB cut into the decoder's tiles
DECODER_STAGES = ((96, 3072, 2048), (128, 2048, 2048), (132, 16384, 2048), (128, 2048, 8192))


def plan_decoder(layers: int, sms: int, stages=DECODER_STAGES):
    """:func:`plan` with each stage's 16-row groups split over its tiles as evenly as they go (a stage is
    (tiles, the stage's rows, K); tile t of ``rows / 16`` groups takes [t * groups / tiles, (t + 1) * groups
    / tiles)), tile t on SM t, as the decoder's ragged gate/up (``Tiling.gu_tiles``)."""
    for si, (ntiles, rows, _) in enumerate(stages):
        if rows % ROWS_ or rows // ROWS_ < ntiles:
            raise ValueError(f"stage {si}: {rows} rows are not {ntiles} tiles of whole {ROWS_}-row groups")
    return _plan(layers, sms, stages, lambda ntiles, rows, t: (t + 1) * (rows // ROWS_) // ntiles
                 - t * (rows // ROWS_) // ntiles)


def _plan(layers: int, sms: int, stages, groups):
    # groups(tiles, rows, t): tile t's row groups
    queues = [[] for _ in range(sms)]
    out = cnt = 0
    for _ in range(layers):
        for si, (ntiles, rows, k) in enumerate(stages):
            if ntiles > sms:
                raise ValueError(f"stage {si}: {ntiles} tiles on {sms} SMs (one wave only)")
            prev = cnt - 1 if cnt > 0 else -1
            prev_tiles = stages[si - 1][0] if si > 0 else stages[-1][0]
            for t in range(ntiles):
                blocks = []
                for rg in range(groups(ntiles, rows, t)):
                    for cb in range(k // COLS_):
                        blocks.append([0, 0, -1, 0, out if cb == k // COLS_ - 1 else -1, -1])
                    out += 1
                blocks[0][2], blocks[0][3] = prev, (prev_tiles if prev >= 0 else 0)
                blocks[-1][5] = cnt
                queues[t].append(blocks)
            cnt += 1
    tab, start, tiles, tstart = _flatten(queues)
    for j, r in enumerate(tab):            # the kernels' addresses: weights in table order, x by j % 4
        r[0], r[1] = j * ROWS_ * COLS_, (j % 4) * COLS_
    return tab, start, tiles, tstart, len(tab) * ROWS_ * COLS_, out, cnt


def gaps(ncnt: int, nstages: int, ns: int, after: int = 0) -> list[int]:
    """Per counter of :func:`plan` (``layer * nstages + stage``) the nanoseconds a tile waiting on it
    spins after its wait: ``ns`` after every layer's stage ``after`` (0: QKV, so O's tiles), else 0."""
    return [ns if c % nstages == after else 0 for c in range(ncnt)]


#: variant -> (kernel, plan, outputs per block row group, per-tile tables)
VARIANTS = {"per_tile": (chain_per_tile, plan, ROWS_, True), "flat": (chain_flat, plan, ROWS_, False),
            "rows_per_tile": (rows_per_tile, plan_rows, RR_, True), "rows_flat": (rows_flat, plan_rows, RR_, False)}
#: the variants that take a gap (``gap``: a per-counter int64 tensor of :func:`gaps`)
GAPPED = ("per_tile", "flat")


def launch(name, tables, x, w, out, cnt, err, epoch, sms, stages, gap=None):
    k, _, _, per_tile = VARIANTS[name]
    tab_t, start_t, tiles_t, tstart_t = tables
    if gap is not None and name not in GAPPED:
        raise ValueError(f"{name} takes no gap (those that do: {', '.join(GAPPED)})")
    if name in GAPPED:
        g = dict(gap_ptr=tab_t if gap is None else gap, GAP=int(gap is not None), INTERP=x.device.type != "cuda")
    else:
        g = {}
    if per_tile:
        k[(sms,)](tab_t, start_t, tiles_t, tstart_t, x, w, out, cnt, err, epoch, STAGES=stages, num_warps=8, **g)
    else:
        k[(sms,)](tab_t, start_t, x, w, out, cnt, err, epoch, STAGES=stages, num_warps=8, **g)


def stream_bw(dev) -> float:
    """The probes' stream-copy bandwidth (bytes/s): 512 MB of bf16 copied, median of 8 copies (the floor
    of their reports; bench.baselines' copy measures ~4% more)."""
    a = torch.empty(1 << 28, device=dev, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    ts = []
    for _ in range(8):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); b.copy_(a); e1.record(); torch.cuda.synchronize(); ts.append(e0.elapsed_time(e1))
    return 2 * a.numel() * 2 / (statistics.median(ts) * 1e-3)


def run(device="cuda", layers=16, sms=None, steps=20, stages=5):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    bw = stream_bw(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    res, outs, built = {}, {}, {}
    for name in list(VARIANTS) + list(VARIANTS)[::-1]:
        _, planner, orows, _ = VARIANTS[name]
        if planner not in built:
            tab, start, tiles, tstart, nw, nout, ncnt = planner(layers, sms)
            w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
            built[planner] = ((i64(tab).reshape(-1), i64(start), i64(tiles), i64(tstart)), w, nout, ncnt)
        tables, w, nout, ncnt = built[planner]
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * orows, dtype=torch.float32, device=dev)
        t = timed_median(lambda step: launch(name, tables, x, w, out, cnt, err, step, sms, stages), steps)
        if int(err.item()):
            raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
        outs.setdefault(name, out.clone())
        res.setdefault(name, []).append(t)
    for x_, y_ in (("flat", "per_tile"), ("rows_flat", "rows_per_tile")):
        if not torch.equal(outs[x_], outs[y_]):
            raise RuntimeError(f"{x_} and {y_} outputs differ")
    floor_us = report(dev, layers, sms, built[plan][1].numel() * 2, bw, f"pipeline {stages}", res, 13)
    return res, floor_us


def timed_median(call, steps: int, before=None) -> float:
    """The median CUDA-event time (us) of ``call(epoch)`` over epochs 1..``steps``, the first two left
    out (warm-up); ``before()``, if given, runs ahead of each call, outside the timed window."""
    times = []
    for step in range(1, steps + 1):
        if before is not None:
            before()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        call(step)
        e1.record()
        torch.cuda.synchronize()
        times.append(e0.elapsed_time(e1) * 1e3)
    return statistics.median(times[2:])


def report(dev, layers: int, sms: int, nbytes: int, bw: float, what: str, res: dict, width: int) -> float:
    """Print each variant's times against the floor (``nbytes`` over the stream copy's ``bw``);
    returns the floor in us."""
    floor_us = nbytes / bw * 1e6
    print(f"{torch.cuda.get_device_name(dev)}: {layers} layers of the 1B's GEMV stages on {sms} SMs, "
          f"{nbytes / 1e6:.1f} MB, stream copy {bw / 1e12:.3f} TB/s, floor {floor_us:.1f} us, {what}")
    for name, v in res.items():
        m = statistics.median(v)
        print(f"  {name:{width}s} {' / '.join(f'{t:.1f}' for t in v)} us  ({m / floor_us:.3f}x the floor, "
              f"{m / layers:.1f} us per layer)")
    return floor_us


if __name__ == "__main__":
    for st in [int(s) for s in (sys.argv[1:] or ["5"])]:
        run(stages=st)
