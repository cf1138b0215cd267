"""ATTN_FULL: one KV head's query group attending to the whole cache ``[0, pos]`` in one
instruction, normalised: no splits, no partials, no merge.

Where the cache is short (the 1B shape at position 128: 129 keys, one or two K/V blocks in flight
at once) a split buys nothing but its merge: ATTN_PARTIAL's splits then ATTN_REDUCE are two
dependent latency-bound instructions and two counter hops between the QKV stage and the O
projection, where ATTN_FULL is one of each. It waits on its group's Q tiles and K/V tiles (the key
at ``pos`` is the K/V tiles' new row) and writes the group's rows of the attention output that
O reads, as ATTN_REDUCE does. Its time grows with ``pos`` (one loaded round trip per
``attn_stages - 1`` blocks), so the splits win at long positions.
Bytes: ``2 * (pos + 1) * hd * 2`` of K and V.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_partial import AttnPartial, attend_keys, attention_latency
from .attn_reduce import AttnReduce
from .base import Cost, Instruction, Layout, Region, Timing, in_range, register


@triton.jit
def attn_full_device(layer, g, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, attn_ptr,
                     NQ: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                     MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr, INTERP: tl.constexpr,
                     ATTN_STAGES: tl.constexpr):
    acc, m_i, l_i = attend_keys(layer, g, 0, pos + 1, wtab_ptr, kc_ptr, vc_ptr, q_ptr, NQ, HD, GROUP, GROUP_PAD,
                                MAX_SEQ, QSCALE, ATTN_BLOCK, INTERP, ATTN_STAGES)
    hq = tl.arange(0, GROUP_PAD)
    hm = hq < GROUP
    dcol = tl.arange(0, HD)
    out = acc / tl.where(hm, l_i, 1.0)[:, None]
    tl.store(attn_ptr + layer * (NQ * HD) + (g * GROUP + hq)[:, None] * HD + dcol[None, :], out, mask=hm[:, None])


@register
@dataclass(frozen=True)
class AttnFull(Instruction):
    layer: int
    g: int        # KV head

    NAME = "attn_full"
    STAGE = 1
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "attn_ptr", "NQ", "HD", "GROUP", "GROUP_PAD",
            "MAX_SEQ", "QSCALE", "ATTN_BLOCK", "INTERP", "ATTN_STAGES")
    CONSTEXPRS = {k: AttnPartial.CONSTEXPRS[k] for k in ("GROUP", "GROUP_PAD", "ATTN_BLOCK", "ATTN_STAGES", "QSCALE")}
    TIMING = Timing.LATENCY
    TORCH_RTOL = AttnPartial.TORCH_RTOL
    # only the kernels of tapes that attend in one pass hold its branch (Tiling.attn_full)
    IN_EVERY_KERNEL = False
    device = attn_full_device

    SCRATCH = {"attn": AttnReduce.SCRATCH["attn"]}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"attn": AttnReduce.scratch_shapes(lay)["attn"]}

    def latency_time(self, lay: Layout) -> float:
        """Seconds of the group's attention over ``lay.max_seq`` keys on the H200."""
        return attention_latency(lay, lay.max_seq)

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        return in_range("layer", self.layer, c.layers) + in_range("g", self.g, c.n_kv)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        q0 = self.layer * c.q_dim + self.g * c.group * c.hd
        kv0 = self.layer * c.kv_dim + self.g * c.hd
        return [Region("q", q0, q0 + c.group * c.hd), Region("kv_new_k", kv0, kv0 + c.hd),
                Region("kv_new_v", kv0, kv0 + c.hd)]

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        a0 = self.layer * c.q_dim + self.g * c.group * c.hd
        return [Region("attn", a0, a0 + c.group * c.hd)]

    def cost(self, lay: Layout, n_keys: int | None = None) -> Cost:
        c = lay.cfg
        n_keys = lay.max_seq if n_keys is None else n_keys
        return Cost(hbm_bytes=2 * 2 * n_keys * c.hd, l2_bytes=4 * c.group * c.hd * 2,
                    flops=4 * c.group * n_keys * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        hs = slice(self.g * c.group, (self.g + 1) * c.group)
        q = st.buf["q"].view(c.layers, c.n_q, c.hd)[self.layer, hs]
        k = st.kv[self.layer][0][0, self.g, :st.pos + 1].float()
        v = st.kv[self.layer][1][0, self.g, :st.pos + 1].float()
        sc = (q * (1.4426950408889634 / math.sqrt(c.hd))) @ k.T              # [G, pos + 1] base-2 scores
        p = torch.exp2(sc - sc.max(dim=1, keepdim=True).values)
        st.buf["attn"].view(c.layers, c.n_q, c.hd)[self.layer, hs] = (p @ v) / p.sum(dim=1, keepdim=True)
