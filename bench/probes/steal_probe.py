"""Does taking a stage's row blocks by ticket, inside the pipelined loop, shorten a chain of one-wave GEMV
stages?   python3 -m bench.probes.steal_probe [DEPTH...]   (a GPU; DEPTH: the pipeline's stages, default 5)

The 1B's stages end 1-2.6 us after their mean tile ends (run 137: GATE_UP's 128 tiles end over 2.25 us),
and the straggle is noise, not slow SMs (``bench.records --per-sm``: taking each SM's mean offset out
moves GATE_UP's end 0.23 us). A static schedule cannot remove noise; an SM that takes its next block
when it is ready can. The question is whether that survives Triton's pipeliner and the tickets' cost.

The chain is chain_probe's row-block chain (``chain_probe.STAGE_SHAPES``: 16 layers of the 1B's QKV, O,
gate/up and down as 8-row x 2048-column bf16 blocks, 32 KB; every block dotted with the same vector),
each stage waiting for the one before on one counter. Three schedules of the same blocks:

    per_tile : chain_probe.rows_per_tile, today's megakernel: a stage's tiles on its first SMs (QKV on 96,
               O on 64), one tile an SM, a pipelined loop per tile
    static   : every SM takes an equal contiguous share (``[p * NB // SMs, (p + 1) * NB // SMs)``), no tickets
    even     : every SM takes an equal contiguous share (``NB // SMs`` blocks) in a pipelined loop, then the
               remainder (< one block an SM) by ticket
    steal    : every SM takes ``NB // SMs - HOLD`` blocks of its own, then blocks by ticket from the stage's
               pool (``HOLD`` blocks an SM on average) in the same pipelined loop: the ticket for the next
               iteration is taken in this one (a relaxed atomic, its latency under the block's stream)

``even`` and ``steal`` run ``own + SLACK`` iterations (a ticket past the pool is a masked no-op) and then a
plain loop over whatever tickets remain, so every block is done whatever SLACK is; each SM signals the
stage's counter once, and the next stage waits for all of them. The tickets are zeroed before each call
(outside the timed window). Every block's sum is checked against torch.
"""
from __future__ import annotations

import sys

import torch
import triton
import triton.language as tl

from bench.probes.chain_probe import KR, RR, RR_, STAGE_SHAPES, _wait, report, stream_bw
from bench.probes import chain_probe as cp

SLACK = 4       # pipelined iterations past an SM's own blocks
HOLD = 2        # steal: blocks an SM leaves to the pool, on average


@triton.jit
def _block(w_ptr, out_ptr, j, nb, base, hv, rows, cols):
    # block j of a stage (masked past its nb blocks): its RR sums, stored at its global index
    v = j < nb
    w = tl.load(w_ptr + (base + j) * (RR * KR) + rows[:, None] * KR + cols[None, :], mask=v, other=0.0,
                eviction_policy="evict_first")
    tl.store(out_ptr + (base + j) * RR + rows, tl.sum(w.to(tl.float32) * hv[None, :], 1), mask=(rows < RR) & v)


@triton.jit
def _sm_setup():
    # this SM, the SM count, and a block's row and column offsets
    return tl.program_id(0), tl.num_programs(0), tl.arange(0, RR), tl.arange(0, KR)


@triton.jit
def _stage_begin(stab_ptr, st, x_ptr, cnt_ptr, err_ptr, epoch, cols):
    # stage st's table row (blocks, first global block, own blocks an SM, pipelined iterations), after the
    # wait for every SM's signal of the stage before it; and the stage's vector, read after that wait
    e = stab_ptr + st * 4
    nb = tl.load(e)
    base = tl.load(e + 1)
    own = tl.load(e + 2)
    nl = tl.load(e + 3)
    if st > 0:
        _wait(cnt_ptr, err_ptr, st - 1, tl.num_programs(0) * epoch)
    hv = tl.load(x_ptr + cols, cache_modifier=".cg")
    return nb, base, own, nl, hv


@triton.jit
def _stage_end(cnt_ptr, st):
    # this SM's share of stage st is stored: one signal of the stage's counter
    tl.debug_barrier()
    tl.atomic_add(cnt_ptr + st, 1, sem="release", scope="gpu")


@triton.jit
def rows_ticket(stab_ptr, tk_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch, NST, STAGES: tl.constexpr):
    # stab: per stage (blocks, first global block, own blocks an SM, pipelined iterations)
    p, P, rows, cols = _sm_setup()
    for st in range(NST):
        nb, base, own, nl, hv = _stage_begin(stab_ptr, st, x_ptr, cnt_ptr, err_ptr, epoch, cols)
        pool0 = P * own
        j = p * own                                     # own >= 1: the first block is the SM's own
        for it in tl.range(0, nl, num_stages=STAGES):
            take = it + 1 >= own                        # the next block comes from the pool
            t = tl.atomic_add(tk_ptr + st, 1, sem="relaxed", scope="gpu", mask=take)
            jn = tl.where(take, pool0 + t, j + 1)
            _block(w_ptr, out_ptr, j, nb, base, hv, rows, cols)
            j = jn
        while j < nb:                                   # tickets SLACK did not cover
            _block(w_ptr, out_ptr, j, nb, base, hv, rows, cols)
            j = pool0 + tl.atomic_add(tk_ptr + st, 1, sem="relaxed", scope="gpu")
        _stage_end(cnt_ptr, st)


