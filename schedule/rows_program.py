"""Lowering of an R-row whole-model step (issue 50; ``opcodes.rows``): chunked prefill and batched decode.

    EMBED_R(col0) x n_emb --embed--> QKV_R(0, *)
    per layer l:
      QKV_R(l, q heads of group g) --q[l,g]--> ATTN_R(l, g, tile) x ROWS / ATTN_RT   (+ kv[l,g])
      QKV_R(l, k/v head g) --kv[l,g]--> ATTN_R(l, g, *)                    (every row's K/V first)
      ATTN_R(l, *, *) --attn[l]--> OPROJ_R(l, *) --x1[l]--> GATE_UP_R(l, *)
      GATE_UP_R(l, rows in K chunk kc) --act[l,kc]--> DOWN_R(l, *, kc)
      DOWN_R(l, rows in block rb, *) --dpart[l,rb]--> RESIDUAL_R(l, rb) --out[l]--> QKV_R(l+1, *)
      (or, where one down tile spans the ffn and a residual block: DOWN_RES_R(l, *) --out[l]--> QKV_R(l+1, *))
    RESIDUAL_R(L-1, *) --out[L-1]--> LM_HEAD_R(v0) x n_lm                    (logits_r, block by block)

Every instruction but ATTN_R is one per column block too (``n0``, ``RowsLayout.col_blocks``: one block up to
256 rows), the blocks of the same weight rows adjacent (their weights streamed once, the rest from the L2).
The tape depends on the bucket ``ROWS`` only; the step's actual rows are device data (``rows``).
"""
from __future__ import annotations

from opcodes import (AttnR, DownR, DownResR, EmbedR, GateUpR, Layout, LMHeadR, OProjR, QKVR, ResidualR, RowsLayout,
                     cdiv)
from opcodes.base import NO_COUNTER

from .program import Program, check_layout


def lower_rows(lay: Layout, rows: int = 16, batch: int = 1, lm_rows: int = 0) -> Program:
    """The program of one R-row step (R <= ``rows``) over a cache of ``batch`` slots, for ``lay``'s config,
    tiling (``opcodes.rows.rows_tiling``) and cache length. ``lm_rows``: the LM head tiles' vocabulary rows
    (0: ``RowsLayout.of``'s; a probe's variants set it)."""
    rl = lay if isinstance(lay, RowsLayout) and lay.rows == rows and lay.batch == batch and \
        lm_rows in (0, lay.lm_rows) else RowsLayout.of(lay, rows=rows, batch=batch, lm_rows=lm_rows)
    check_layout(rl)
    c, t = rl.cfg, rl.tiling
    p = Program(rl)
    nb = rl.col_blocks()
    ce = p.counter("embed")
    for c0 in range(0, c.d, rl.emb_cols):
        for n0 in nb:
            p.add(EmbedR(c0, n0), (), ce)
    prev = ce
    n_rb = cdiv(c.d, t.red_rows)
    for l in range(c.layers):
        cq = [p.counter(f"q[{l},{g}]") for g in range(c.n_kv)]
        ckv = [p.counter(f"kv[{l},{g}]") for g in range(c.n_kv)]
        ca = p.counter(f"attn[{l}]")
        cx = p.counter(f"x1[{l}]")
        cact = [p.counter(f"act[{l},{kc}]") for kc in range(rl.n_down_k)]
        last = rl.n_down_k - 1
        cd = [p.counter(f"dpart[{l},{rb}]") for rb in range(n_rb)]
        cout = p.counter(f"out[{l}]")
        for g in range(c.n_kv):
            for h in range(g * c.group, (g + 1) * c.group):
                for j in range(rl.n_tiles_per_head(0)):
                    for n0 in nb:
                        p.add(QKVR(l, 0, h, j, n0), (prev,), cq[g])
        for g in range(c.n_kv):
            for sec in (1, 2):
                for j in range(rl.n_tiles_per_head(sec)):
                    for n0 in nb:
                        p.add(QKVR(l, sec, g, j, n0), (prev,), ckv[g])
        for t_ in range(rows // rl.attn_rt):
            for g in range(c.n_kv):
                p.add(AttnR(l, g, t_), (cq[g], ckv[g]), ca)
        for r0 in range(0, c.d, t.o_rows):
            for n0 in nb:
                p.add(OProjR(r0, l, n0), (ca,), cx)
        for r0 in range(0, c.ffn, t.gu_rows):
            for n0 in nb:
                p.add(GateUpR(r0, l, n0), (cx,), cact[r0 // t.down_k])
        for kc in range(rl.n_down_k):
            for r0 in range(0, c.d, t.down_rows):
                for n0 in nb:
                    if t.down_res and kc == last:     # waits for the other chunks' partials of its rows too
                        p.add(DownResR(r0, l, n0), (cact[kc], cd[r0 // t.red_rows]), cout)
                    else:
                        p.add(DownR(r0, l, kc, n0), (cact[kc],), cd[r0 // t.red_rows])
        if not t.down_res:
            for rb in range(n_rb):
                for n0 in nb:
                    p.add(ResidualR(rb * t.red_rows, l, n0), (cd[rb],), cout)
        prev = cout
    # block-major: a prompt's last row asks one column block for logits (``opcodes.rows_lm_head``), and the
    # schedule deals a block's tiles to every SM this way (v0-major put block b on the SMs = block mod n_blocks alone).
    # The cost: a step asking every row's logits in a bucket of several blocks (more than 256 rows, all decode)
    # streams the LM head's weights once a block, not once and the other blocks from the L2
    for n0 in nb:
        for v0 in range(0, c.vocab, rl.lm_rows):
            p.add(LMHeadR(v0, n0), (prev,), NO_COUNTER)
    return p


def rows_lowering(rows: int, batch: int, lm_rows: int = 0):
    """``lower_rows`` as a ``lowering=`` option (``interp.runtime.build_layer``)."""
    def lowering(lay: Layout) -> Program:
        return lower_rows(lay, rows=rows, batch=batch, lm_rows=lm_rows)
    lowering.__name__ = f"lower_rows_{rows}x{batch}" + (f"_lm{lm_rows}" if lm_rows else "")
    return lowering
