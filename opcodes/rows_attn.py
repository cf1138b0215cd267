"""ATTN_R: one row's attention for one KV head's query group (opcodes/rows.py).

    a[row, h] = softmax(q[h] . K[slot, g, 0..pos]^T / sqrt(hd)) . V[slot, g, 0..pos]   for the heads h of group g

Row ``row`` is token ``tok[row]`` of slot ``slot[row]`` at ``pos[row]``: it attends to that slot's keys
``[0, pos[row]]``, its own included. It waits for every Q tile of the group and every K/V tile of KV head
``g`` (``q[l,g]``, ``kv[l,g]``): all the step's rows' K/V are in the cache before any row attends, so a
prefill chunk's rows see each other's keys (causally: each stops at its own position), as the oracle
``opcodes.reference.layer_ref_rows``. A row ``>= R`` stores zeros. The loop is ``ATTN_PARTIAL``'s
(GQA: the group's heads are tl.dot's M rows, ``GROUP_PAD``), over ``2 * (pos + 1) * hd * 2`` bytes of K/V.
Output: bf16 ``attn_r[layer, row, q_dim]`` (the O projection's operand, rounded as the oracle rounds it).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_partial import AttnPartial, _attn_block
from .base import Cost, Instruction, Layout, Region, Timing, register
from .common import T_KC, T_VC, tab_offset, to_bf16
from .rows import RowsLayout, read_rows


@triton.jit
def attn_r_device(layer, g, row, rows_ptr, wtab_ptr, kc_ptr, vc_ptr, q_r_ptr, attn_r_ptr,
                  NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr,
                  ATTN_STAGES: tl.constexpr, ROWS: tl.constexpr, INTERP: tl.constexpr):
    hq = tl.arange(0, GROUP_PAD)
    hm = hq < GROUP
    dcol = tl.arange(0, HD)
    qrow = g * GROUP + hq
    out = attn_r_ptr + layer * (ROWS * NQ * HD) + row * (NQ * HD) + qrow[:, None] * HD + dcol[None, :]
    R = tl.load(rows_ptr)
    if row >= R:
        tl.store(out, tl.zeros([GROUP_PAD, HD], dtype=tl.bfloat16), mask=hm[:, None])
    else:
        slot = tl.load(rows_ptr + 4 + 4 * row)
        pos = tl.load(rows_ptr + 5 + 4 * row)
        base = slot.to(tl.int64) * (NKV * MAX_SEQ * HD) + g * (MAX_SEQ * HD)
        kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + base
        vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + base
        q = tl.load(q_r_ptr + layer * (NQ * HD * ROWS) + (qrow[:, None] * HD + dcol[None, :]) * ROWS + row,
                    mask=hm[:, None], other=0.0, cache_modifier=".cg")
        qs = to_bf16(q * QSCALE, INTERP)                          # scores come out in base 2
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HD], dtype=tl.float32)
        for kb in tl.range(0, pos + 1, ATTN_BLOCK, num_stages=ATTN_STAGES):
            keys = kb + tl.arange(0, ATTN_BLOCK)
            km = keys <= pos
            k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
            v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
            m_i, l_i, acc = _attn_block(qs, k, v, km, m_i, l_i, acc, INTERP)
        tl.store(out, to_bf16(acc / l_i[:, None], INTERP), mask=hm[:, None])


@register
@dataclass(frozen=True)
class AttnR(Instruction):
    layer: int
    g: int        # KV head
    row: int      # the row of the step (< ROWS; rows >= R store zeros)

    NAME = "attn_r"
    STAGE = 1
    ARGS = ("rows_ptr", "wtab_ptr", "kc_ptr", "vc_ptr", "q_r_ptr", "attn_r_ptr",
            "NQ", "NKV", "HD", "GROUP", "GROUP_PAD", "MAX_SEQ", "QSCALE", "ATTN_BLOCK", "ATTN_STAGES", "ROWS", "INTERP")
    CONSTEXPRS = {k: AttnPartial.CONSTEXPRS[k] for k in ("GROUP", "GROUP_PAD", "QSCALE", "ATTN_BLOCK", "ATTN_STAGES")}
    SCRATCH = {"attn_r": "bf16"}
    TIMING = Timing.LATENCY
    TORCH_RTOL = 1e-2         # the tensor-core dots take bf16 q and p; run_torch keeps them fp32
    WHOLE_MODEL = True
    IN_EVERY_KERNEL = False
    ROWS_OPCODE = True
    device = attn_r_device

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return isinstance(lay, RowsLayout)

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
        if not 0 <= self.row < lay.rows:
            bad.append(f"row {self.row} not in [0, {lay.rows})")
        return bad

    def reads(self, lay: Layout) -> list[Region]:
        c, R = lay.cfg, lay.rows
        qb = (self.layer * c.q_dim + self.g * c.group * c.hd) * R
        kb = self.layer * c.kv_dim + self.g * c.hd
        return [Region("q_r", qb, qb + c.group * c.hd * R),
                Region("kv_new_k_r", kb, kb + c.hd), Region("kv_new_v_r", kb, kb + c.hd)]

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        b = (self.layer * lay.rows + self.row) * c.q_dim + self.g * c.group * c.hd
        return [Region("attn_r", b, b + c.group * c.hd)]

    def cost(self, lay: Layout) -> Cost:
        c = lay.cfg
        keys = lay.max_seq // 2
        return Cost(hbm_bytes=2 * keys * c.hd * 2, l2_bytes=4 * c.group * c.hd * 2,
                    flops=4 * c.group * keys * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c, NR = lay.cfg, lay.rows
        R, slots, pos, _ = read_rows(st)
        a = st.buf["attn_r"].view(c.layers, NR, c.n_q, c.hd)
        heads = slice(self.g * c.group, (self.g + 1) * c.group)
        if self.row >= R:
            a[self.layer, self.row, heads] = 0
            return
        s, p = slots[self.row], pos[self.row]
        q = st.buf["q_r"].view(c.layers, c.n_q, c.hd, NR)[self.layer, heads, :, self.row]   # [group, hd]
        K = st.kv[self.layer][0][s, self.g, :p + 1].float()
        V = st.kv[self.layer][1][s, self.g, :p + 1].float()
        sc = (q @ K.T) / math.sqrt(c.hd)
        a[self.layer, self.row, heads] = (torch.softmax(sc, dim=-1) @ V).to(torch.bfloat16)
