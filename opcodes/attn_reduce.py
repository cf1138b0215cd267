"""ATTN_REDUCE: merge the ``SPLITS`` attention partials of one query head.

    M = max_s m_s;  w_s = 2^(m_s - M);  a = sum_s w_s acc_s / sum_s w_s l_s

Writes the attention output of the head (fp32) that the O projection reads. One instruction per
query head, all loads issued at once: the merge sits on the critical path between attention and
the O projection (per KV group, 8 dependent merges took 24 us on the H200).
Reads ``SPLITS * (hd + 2) * 4`` bytes of partials from L2.

With ``Tiling.key_in_reduce`` the key at ``pos`` is not a split: the merge attends to it itself
(``s = bf16(q * scale) . k``, weight ``2^(s - M)``, value ``v``: what the one-key split computes) over
the ``SPLITS - 1`` prefix splits, so it waits on the K/V tiles of its head instead of a split after them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_partial import AttnPartial
from .base import Cost, Instruction, Layout, Region, Timing, register
from .common import T_KC, T_VC, tab_offset, to_bf16


@triton.jit
def attn_reduce_device(layer, h, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, part_o_ptr, part_ml_ptr, attn_ptr,
                       NQ: tl.constexpr, HD: tl.constexpr, PART_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
                       GROUP: tl.constexpr, MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr,
                       KEY_IN_REDUCE: tl.constexpr, INTERP: tl.constexpr):
    sp = tl.arange(0, SPLITS_PAD)
    sm = sp < PART_SPLITS
    dcol = tl.arange(0, HD)
    prow = (layer * NQ + h) * PART_SPLITS + sp
    m = tl.load(part_ml_ptr + prow * 2, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + prow * 2 + 1, mask=sm, other=0.0, cache_modifier=".cg")
    o = tl.load(part_o_ptr + prow[:, None] * HD + dcol[None, :], mask=sm[:, None], other=0.0,
                cache_modifier=".cg")
    if KEY_IN_REDUCE:
        # the key at pos, as the one-key split scores it (bf16 q * scale, fp32 sum): p = 1 at its own max
        g = h // GROUP
        q = tl.load(q_ptr + layer * (NQ * HD) + h * HD + dcol, cache_modifier=".cg")
        row = g * (MAX_SEQ * HD) + pos * HD + dcol
        k = tl.load(kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + row, cache_modifier=".cg").to(tl.float32)
        v = tl.load(vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + row, cache_modifier=".cg").to(tl.float32)
        s_new = tl.sum(to_bf16(q * QSCALE, INTERP).to(tl.float32) * k, axis=0)
        mx = tl.maximum(tl.max(m, axis=0), s_new)
        w = tl.where(sm, tl.exp2(m - mx), 0.0)
        w_new = tl.exp2(s_new - mx)
        denom = tl.sum(w * l, axis=0) + w_new
        out = (tl.sum(o * w[:, None], axis=0) + w_new * v) / denom
    else:
        mx = tl.max(m, axis=0)
        w = tl.where(sm, tl.exp2(m - mx), 0.0)
        denom = tl.sum(w * l, axis=0)
        out = tl.sum(o * w[:, None], axis=0) / denom
    tl.store(attn_ptr + layer * (NQ * HD) + h * HD + dcol, out)


@register
@dataclass(frozen=True)
class AttnReduce(Instruction):
    layer: int
    h: int        # query head

    NAME = "attn_reduce"
    STAGE = 2
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "part_o_ptr", "part_ml_ptr", "attn_ptr", "NQ", "HD",
            "PART_SPLITS", "SPLITS_PAD", "GROUP", "MAX_SEQ", "QSCALE", "KEY_IN_REDUCE", "INTERP")
    CONSTEXPRS = {"PART_SPLITS": AttnPartial.CONSTEXPRS["PART_SPLITS"],
                  "SPLITS_PAD": lambda lay: triton.next_power_of_2(lay.attn_instr_splits),
                  "GROUP": AttnPartial.CONSTEXPRS["GROUP"], "QSCALE": AttnPartial.CONSTEXPRS["QSCALE"],
                  "KEY_IN_REDUCE": lambda lay: lay.tiling.key_in_reduce}
    TIMING = Timing.FIXED
    FIXED_S = 2.1e-6          # measured on the H200
    device = attn_reduce_device

    SCRATCH = {"attn": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"attn": (lay.cfg.layers, lay.cfg.q_dim)}

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if not 0 <= self.h < c.n_q:
            bad.append(f"h {self.h} not in [0, {c.n_q})")
        return bad

    def reads(self, lay: Layout) -> list[Region]:
        c, ns = lay.cfg, lay.attn_instr_splits
        r0 = (self.layer * c.n_q + self.h) * ns
        r1 = r0 + ns
        out = [Region("part_o", r0 * c.hd, r1 * c.hd), Region("part_ml", r0 * 2, r1 * 2)]
        if lay.tiling.key_in_reduce:          # the key at pos: this head's q, its KV head's new K/V row
            q0 = self.layer * c.q_dim + self.h * c.hd
            kv0 = self.layer * c.kv_dim + (self.h // c.group) * c.hd
            out += [Region("q", q0, q0 + c.hd), Region("kv_new_k", kv0, kv0 + c.hd),
                    Region("kv_new_v", kv0, kv0 + c.hd)]
        return out

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        a0 = self.layer * c.q_dim + self.h * c.hd
        return [Region("attn", a0, a0 + c.hd)]

    def cost(self, lay: Layout) -> Cost:
        c, ns = lay.cfg, lay.attn_instr_splits
        # with key_in_reduce the key at pos (K and V rows) is read here: counted once per KV group
        key = 2 * 2 * c.hd if lay.tiling.key_in_reduce and self.h % c.group == 0 else 0
        return Cost(hbm_bytes=key, l2_bytes=4 * (ns * (c.hd + 2) + c.hd), flops=3 * ns * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c, ns = lay.cfg, lay.attn_instr_splits
        hs = slice(self.h, self.h + 1)
        po = st.buf["part_o"].view(c.layers, c.n_q, ns, c.hd)[self.layer, hs]       # [1, SPLITS, hd]
        pml = st.buf["part_ml"].view(c.layers, c.n_q, ns, 2)[self.layer, hs]
        m, l = pml[..., 0], pml[..., 1]
        if lay.tiling.key_in_reduce:          # the prefix splits, then the key at pos (as the one-key split)
            g = self.h // c.group
            q = st.buf["q"].view(c.layers, c.n_q, c.hd)[self.layer, self.h]
            k = st.kv[self.layer][0][0, g, st.pos].float()
            v = st.kv[self.layer][1][0, g, st.pos].float()
            s_new = (q * (1.4426950408889634 / math.sqrt(c.hd))) @ k
            po = torch.cat([po, v.view(1, 1, c.hd)], dim=1)
            m = torch.cat([m, s_new.view(1, 1)], dim=1)
            l = torch.cat([l, torch.ones(1, 1)], dim=1)
        mx = m.max(dim=1, keepdim=True).values
        w = torch.exp2(m - mx)
        out = (po * w[..., None]).sum(dim=1) / (w * l).sum(dim=1, keepdim=True)
        st.buf["attn"].view(c.layers, c.n_q, c.hd)[self.layer, hs] = out
