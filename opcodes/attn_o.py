"""ATTN_O: one KV group's attention and its part of the O projection, for one row tile (``Tiling.attn_o``).

    a          = attention of the group's query heads over every key [0, pos]     (ATTN_PARTIAL's, merged)
    opart[g, r] = Wo[r, K_g] . a         K_g = the group's GROUP * hd columns of n_q * hd

The layer has no O stage and no merge: each of ``n_kv * d / ao_rows`` tiles computes its group's
attention (the same on the ``d / ao_rows`` tiles of a group: its K/V come from the L2 after the first)
and writes the partial (OPROJ's ``opart``) of x1's rows ``[row0, row0 + ao_rows)`` from its group's columns of Wo; GATE_UP
sums the layer input and the groups' partials, in group order, into x1 (``opcodes.gate_up``). Streams
``ao_rows * GROUP * hd * 2`` bytes of Wo and the group's cache rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .attn_partial import attention_latency, attn_whole_out
from .base import H200_SMS, Cost, Instruction, Layout, Region, Timing, in_range, register, tile_start
from .common import T_KC, T_VC, T_WO, tab_offset
from .oproj import OProj


@triton.jit
def attn_o_device(layer, g, row0, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, wo_ptr, opart_ptr,
                  D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr,
                  GROUP_PAD: tl.constexpr, MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, ATTN_BLOCK: tl.constexpr,
                  INTERP: tl.constexpr, ATTN_STAGES: tl.constexpr, AO_ROWS: tl.constexpr, STAGES: tl.constexpr,
                  AO_WAIT: tl.constexpr, ins, cnt_ptr, epoch, spin_limit, PROFILE: tl.constexpr):
    QD: tl.constexpr = NQ * HD
    hq = tl.arange(0, GROUP_PAD)
    dcol = tl.arange(0, HD)
    kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + g * (MAX_SEQ * HD)
    vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + g * (MAX_SEQ * HD)
    acc, l_i, bad_c, bad_s, t_exec = attn_whole_out(layer, pos, kbase, vbase, q_ptr, g * GROUP + hq, hq < GROUP, dcol,
                                                    ins, cnt_ptr, epoch, spin_limit, NQ, HD, GROUP_PAD, QSCALE,
                                                    ATTN_BLOCK, INTERP, ATTN_STAGES, PROFILE)
    out = acc / l_i[:, None]
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    rows = row0 + tl.arange(0, AO_ROWS)
    rm = rows < D
    y = tl.zeros([AO_ROWS], dtype=tl.float32)
    # one head's hd columns of Wo a pipeline stage: [AO_ROWS, HD] times that head's output
    for h in tl.range(0, GROUP, num_stages=STAGES):
        a = tl.sum(tl.where((hq == h)[:, None], out, 0.0), axis=0)
        w = tl.load(w_ptr + rows[:, None] * QD + (g * GROUP + h) * HD + dcol[None, :], mask=rm[:, None], other=0.0,
                    eviction_policy="evict_first")
        y += tl.sum(w.to(tl.float32) * a[None, :], axis=1)
    tl.store(opart_ptr + (layer * NKV + g) * D + rows, y, mask=rm & (bad_c < 0))
    return bad_c, bad_s, t_exec


@register
@dataclass(frozen=True)
class AttnO(Instruction):
    layer: int
    g: int        # KV group
    row0: int     # first row of x1 (of d) whose partial the tile writes

    NAME = "attn_o"
    STAGE = 2
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "wo_ptr", "opart_ptr", "D", "NQ", "NKV", "HD", "GROUP",
            "GROUP_PAD", "MAX_SEQ", "QSCALE", "ATTN_BLOCK", "INTERP", "ATTN_STAGES", "AO_ROWS", "STAGES", "AO_WAIT")
    CONSTEXPRS = {"AO_ROWS": lambda lay: lay.tiling.ao_rows,
                  "AO_WAIT": lambda lay: int(lay.attn_o)}      # its waits made inside (after the K/V prefix)
    WAIT_INSIDE = "AO_WAIT"
    IN_EVERY_KERNEL = False
    TIMING = Timing.LATENCY
    TORCH_RTOL = 1e-2         # the tensor-core dots take bf16 q and p; run_torch keeps them fp32
    device = attn_o_device

    SCRATCH = {"opart": "fp32"}     # OPROJ's partials buffer (declared alike): one row of d a KV group

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"opart": OProj.scratch_shapes(lay)["opart"]}

    def latency_time(self, lay: Layout) -> float:
        """The merged attention's time at ``lay.max_seq`` keys, then Wo's slice at an SM's share of the
        H200's bandwidth."""
        wo = self.cost(lay).hbm_bytes - 2 * 2 * lay.max_seq * lay.cfg.hd
        return attention_latency(lay, lay.max_seq) + wo / (4.2e12 / H200_SMS)

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers) + in_range("g", self.g, lay.cfg.n_kv)
                + tile_start("row0", self.row0, lay.tiling.ao_rows, lay.cfg.d))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.ao_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        q0 = self.layer * c.q_dim + self.g * c.group * c.hd
        kv0 = self.layer * c.kv_dim + self.g * c.hd
        return [Region("q", q0, q0 + c.group * c.hd), Region("kv_new_k", kv0, kv0 + c.hd),
                Region("kv_new_v", kv0, kv0 + c.hd)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = (self.layer * lay.cfg.n_kv + self.g) * lay.cfg.d
        return [Region("opart", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        c = lay.cfg
        lo, hi = self._rows(lay)
        cols = c.group * c.hd
        return Cost(hbm_bytes=2 * (hi - lo) * cols + 2 * 2 * lay.max_seq * c.hd,
                    l2_bytes=4 * cols + 4 * (hi - lo),
                    flops=2 * (hi - lo) * cols + 4 * c.group * lay.max_seq * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        hs = slice(self.g * c.group, (self.g + 1) * c.group)
        q = st.buf["q"].view(c.layers, c.n_q, c.hd)[self.layer, hs]
        k = st.kv[self.layer][0][0, self.g, :st.pos + 1].float()
        v = st.kv[self.layer][1][0, self.g, :st.pos + 1].float()
        sc = (q * (1.4426950408889634 / math.sqrt(c.hd))) @ k.T        # [G, T] base-2 scores
        p = torch.exp2(sc - sc.max(dim=1).values[:, None])
        a = ((p @ v) / p.sum(dim=1)[:, None]).reshape(-1)                # the group's heads' outputs
        lo, hi = self._rows(lay)
        w = st.weights[self.layer]["o"][lo:hi, self.g * c.group * c.hd:(self.g + 1) * c.group * c.hd].float()
        st.buf["opart"].view(c.layers, c.n_kv, c.d)[self.layer, self.g, lo:hi] = w @ a
