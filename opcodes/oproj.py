"""OPROJ: one row tile of the output projection with the first residual add.

    x1[r] = x[r] + Wo[r, :] . attn          for the tile's O_ROWS rows r

Streams ``O_ROWS * n_q * hd * 2`` bytes of Wo; attn (fp32) comes from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, cdiv, register
from .common import T_WO, layer_input, prefetch_rows, tab_offset


@triton.jit
def oproj_device(layer, row0, x_ptr, xout_ptr, wtab_ptr, wo_ptr, attn_ptr, x1_ptr,
                 D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr,
                 BK: tl.constexpr, STAGES: tl.constexpr):
    QD: tl.constexpr = NQ * HD
    EVEN: tl.constexpr = (QD % BK == 0) and (D % O_ROWS == 0)
    rows = row0 + tl.arange(0, O_ROWS)
    rm = rows < D
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    a_ptr = attn_ptr + layer * QD
    acc = tl.zeros([O_ROWS, BK], dtype=tl.float32)
    # each iteration streams O_ROWS x BK bf16 of Wo
    for k0 in tl.range(0, QD, BK, num_stages=STAGES):
        cols = k0 + tl.arange(0, BK)
        if EVEN:
            a = tl.load(a_ptr + cols, cache_modifier=".cg")
            w = tl.load(w_ptr + rows[:, None] * QD + cols[None, :], eviction_policy="evict_first")
        else:
            cm = cols < QD
            a = tl.load(a_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + rows[:, None] * QD + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    y = tl.sum(acc, axis=1)
    xin = layer_input(x_ptr, xout_ptr, layer, D)
    xr = tl.load(xin + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(x1_ptr + layer * D + rows, xr + y, mask=rm)


@triton.jit
def oproj_prefetch(layer, row0, n, wtab_ptr, wo_ptr, D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr,
                   O_ROWS: tl.constexpr, BK: tl.constexpr):
    rows = row0 + tl.arange(0, O_ROWS)
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    prefetch_rows(w_ptr, rows, rows < D, NQ * HD, n * BK, BK, BK)


@register
@dataclass(frozen=True)
class OProj(Instruction):
    layer: int
    row0: int

    NAME = "oproj"
    STAGE = 3
    ARGS = ("x_ptr", "xout_ptr", "wtab_ptr", "wo_ptr", "attn_ptr", "x1_ptr", "D", "NQ", "HD", "O_ROWS", "BK", "STAGES")
    device = oproj_device
    prefetch = oproj_prefetch
    PREFETCH_ARGS = ("wtab_ptr", "wo_ptr", "D", "NQ", "HD", "O_ROWS", "BK")

    def check_operands(self, lay: Layout) -> list[str]:
        c, r = lay.cfg, lay.tiling.o_rows
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if not (0 <= self.row0 < c.d and self.row0 % r == 0):
            bad.append(f"row0 {self.row0} not a multiple of {r} in [0, {c.d})")
        return bad

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.o_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        out = [Region("attn", self.layer * c.q_dim, (self.layer + 1) * c.q_dim)]
        if self.layer > 0:
            lo, hi = self._rows(lay)
            out.append(Region("xout", (self.layer - 1) * c.d + lo, (self.layer - 1) * c.d + hi))
        return out

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = self.layer * lay.cfg.d
        return [Region("x1", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        c = lay.cfg
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * c.q_dim, l2_bytes=4 * c.q_dim + 6 * (hi - lo),
                    flops=2 * (hi - lo) * c.q_dim)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        a = st.buf["attn"].view(c.layers, c.q_dim)[self.layer]
        y = st.weights[self.layer]["o"][lo:hi].float() @ a
        x = st.layer_input(self.layer)[lo:hi].float()
        st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = x + y


def n_tiles(lay: Layout) -> int:
    return cdiv(lay.cfg.d, lay.tiling.o_rows)
