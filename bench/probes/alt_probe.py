"""Two CTAs an SM, alternating stages: does the next stage's prologue land while the other CTA streams?
    python3 -m bench.probes.alt_probe [stages...]      (a GPU (H200); default 4)

bench/NOTES.md v96-v100 and bench/probes/poll_probe.py: a poll issued after a warp's own cp.async
copies returns only once they have landed, so in one CTA a tile that issues its prologue before its
wait starts no earlier than the prologue lands, and in the 1B decoder (every stage's SMs come from the
stage before) it lost. Another CTA's copies do not hold the poll. Here each SM holds two CTAs and the
chain's stages alternate between them (stage c's tile t on CTA t of half c % 2): while one CTA streams
its stage, the other has already entered its next tile, issued that tile's prologue and polls.

The chain is chain_probe's row-block chain with the 1B decoder's GEMV stages (per layer: QKV 96 tiles
of 32 rows, O 128 of 16, gate/up 128 of 128, down 128 of 64 rows of 2048; 16 layers), blocks of 8 rows x
2048 (32 KB), every tile waiting for all tiles of the stage before. Four variants, one kernel:

    one     : one CTA an SM, the wait before the tile's pipelined loop (the megakernel's shape today)
    one_in  : one CTA an SM, the wait in the loop's first iteration (after the prologue; v96's shape)
    two     : two CTAs an SM alternating stages, the wait before the loop
    two_in  : two CTAs an SM alternating stages, the wait in the first iteration

The two-CTA variants need every SM to hold one CTA of each half: the kernel records each program's SM
(``%smid``), and the run reports how many SMs held a pair. Outputs are checked against ``one``'s (the
same sums in the same order: bitwise), then timed alternated (medians of CUDA events), us a layer
against the floor of the run.
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton
import triton.language as tl

from bench.probes import chain_probe as cp

RR, KR = cp.RR, cp.KR                      # a block: 8 rows x 2048 bf16 = 32 KB
NW = 4                                     # the 1B decoder's warps
#: the 1B decoder's GEMV stages a layer: (tiles, rows, K)
SHAPES = ((96, 32, 2048), (128, 16, 2048), (128, 128, 2048), (128, 64, 2048))
NAMES = ("one", "one_in", "two", "two_in")


@triton.jit
def _smid():
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def tile_loop(tab_ptr, tiles_ptr, tstart_ptr, x_ptr, w_ptr, out_ptr, cnt_ptr, err_ptr, sm_ptr, epoch,
              STAGES: tl.constexpr, INSIDE: tl.constexpr, INTERP: tl.constexpr):
    # program p runs queue p of the plan; INSIDE: the wait and the vector in the loop's first iteration
    if not INTERP:
        tl.store(sm_ptr + tl.program_id(0), _smid())
    t0, t1 = cp._sm_span(tstart_ptr)
    rows = tl.arange(0, RR)
    cols = tl.arange(0, KR)
    for t in range(t0, t1):
        s = tl.load(tiles_ptr + t)
        s1 = tl.load(tiles_ptr + t + 1)
        if INSIDE:
            hv = tl.zeros([1, KR], dtype=tl.float32)
        else:
            cp._tile_wait(tab_ptr + s * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
            hv = tl.load(x_ptr + cols, cache_modifier=".cg")[None, :]
        for j in tl.range(s, s1, num_stages=STAGES):
            if INSIDE:
                if j == s:
                    cp._tile_wait(tab_ptr + j * 6, cnt_ptr, err_ptr, epoch, cnt_ptr, 0, False)
                    hv = tl.load(x_ptr + cols, cache_modifier=".cg")[None, :]
            w = tl.load(w_ptr + j * (RR * KR) + rows[:, None] * KR + cols[None, :], eviction_policy="evict_first")
            tl.store(out_ptr + tl.load(tab_ptr + j * 6 + 4) * RR + rows, tl.sum(w.to(tl.float32) * hv, 1))
        cp._tile_signal(tab_ptr, s1, cnt_ptr)


def plan(layers: int, sms: int, halves: int, stages=SHAPES):
    """chain_probe.plan_rows with ``halves`` queues an SM: stage c's tile t goes to queue
    ``t + (c % halves) * sms`` (halves 1: plan_rows' queues; 2: the stages alternate between two CTAs).
    Column 0 and 4 of a block's row: its place in the chain, which :func:`weights_for` and the output
    use, so that both plans compute the same outputs from the same logical weights."""
    if halves not in (1, 2):
        raise ValueError(f"halves must be 1 or 2, got {halves!r}")
    queues = [[] for _ in range(halves * sms)]
    cnt = nblk = 0
    for _ in range(layers):
        for si, (ntiles, rows, k) in enumerate(stages):
            if ntiles > sms or k != KR.value or rows % cp.RR_:
                raise ValueError(f"stage {si}: {ntiles} tiles of {rows} x {k} on {sms} SMs (one wave of whole "
                                 f"{cp.RR_}-row blocks of K {KR.value})")
            prev_tiles = stages[si - 1][0] if si > 0 else stages[-1][0]
            for t in range(ntiles):
                # a block's output index is its place in the chain (layer, stage, tile, block), whatever
                # its place in the queues (column 0: that index; the kernel's weights are in table order)
                blocks = [[nblk + b, 0, -1, 0, nblk + b, -1] for b in range(rows // cp.RR_)]
                nblk += rows // cp.RR_
                blocks[0][1] = 1
                if cnt > 0:
                    blocks[0][2], blocks[0][3] = cnt - 1, prev_tiles
                blocks[-1][5] = cnt
                queues[t + (cnt % halves) * sms].append(blocks)
            cnt += 1
    tab, start, tiles, tstart = cp._flatten(queues)
    return tab, tiles, tstart, nblk * cp.RR_ * KR.value, nblk, cnt


def weights_for(tab, w: torch.Tensor) -> torch.Tensor:
    """The chain's weights (logical block order) in a plan's table order: the kernel reads block j's
    weights at ``j * 32 KB`` (arithmetic in j, as chain_probe's loops, so the pipeliner issues them ahead)."""
    perm = torch.tensor([r[0] for r in tab], dtype=torch.int64)
    return w.view(-1, cp.RR_ * KR.value)[perm.to(w.device)].reshape(-1)


def launch(name, tables, x, out, cnt, err, sm, epoch, sms, stages):
    tab_t, tiles_t, tstart_t, w_t = tables[name.startswith("two")]
    progs = sms * (2 if name.startswith("two") else 1)
    tile_loop[(progs,)](tab_t, tiles_t, tstart_t, x, w_t, out, cnt, err, sm, epoch, STAGES=stages,
                        INSIDE=name.endswith("_in"), INTERP=x.device.type != "cuda", num_warps=NW)


def pairs(sm: torch.Tensor, sms: int) -> int:
    """SMs that held exactly one program of each half (programs ``[0, sms)`` run the even stages,
    ``[sms, 2 sms)`` the odd ones): what the alternation needs of the hardware's placement."""
    ids = sm.tolist()
    first, second = ids[:sms], ids[sms:]
    return sum(1 for s in set(ids) if first.count(s) == 1 and second.count(s) == 1)


def run(device="cuda", layers=16, sms=None, steps=20, stages=4):
    dev = torch.device(device)
    sms = sms or torch.cuda.get_device_properties(dev).multi_processor_count
    i64 = lambda v: torch.tensor(v, dtype=torch.int64, device=dev)      # noqa: E731
    bw = cp.stream_bw(dev)
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(4096, generator=g).to(dev)
    tables, w = [], None
    for halves in (1, 2):
        tab, tiles, tstart, nw, nout, ncnt = plan(layers, sms, halves)
        if w is None:
            w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16).to(dev)
        tables.append((i64(tab).reshape(-1), i64(tiles), i64(tstart), weights_for(tab, w)))
    res, outs, held = {}, {}, {}
    # two CTAs an SM fit at <= 4 stages only (compile_sm90); past that, half of the two-CTA grid would
    # wait for the other half to be resident: never launched
    names = NAMES if stages <= 4 else NAMES[:2]
    for name in names + names[::-1]:
        cnt = torch.zeros(ncnt, dtype=torch.int32, device=dev)
        err = torch.zeros(1, dtype=torch.int32, device=dev)
        sm = torch.full((2 * sms,), -1, dtype=torch.int32, device=dev)
        out = torch.zeros(nout * cp.RR_, dtype=torch.float32, device=dev)
        t = cp.timed_median(lambda step: launch(name, tables, x, out, cnt, err, sm, step, sms, stages), steps)
        if int(err.item()):
            raise RuntimeError(f"{name}: {int(err.item())} waits gave up")
        outs.setdefault(name, out.clone())
        res.setdefault(name, []).append(t)
        if name.startswith("two"):
            held.setdefault(name, []).append(pairs(sm, sms))
    for name in names[1:]:
        if not torch.equal(outs[name], outs["one"]):
            raise RuntimeError(f"{name}: outputs differ from one's")
    floor_us = cp.report(dev, layers, sms, w.numel() * 2, bw, f"pipeline {stages}, {NW} warps", res, 8)
    for name, v in held.items():
        print(f"  {name}: SMs holding one CTA of each half: {' / '.join(map(str, v))} of {sms}")
    return res, floor_us


def compile_sm90(stages=(4, 5)) -> dict:
    """``tile_loop`` compiled for sm_90 (no GPU), per pipeline depth and wait placement: its shared
    memory, which two CTAs an SM must fit twice in the H200's 228 KB."""
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        raise RuntimeError("unset TRITON_INTERPRET (the probe's kernel is compiled, not interpreted)")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    names = tile_loop.arg_names
    sig = {n: ("*i64" if n.startswith("t") else "*bf16" if n == "w_ptr" else "*fp32" if n in ("x_ptr", "out_ptr")
               else "*i32") for n in names if n.endswith("_ptr")}
    sig.update(epoch="i32", STAGES="constexpr", INSIDE="constexpr", INTERP="constexpr")
    out = {}
    for st in stages:
        for inside in (0, 1):
            src = ASTSource(fn=tile_loop, signature={n: sig[n] for n in names},
                            constexprs={(names.index("STAGES"),): st, (names.index("INSIDE"),): inside,
                                        (names.index("INTERP"),): False},
                            attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr")})
            ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=NW))
            out[f"stages{st}_inside{inside}"] = {"shared": ck.metadata.shared,
                                                  "cp.async": ck.asm["ptx"].count("cp.async.cg")}
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--compile"]:
        print(json.dumps(compile_sm90()))
        return 0
    bad = [a for a in args if not a.isdigit() or int(a) < 2]
    if bad:
        print(f"{bad[0]!r}: a pipeline depth is an integer >= 2 (usage: python3 -m bench.probes.alt_probe "
              "[stages...] | --compile)", file=sys.stderr)
        return 2
    for st in [int(a) for a in args] or [4]:
        run(stages=st)
    return 0


if __name__ == "__main__":
    sys.exit(main())
