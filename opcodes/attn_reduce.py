"""ATTN_REDUCE: merge the ``NS - 1`` prefix partials of one query head with the key at ``pos``.

    s* = q . k_pos (base 2);  M = max(s*, max_s m_s);  w_s = 2^(m_s - M);  w* = 2^(s* - M)
    a = (sum_s w_s acc_s + w* v_pos) / (sum_s w_s l_s + w*)

The key at ``pos`` is the one this call's K/V tiles write into the cache; folding it in here
(one 128-wide dot product) instead of in a one-key ATTN_PARTIAL takes an instruction hop off the
critical path QKV -> attention -> O (H200: the K/V tiles are the last QKV tiles to finish).
Writes the attention output of the head (fp32) that the O projection reads. One instruction per
query head, all loads issued at once (per KV group, 8 dependent merges took 24 us on the H200).
Reads ``(NS - 1) * (hd + 2) * 4`` bytes of partials and the key/value row at ``pos`` from L2.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, register
from .common import T_KC, T_VC, tab_offset, to_bf16


@triton.jit
def attn_reduce_device(layer, h, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, part_o_ptr, part_ml_ptr, attn_ptr,
                       NQ: tl.constexpr, HD: tl.constexpr, G: tl.constexpr, MAXS: tl.constexpr,
                       QSCALE: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, INTERP: tl.constexpr):
    sp = tl.arange(0, NSP)
    sm = sp < NS - 1
    dcol = tl.arange(0, HD)
    prow = (layer * NQ + h) * (NS - 1) + sp
    m = tl.load(part_ml_ptr + prow * 2, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + prow * 2 + 1, mask=sm, other=0.0, cache_modifier=".cg")
    o = tl.load(part_o_ptr + prow[:, None] * HD + dcol[None, :], mask=sm[:, None], other=0.0,
                cache_modifier=".cg")
    # the key at pos, written into the cache by this call's K/V tiles (other SMs: .cg)
    g = h // G
    kv_row = g * (MAXS * HD) + pos * HD + dcol
    kp = tl.load(kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + kv_row, cache_modifier=".cg").to(tl.float32)
    vp = tl.load(vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + kv_row, cache_modifier=".cg").to(tl.float32)
    q = tl.load(q_ptr + layer * (NQ * HD) + h * HD + dcol, cache_modifier=".cg")
    qs = to_bf16(q * QSCALE, INTERP).to(tl.float32)          # as ATTN_PARTIAL rounds it for tl.dot
    s_pos = tl.sum(qs * kp, axis=0)                         # base-2 score of the key at pos
    mx = tl.maximum(tl.max(m, axis=0), s_pos)
    w = tl.where(sm, tl.exp2(m - mx), 0.0)
    w_pos = tl.exp2(s_pos - mx)
    denom = tl.sum(w * l, axis=0) + w_pos
    out = (tl.sum(o * w[:, None], axis=0) + w_pos * vp) / denom
    tl.store(attn_ptr + layer * (NQ * HD) + h * HD + dcol, out)


@register
@dataclass(frozen=True)
class AttnReduce(Instruction):
    layer: int
    h: int        # query head

    NAME = "attn_reduce"
    STAGE = 2
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "part_o_ptr", "part_ml_ptr", "attn_ptr",
            "NQ", "HD", "G", "MAXS", "QSCALE", "NS", "NSP", "INTERP")
    device = attn_reduce_device

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if not 0 <= self.h < c.n_q:
            bad.append(f"h {self.h} not in [0, {c.n_q})")
        return bad

    def reads(self, lay: Layout) -> list[Region]:
        c, ns = lay.cfg, lay.tiling.attn_splits - 1
        r0 = (self.layer * c.n_q + self.h) * ns
        r1 = r0 + ns
        q0 = self.layer * c.q_dim + self.h * c.hd
        kv0 = self.layer * c.kv_dim + (self.h // c.group) * c.hd
        return [Region("part_o", r0 * c.hd, r1 * c.hd), Region("part_ml", r0 * 2, r1 * 2),
                Region("q", q0, q0 + c.hd),
                Region("kv_new_k", kv0, kv0 + c.hd), Region("kv_new_v", kv0, kv0 + c.hd)]

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        a0 = self.layer * c.q_dim + self.h * c.hd
        return [Region("attn", a0, a0 + c.hd)]

    def cost(self, lay: Layout) -> Cost:
        c, ns = lay.cfg, lay.tiling.attn_splits - 1
        # the K/V row at pos is counted once per group (first head), as the cache bytes it is
        kv = 2 * 2 * c.hd if self.h % c.group == 0 else 0
        return Cost(hbm_bytes=kv, l2_bytes=4 * (ns * (c.hd + 2) + 2 * c.hd) + 2 * 2 * c.hd - kv,
                    flops=3 * ns * c.hd + 4 * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c, ns = lay.cfg, lay.tiling.attn_splits - 1
        hs = slice(self.h, self.h + 1)
        po = st.buf["part_o"].view(c.layers, c.n_q, ns, c.hd)[self.layer, hs]       # [1, NS-1, hd]
        pml = st.buf["part_ml"].view(c.layers, c.n_q, ns, 2)[self.layer, hs]
        g = self.h // c.group
        kp = st.kv[self.layer][0][0, g, st.pos].float()
        vp = st.kv[self.layer][1][0, g, st.pos].float()
        q = st.buf["q"].view(c.layers, c.n_q, c.hd)[self.layer, self.h]
        qs = (q * (1.4426950408889634 / math.sqrt(c.hd))).to(torch.bfloat16).float()
        s_pos = (qs * kp).sum()
        m, l = pml[..., 0], pml[..., 1]
        mx = torch.maximum(m.max(dim=1, keepdim=True).values, s_pos)
        w = torch.exp2(m - mx)
        w_pos = torch.exp2(s_pos - mx)                                              # [1, 1]
        out = ((po * w[..., None]).sum(dim=1) + w_pos * vp) / ((w * l).sum(dim=1, keepdim=True) + w_pos)
        st.buf["attn"].view(c.layers, c.n_q, c.hd)[self.layer, hs] = out
