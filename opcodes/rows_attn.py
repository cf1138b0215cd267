"""ATTN_R: the attention of a tile of rows for one KV head's query group (opcodes/rows.py).

    a[row, h] = softmax(q[h] . K[slot, g, 0..pos]^T / sqrt(hd)) . V[slot, g, 0..pos]   for the heads h of group g

Row ``row`` is token ``tok[row]`` of slot ``slot[row]`` at ``pos[row]``: it attends to that slot's keys
``[0, pos[row]]``, its own included. It waits for every Q tile of the group and every K/V tile of KV head
``g`` (``q[l,g]``, ``kv[l,g]``): all the step's rows' K/V are in the cache before any row attends, so a
prefill chunk's rows see each other's keys (causally: each stops at its own position), as the oracle
``opcodes.reference.layer_ref_rows``. A row ``>= R`` stores zeros; a prefill tile with no live row stores
them without reading the cache. A tile is ``ATTN_RT`` rows
(``RowsLayout.attn_rt``: 1 in the decode buckets, where rows are different slots; ``Tiling.attn_pairs`` / GP
in the prefill buckets, 128 / GP from 256 rows). One row: ``ATTN_PARTIAL``'s loop (GQA: the group's heads are
tl.dot's M rows, ``GROUP_PAD``) over ``2 * (pos + 1) * hd * 2`` bytes of K/V. A tile of one slot's rows (a prefill chunk):
its (row, head) pairs are M, each K/V block loaded once for all of them, masked per row (causal); a
tile of several slots' rows runs them one at a time.
Output: bf16 ``attn_r[layer, row, q_dim]`` (the O projection's operand, rounded as the oracle rounds it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_partial import AttnPartial, softmax_step
from .base import Cost, Layout, Region, Timing, register
from .common import T_KC, T_VC, mma, tab_offset, to_bf16
from .rows import RowsInstruction, blk, bregion, bview, read_rows


@triton.jit
def _row_slot(rows_ptr, r):
    """Row r's slot, 0 for a row >= R (its tile stores zeros)."""
    return tl.load(rows_ptr + 4 + 4 * r, mask=r < tl.load(rows_ptr), other=0)


@triton.jit
def _rows_block(kbase, vbase, kb, qs, pos, maxp, m_i, l_i, acc, HD: tl.constexpr, ATTN_BLOCK: tl.constexpr,
                MASK: tl.constexpr, INTERP: tl.constexpr):
    """One block of keys [kb, kb + ATTN_BLOCK) into the running softmax (m_i, l_i, acc) of the M rows.
    MASK: keys past ``maxp`` are not loaded and each M row's keys past its own ``pos`` score -inf; without it
    every key of the block is below every row's position (a prefill tile's blocks under the chunk)."""
    keys = kb + tl.arange(0, ATTN_BLOCK)
    dcol = tl.arange(0, HD)
    if MASK:
        kin = keys <= maxp
        k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], mask=kin[:, None], other=0.0, cache_modifier=".cg")
        v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], mask=kin[:, None], other=0.0, cache_modifier=".cg")
    else:
        k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], cache_modifier=".cg")
        v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], cache_modifier=".cg")
    sc = mma(qs, tl.trans(k), INTERP)
    if MASK:    # key 0 is every row's, so each M row's running max is finite after the first block
        sc = tl.where(keys[None, :] <= pos[:, None], sc, float("-inf"))
    return softmax_step(sc, v, m_i, l_i, acc, INTERP)


