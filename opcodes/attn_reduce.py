"""ATTN_REDUCE: merge the ``SPLITS`` attention partials of one query head.

    M = max_s m_s;  w_s = 2^(m_s - M);  a = sum_s w_s acc_s / sum_s w_s l_s

Writes the attention output of the head (fp32) that the O projection reads. One instruction per
query head, all loads issued at once: the merge sits on the critical path between attention and
the O projection (per KV group, 8 dependent merges took 24 us on the H200).
Reads ``SPLITS * (hd + 2) * 4`` bytes of partials from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, register


@triton.jit
def attn_reduce_device(layer, h, part_o_ptr, part_ml_ptr, attn_ptr,
                       NQ: tl.constexpr, HD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    sp = tl.arange(0, SPLITS_PAD)
    sm = sp < SPLITS
    dcol = tl.arange(0, HD)
    prow = (layer * NQ + h) * SPLITS + sp
    m = tl.load(part_ml_ptr + prow * 2, mask=sm, other=float("-inf"), cache_modifier=".cg")
    l = tl.load(part_ml_ptr + prow * 2 + 1, mask=sm, other=0.0, cache_modifier=".cg")
    o = tl.load(part_o_ptr + prow[:, None] * HD + dcol[None, :], mask=sm[:, None], other=0.0,
                cache_modifier=".cg")
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
    ARGS = ("part_o_ptr", "part_ml_ptr", "attn_ptr", "NQ", "HD", "SPLITS", "SPLITS_PAD")
    CONSTEXPRS = {"SPLITS": lambda lay: lay.tiling.attn_splits,
                  "SPLITS_PAD": lambda lay: triton.next_power_of_2(lay.tiling.attn_splits)}
    TIMING = Timing.FIXED
    FIXED_S = 2.1e-6          # measured on the H200 (bench/NOTES.md v7)
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
        c, ns = lay.cfg, lay.tiling.attn_splits
        r0 = (self.layer * c.n_q + self.h) * ns
        r1 = r0 + ns
        return [Region("part_o", r0 * c.hd, r1 * c.hd), Region("part_ml", r0 * 2, r1 * 2)]

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        a0 = self.layer * c.q_dim + self.h * c.hd
        return [Region("attn", a0, a0 + c.hd)]

    def cost(self, lay: Layout) -> Cost:
        c, ns = lay.cfg, lay.tiling.attn_splits
        return Cost(hbm_bytes=0, l2_bytes=4 * (ns * (c.hd + 2) + c.hd), flops=3 * ns * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c, ns = lay.cfg, lay.tiling.attn_splits
        hs = slice(self.h, self.h + 1)
        po = st.buf["part_o"].view(c.layers, c.n_q, ns, c.hd)[self.layer, hs]       # [1, SPLITS, hd]
        pml = st.buf["part_ml"].view(c.layers, c.n_q, ns, 2)[self.layer, hs]
        m, l = pml[..., 0], pml[..., 1]
        mx = m.max(dim=1, keepdim=True).values
        w = torch.exp2(m - mx)
        out = (po * w[..., None]).sum(dim=1) / (w * l).sum(dim=1, keepdim=True)
        st.buf["attn"].view(c.layers, c.n_q, c.hd)[self.layer, hs] = out