@triton.jit
def rows_static(stab_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, epoch, NST, STAGES: tl.constexpr):
    # every SM its contiguous share of each stage, [p * nb // P, (p + 1) * nb // P): all SMs, no tickets
    p, P, rows, cols = _sm_setup()
    for st in range(NST):
        nb, base, _, _, hv = _stage_begin(stab_ptr, st, x_ptr, cnt_ptr, err_ptr, epoch, cols)
        for j in tl.range(p * nb // P, (p + 1) * nb // P, num_stages=STAGES):
            w = tl.load(w_ptr + (base + j) * (RR * KR) + rows[:, None] * KR + cols[None, :], eviction_policy="evict_first")
            tl.store(out_ptr + (base + j) * RR + rows, tl.sum(w.to(tl.float32) * hv[None, :], 1))
        _stage_end(cnt_ptr, st)


def plan(layers: int, sms: int, hold: int, stages=STAGE_SHAPES, slack: int = SLACK):
    """Per stage (layer-major) [blocks, first global block, own blocks an SM, pipelined iterations]: an SM
    owns ``blocks // sms - hold`` blocks (at least 1) and loops ``own + slack`` times. Returns the table,
    the total blocks and the number of stages (counters)."""
    tab, base = [], 0
    for _ in range(layers):
        for ntiles, rows, k in stages:
            if k != KR.value or rows % RR_:
                raise ValueError(f"a stage of {rows}-row tiles of K {k}: blocks are {RR_} x {KR.value}")
            nb = ntiles * rows // RR_
            if nb < sms:
                raise ValueError(f"a stage of {nb} blocks on {sms} SMs: every SM needs a block of its own")
            own = max(1, nb // sms - hold)
            tab.append([nb, base, own, own + slack])
            base += nb
    return tab, base, len(tab)


def reference(w: torch.Tensor, x: torch.Tensor, nblocks: int) -> torch.Tensor:
    """Every block's RR sums (fp32), in global block order."""
    return (w[:nblocks * RR_ * KR.value].float().view(nblocks * RR_, KR.value) @ x[:KR.value].float())


def launch(stab, tk, x, w, out, cnt, err, epoch, sms, nst, stages, zero=True):
    """One call of :func:`rows_ticket`, its tickets zeroed first unless ``zero`` is False (the caller
    zeroes them outside its timed window)."""
    if zero:
        tk.zero_()
    rows_ticket[(sms,)](stab, tk, x, w, out, cnt, err, epoch, nst, STAGES=stages, num_warps=8)


def run(device="cuda", layers=16, sms=None, steps=20, stages=5):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    bw = stream_bw(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    # per_tile: chain_probe's own tables and weights
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_rows(layers, sms)
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    pt_tables = (i64(tab).reshape(-1), i64(start), i64(tiles), i64(tstart))
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
    nbytes = w.numel() * 2
    plans = {name: plan(layers, sms, hold) for name, hold in (("even", 0), ("steal", HOLD))}
    ref = reference(w, x, plans["steal"][1])
    res = {}
    plans["static"] = plans["even"]
    for name in ["per_tile", "static", "even", "steal", "steal", "even", "static", "per_tile"]:
        cnt = torch.zeros(ncnt if name == "per_tile" else plans[name][2], dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * RR_, dtype=torch.float32, device=dev)
        if name != "per_tile":
            stab = torch.tensor(plans[name][0], dtype=torch.int32, device=dev).reshape(-1)
        if name in ("even", "steal"):
            tk = torch.zeros(plans[name][2], dtype=torch.int32, device=dev)
        if name == "per_tile":
            t = cp.timed_median(lambda step: cp.launch("rows_per_tile", pt_tables, x, w, out, cnt, err, step, sms,
                                                       stages), steps)
        elif name == "static":
            t = cp.timed_median(lambda step: rows_static[(sms,)](stab, x, w, out, cnt, err, step, plans[name][2],
                                                                 STAGES=stages, num_warps=8), steps)
        else:                               # the tickets zeroed before each timed window
            t = cp.timed_median(lambda step: launch(stab, tk, x, w, out, cnt, err, step, sms, plans[name][2], stages,
                                                    zero=False), steps, before=tk.zero_)
        if int(err.item()):
            raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
        # per_tile streams table row j's block from j * RR * KR and stores it at out row j: the global block
        # order of the others (chain_probe.plan_rows), so one reference serves all of them
        torch.testing.assert_close(out, ref, rtol=2e-3, atol=2e-3)
        res.setdefault(name, []).append(t)
    report(dev, layers, sms, nbytes, bw, f"pipeline {stages}, hold {HOLD}, slack {SLACK}", res, 9)
    return res


def main(argv) -> int:
    """``steal_probe [DEPTH...]``: each pipeline depth (an integer >= 1; default 5) in turn,
    one process; --help prints the module's usage. A bad argument is one line and exit 2, before any GPU work."""
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__.strip())
        return 0
    depths = []
    for a in argv:
        if not a.isdigit() or int(a) < 1:
            print(f"steal_probe: a pipeline depth is an integer >= 1, got {a!r}", file=sys.stderr)
            return 2
        depths.append(int(a))
    for st in depths or [5]:
        run(stages=st)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
