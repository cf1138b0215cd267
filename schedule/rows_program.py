"""Lowering of an R-row whole-model step (issue 50; ``opcodes.rows``): chunked prefill and batched decode.

    EMBED_R(col0) x n_emb --embed--> QKV_R(0, *)
    per layer l:
      QKV_R(l, q heads of group g) --q[l,g]--> ATTN_R(l, g, tile) x ROWS / ATTN_RT   (+ kv[l,g])
      QKV_R(l, k/v head g) --kv[l,g]--> ATTN_R(l, g, *)                    (every row's K/V first)
      ATTN_R(l, *, *) --attn[l]--> OPROJ_R(l, *) --x1[l]--> GATE_UP_R(l, *)
      GATE_UP_R(l, rows in K chunk kc) --act[l,kc]--> DOWN_R(l, *, kc)
      DOWN_R(l, rows in block rb, *) --dpart[l,rb]--> RESIDUAL_R(l, rb) --out[l]--> QKV_R(l+1, *)
    RESIDUAL_R(L-1, *) --out[L-1]--> LM_HEAD_R(v0) x n_lm                    (logits_r, block by block)

Every instruction but ATTN_R is one per column block too (``n0``, ``RowsLayout.col_blocks``: one block up to
256 rows), the blocks of the same weight rows adjacent (their weights streamed once, the rest from the L2).
The tape depends on the bucket ``ROWS`` only; the step's actual rows are device data (``rows``).
With ``Tiling.col_deps`` each counter above is one a column block (``q[l,g]@n0``, ...), the K/V tiles of a
block also waiting for the previous block's (v173, bench/notes/s44.md).
"""
from __future__ import annotations

from opcodes import (AttnR, DownR, EmbedR, GateUpR, Layout, LMHeadR, OProjR, QKVR, ResidualR, RowsLayout, cdiv)
from opcodes.base import NO_COUNTER

from .program import Program, check_layout


def lower_rows(lay: Layout, rows: int = 16, batch: int = 1) -> Program:
    """The program of one R-row step (R <= ``rows``) over a cache of ``batch`` slots, for ``lay``'s config,
    tiling (``opcodes.rows.rows_tiling``) and cache length. With ``Tiling.col_deps`` and several column
    blocks, every counter is one a block (``counters``): block b's tiles wait for block b's producers
    alone, so one block's stage runs while another's ends; the K/V tiles of block b also wait for block
    b - 1's (a chain), so ATTN_R of block b, waiting on block b's, has every earlier block's K/V written (the
    host keeps each slot's rows in position order across blocks: ``interp.rows.block_causal``)."""
    rl = lay if isinstance(lay, RowsLayout) and lay.rows == rows and lay.batch == batch else \
        RowsLayout.of(lay, rows=rows, batch=batch)
    check_layout(rl)
    c, t = rl.cfg, rl.tiling
    p = Program(rl)
    nb = rl.col_blocks()
    per = t.col_deps and len(nb) > 1
    bi = (lambda n0: n0 // rl.n_tile) if per else (lambda n0: 0)

    def counters(name: str) -> list[int]:
        return [p.counter(f"{name}@{n0}" if per else name) for n0 in (nb if per else nb[:1])]

    ce = counters("embed")
    for c0 in range(0, c.d, rl.emb_cols):
        for n0 in nb:
            p.add(EmbedR(c0, n0), (), ce[bi(n0)])
    prev = ce
    n_rb = cdiv(c.d, t.red_rows)
    for l in range(c.layers):
        cq = [counters(f"q[{l},{g}]") for g in range(c.n_kv)]
        ckv = [counters(f"kv[{l},{g}]") for g in range(c.n_kv)]
        ca = counters(f"attn[{l}]")
        cx = counters(f"x1[{l}]")
        cact = [counters(f"act[{l},{kc}]") for kc in range(rl.n_down_k)]
        cd = [counters(f"dpart[{l},{rb}]") for rb in range(n_rb)]
        cout = counters(f"out[{l}]")
        for g in range(c.n_kv):
            for h in range(g * c.group, (g + 1) * c.group):
                for j in range(rl.n_tiles_per_head(0)):
                    for n0 in nb:
                        p.add(QKVR(l, 0, h, j, n0), (prev[bi(n0)],), cq[g][bi(n0)])
        for g in range(c.n_kv):
            for sec in (1, 2):
                for j in range(rl.n_tiles_per_head(sec)):
                    for n0 in nb:
                        b = bi(n0)
                        p.add(QKVR(l, sec, g, j, n0), (prev[b],) + ((ckv[g][b - 1],) if b else ()), ckv[g][b])
        for t_ in range(rows // rl.attn_rt):
            b = bi(t_ * rl.attn_rt)
            for g in range(c.n_kv):
                p.add(AttnR(l, g, t_), (cq[g][b], ckv[g][b]), ca[b])
        for r0 in range(0, c.d, t.o_rows):
            for n0 in nb:
                p.add(OProjR(r0, l, n0), (ca[bi(n0)],), cx[bi(n0)])
        for r0 in range(0, c.ffn, t.gu_rows):
            for n0 in nb:
                p.add(GateUpR(r0, l, n0), (cx[bi(n0)],), cact[r0 // t.down_k][bi(n0)])
        for kc in range(rl.n_down_k):
            for r0 in range(0, c.d, t.down_rows):
                for n0 in nb:
                    p.add(DownR(r0, l, kc, n0), (cact[kc][bi(n0)],), cd[r0 // t.red_rows][bi(n0)])
        for rb in range(n_rb):
            for n0 in nb:
                p.add(ResidualR(rb * t.red_rows, l, n0), (cd[rb][bi(n0)],), cout[bi(n0)])
        prev = cout
    # block-major: a prompt's last row asks one column block for logits (``opcodes.rows_lm_head``), and the
    # schedule deals a block's tiles to every SM this way (v0-major put block b on the SMs = block mod n_blocks alone).
    # The cost: a step asking every row's logits in a bucket of several blocks (more than 256 rows, all decode)
    # streams the LM head's weights once a block, not once and the other blocks from the L2
    for n0 in nb:
        for v0 in range(0, c.vocab, rl.lm_rows):
            p.add(LMHeadR(v0, n0), (prev[bi(n0)],), NO_COUNTER)
    return p


def rows_lowering(rows: int, batch: int):
    """``lower_rows`` as a ``lowering=`` option (``interp.runtime.build_layer``)."""
    def lowering(lay: Layout) -> Program:
        return lower_rows(lay, rows=rows, batch=batch)
    lowering.__name__ = f"lower_rows_{rows}x{batch}"
    return lowering