@triton.jit
def _attn_tile(layer, g, r0, slot, rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
               NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
               MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr,
               ROWS: tl.constexpr, NT: tl.constexpr, ATTN_RT: tl.constexpr, INTERP: tl.constexpr):
    """Rows [r0, r0 + ATTN_RT) of one slot (one row, or a prefill chunk's): tl.dot's M rows are (row, head)
    pairs, ATTN_RT x GP (one row: GP = GROUP_PAD, its heads padded to 16); each K/V block is loaded once for
    all of them, each M row masked to its row's keys [0, pos] (causal within a chunk). Rows >= R store zeros."""
    M: tl.constexpr = ATTN_RT * GP
    mi = tl.arange(0, M)
    ri = r0 + mi // GP
    hi = mi % GP
    dcol = tl.arange(0, HD)
    R = tl.load(rows_ptr)
    valid = (hi < GROUP) & (ri < R)
    pos = tl.load(rows_ptr + 5 + 4 * ri, mask=valid, other=0)
    maxp = tl.max(pos, axis=0)
    qrow = g * GROUP + hi
    q = tl.load(q_r_ptr + layer * (NQ * HD * ROWS) + (qrow[:, None] * HD + dcol[None, :]) * NT
                + blk(ri, NQ * HD, NT, ROWS)[:, None],
                mask=valid[:, None], other=0.0, cache_modifier=".cg")
    qs = to_bf16(q * QSCALE, INTERP)
    base = slot.to(tl.int64) * (NKV * MAX_SEQ * HD) + g * (MAX_SEQ * HD)
    kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + base
    vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + base
    m_i = tl.full([M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([M], dtype=tl.float32)
    acc = tl.zeros([M, HD], dtype=tl.float32)
    k_lo = 0
    if ATTN_RT > 1:     # a prefill tile: the blocks below every live row's position need no mask
        minp = tl.min(tl.where(valid, pos, maxp), axis=0)
        k_lo = (minp + 1) // ATTN_BLOCK * ATTN_BLOCK
        for kb in tl.range(0, k_lo, ATTN_BLOCK, num_stages=ATTN_STAGES):
            m_i, l_i, acc = _rows_block(kbase, vbase, kb, qs, pos, maxp, m_i, l_i, acc, HD, ATTN_BLOCK, False, INTERP)
    # a prefill tile's masked blocks are the last one or two (its rows' positions span ATTN_RT): not pipelined
    MASKED_STAGES: tl.constexpr = ATTN_STAGES if ATTN_RT == 1 else 1
    for kb in tl.range(k_lo, maxp + 1, ATTN_BLOCK, num_stages=MASKED_STAGES):
        m_i, l_i, acc = _rows_block(kbase, vbase, kb, qs, pos, maxp, m_i, l_i, acc, HD, ATTN_BLOCK, True, INTERP)
    o = tl.where(valid[:, None], acc / l_i[:, None], 0.0)
    out = attn_r_ptr + layer * (ROWS * NQ * HD) + ri[:, None] * (NQ * HD) + qrow[:, None] * HD + dcol[None, :]
    tl.store(out, to_bf16(o, INTERP), mask=((hi < GROUP) & (ri < ROWS))[:, None])


@triton.jit
def _attn_row_kg(layer, g, r, slot, rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
                 NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GP: tl.constexpr,
                 MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr,
                 ROWS: tl.constexpr, NT: tl.constexpr, KG: tl.constexpr, INTERP: tl.constexpr):
    """Row r's heads of group g (a decode bucket's tile, ``Tiling.attn_kg`` = KG > 1): each block of ATTN_BLOCK
    keys is KG groups of KB keys, each group with its own running softmax (m, l, acc: [KG, GP, ...]); the dots
    are batched over the groups (Triton puts the warps on them: a group's max and sum stay inside its warp,
    where one [GP, ATTN_BLOCK] dot spreads a row's keys over the warps and reduces across them through shared
    memory every block). The groups merge once after the loop. A row >= R stores zeros."""
    KB: tl.constexpr = ATTN_BLOCK // KG
    hi = tl.arange(0, GP)
    dcol = tl.arange(0, HD)
    live = r < tl.load(rows_ptr)
    valid = (hi < GROUP) & live
    pos = tl.load(rows_ptr + 5 + 4 * r, mask=live, other=0)
    qrow = g * GROUP + hi
    q = tl.load(q_r_ptr + layer * (NQ * HD * ROWS) + (qrow[:, None] * HD + dcol[None, :]) * NT
                + blk(r, NQ * HD, NT, ROWS), mask=valid[:, None], other=0.0, cache_modifier=".cg")
    qs = tl.broadcast_to(to_bf16(q * QSCALE, INTERP)[None, :, :], (KG, GP, HD))
    base = slot.to(tl.int64) * (NKV * MAX_SEQ * HD) + g * (MAX_SEQ * HD)
    kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + base
    vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + base
    gk = tl.arange(0, KG)[:, None] * KB + tl.arange(0, KB)[None, :]          # [KG, KB]: a block's keys by group
    d3 = dcol[None, None, :]
    m_i = tl.full([KG, GP], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([KG, GP], dtype=tl.float32)
    acc = tl.zeros([KG, GP, HD], dtype=tl.float32)
    for kb in tl.range(0, pos + 1, ATTN_BLOCK, num_stages=ATTN_STAGES):
        keys = kb + gk
        kin = (keys <= pos)[:, :, None]
        k = tl.load(kbase + keys[:, :, None] * HD + d3, mask=kin, other=0.0, cache_modifier=".cg")
        v = tl.load(vbase + keys[:, :, None] * HD + d3, mask=kin, other=0.0, cache_modifier=".cg")
        sc = mma(qs, tl.trans(k, 0, 2, 1), INTERP)                            # [KG, GP, KB]
        sc = tl.where((keys <= pos)[:, None, :], sc, float("-inf"))
        m_i, l_i, acc = softmax_step(sc, v, m_i, l_i, acc, INTERP, AX=2, EMPTY=True)
    # key 0 is group 0's: every row's merged max is finite
    m = tl.max(m_i, axis=0)
    w = tl.exp2(m_i - m[None, :])
    o = tl.sum(acc * w[:, :, None], axis=0) / tl.sum(l_i * w, axis=0)[:, None]
    o = tl.where(valid[:, None], o, 0.0)
    out = attn_r_ptr + layer * (ROWS * NQ * HD) + r * (NQ * HD) + qrow[:, None] * HD + dcol[None, :]
    tl.store(out, to_bf16(o, INTERP), mask=((hi < GROUP) & (r < ROWS))[:, None])


@triton.jit
def _attn_zeros(layer, g, r0, attn_r_ptr, NQ: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr,
                GP: tl.constexpr, ROWS: tl.constexpr, ATTN_RT: tl.constexpr, INTERP: tl.constexpr):
    """Rows [r0, r0 + ATTN_RT), none of them live (every row >= R): their heads of group g are zeros (the
    padding columns the O projection reads stay zero), and no K/V is read."""
    M: tl.constexpr = ATTN_RT * GP
    mi = tl.arange(0, M)
    ri = r0 + mi // GP
    qrow = g * GROUP + mi % GP
    dcol = tl.arange(0, HD)
    out = attn_r_ptr + layer * (ROWS * NQ * HD) + ri[:, None] * (NQ * HD) + qrow[:, None] * HD + dcol[None, :]
    tl.store(out, to_bf16(tl.zeros([M, HD], dtype=tl.float32), INTERP),
             mask=((mi % GP < GROUP) & (ri < ROWS))[:, None])


@triton.jit
def attn_r_device(layer, g, t, rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
                  NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, GP: tl.constexpr, MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr,
                  ATTN_BLOCK: tl.constexpr, ATTN_STAGES: tl.constexpr, ROWS: tl.constexpr, NT: tl.constexpr,
                  ATTN_RT: tl.constexpr, ATTN_KG: tl.constexpr, INTERP: tl.constexpr):
    if ATTN_RT == 1:    # a decode bucket: a row >= R runs over slot 0's position 0 masked and stores zeros (v158's
        # early return for it cost +3.7% a 16-row step at B=1 and +2.3% at B=16, rows all live: bench/notes/s42.md)
        if ATTN_KG > 1:
            _attn_row_kg(layer, g, t, _row_slot(rows_ptr, t), rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
                         NQ, NKV, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, ATTN_BLOCK, ATTN_STAGES, ROWS, NT, ATTN_KG,
                         INTERP)
        else:
            _attn_tile(layer, g, t, _row_slot(rows_ptr, t), rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
                       NQ, NKV, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, ATTN_BLOCK, ATTN_STAGES, ROWS, NT, 1, INTERP)
    elif t * ATTN_RT >= tl.load(rows_ptr):     # no live row (a chunk shorter than the bucket): zeros, no cache read
        _attn_zeros(layer, g, t * ATTN_RT, attn_r_ptr, NQ, HD, GROUP, GP, ROWS, ATTN_RT, INTERP)
    else:
        r0 = t * ATTN_RT
        rt = r0 + tl.arange(0, ATTN_RT)
        R = tl.load(rows_ptr)
        live = rt < R
        sl = tl.load(rows_ptr + 4 + 4 * rt, mask=live, other=0)
        s_lo = tl.min(tl.where(live, sl, 2147483647), axis=0)
        s_hi = tl.max(tl.where(live, sl, -1), axis=0)
        if s_lo >= s_hi:         # one slot (a prefill chunk's rows)
            _attn_tile(layer, g, r0, s_lo, rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr,
                       attn_r_ptr, NQ, NKV, HD, GROUP, GP, MAX_SEQ, QSCALE, ATTN_BLOCK, ATTN_STAGES, ROWS, NT, ATTN_RT,
                       INTERP)
        else:                    # rows of several slots: one at a time
            for i in range(ATTN_RT):
                _attn_tile(layer, g, r0 + i, _row_slot(rows_ptr, r0 + i), rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr,
                           attn_r_ptr, NQ, NKV, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, ATTN_BLOCK, ATTN_STAGES, ROWS,
                           NT, 1, INTERP)

@register
@dataclass(frozen=True)
class AttnR(RowsInstruction):
    layer: int
    g: int        # KV head
    t: int        # row tile: rows [t * ATTN_RT, (t + 1) * ATTN_RT) of the step (rows >= R store zeros)

    NAME = "attn_r"
    STAGE = 1
    ARGS = ("rows_ptr", "wtab_ptr", "kc_ptr", "vc_ptr", "q_r_ptr", "attn_r_ptr",
            "NQ", "NKV", "HD", "GROUP", "GROUP_PAD", "GP", "MAX_SEQ", "QSCALE", "ATTN_BLOCK", "ATTN_STAGES", "ROWS",
            "NT", "ATTN_RT", "ATTN_KG", "INTERP")
    CONSTEXPRS = {**{k: AttnPartial.CONSTEXPRS[k] for k in ("GROUP", "GROUP_PAD", "QSCALE", "ATTN_BLOCK", "ATTN_STAGES")},
                  "GP": lambda lay: triton.next_power_of_2(lay.cfg.group),       # a row's heads in a tile's M
                  "ATTN_RT": lambda lay: lay.attn_rt if AttnR.applies(lay) else 1,
                  "ATTN_KG": lambda lay: lay.tiling.attn_kg}
    SCRATCH = {"attn_r": "bf16"}
    TIMING = Timing.LATENCY
    TORCH_RTOL = 1e-2         # the tensor-core dots take bf16 q and p; run_torch keeps them fp32
    device = attn_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c = lay.cfg
        return {"attn_r": (c.layers, lay.rows, c.q_dim)}

    def latency_time(self, lay: Layout) -> float:
        from .attn_partial import attention_latency
        return attention_latency(lay, lay.max_seq // 2)

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if not 0 <= self.g < c.n_kv:
            bad.append(f"g {self.g} not in [0, {c.n_kv})")
        if not 0 <= self.t < lay.rows // lay.attn_rt:
            bad.append(f"t {self.t} not in [0, {lay.rows // lay.attn_rt})")
        return bad

    def _rows(self, lay: Layout) -> range:
        return range(self.t * lay.attn_rt, (self.t + 1) * lay.attn_rt)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        h0 = self.g * c.group * c.hd
        n0 = (self.t * lay.attn_rt) // lay.n_tile * lay.n_tile          # the block of the tile's rows
        out = [bregion("q_r", lay, c.q_dim, self.layer, h0, h0 + c.group * c.hd, n0)]
        for b in range(lay.n_blocks):                                   # every row's K/V: every block's tiles
            kb = (self.layer * lay.n_blocks + b) * c.kv_dim + self.g * c.hd
            out += [Region("kv_new_k_r", kb, kb + c.hd), Region("kv_new_v_r", kb, kb + c.hd)]
        return out

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        out = []
        for r in self._rows(lay):
            b = (self.layer * lay.rows + r) * c.q_dim + self.g * c.group * c.hd
            out.append(Region("attn_r", b, b + c.group * c.hd))
        return out

    def cost(self, lay: Layout) -> Cost:
        c = lay.cfg
        keys = lay.max_seq // 2
        return Cost(hbm_bytes=2 * keys * c.hd * 2, l2_bytes=4 * c.group * c.hd * 2 * lay.attn_rt,
                    flops=4 * c.group * keys * c.hd * lay.attn_rt)

    def run_torch(self, lay: Layout, st) -> None:
        c, NR = lay.cfg, lay.rows
        R, slots, pos, _ = read_rows(st)
        a = st.buf["attn_r"].view(c.layers, NR, c.n_q, c.hd)
        heads = slice(self.g * c.group, (self.g + 1) * c.group)
        for row in self._rows(lay):
            if row >= R:
                a[self.layer, row, heads] = 0
                continue
            s, p = slots[row], pos[row]
            q = bview(st.buf["q_r"], lay, c.q_dim, c.layers)[self.layer, row // lay.n_tile].view(
                c.n_q, c.hd, lay.n_tile)[heads, :, row % lay.n_tile]                    # [group, hd]
            K = st.kv[self.layer][0][s, self.g, :p + 1].float()
            V = st.kv[self.layer][1][s, self.g, :p + 1].float()
            sc = (q @ K.T) / math.sqrt(c.hd)
            a[self.layer, row, heads] = (torch.softmax(sc, dim=-1) @ V).to(torch.bfloat16)
