"""RESIDUAL_R: one block of a layer's output over every row (opcodes/rows.py).

    xout_r[layer, r, n] = bf16(x1_r[layer, r, n] + dpart_r[layer, 0, r, n] + ... )     r in [r0, r0 + RED_ROWS)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import to_bf16
from .residual import Residual
from .rows import RowsInstruction


@triton.jit
def residual_r_device(r0, layer, x1_r_ptr, dpart_r_ptr, xout_r_ptr, D: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                      RED_ROWS: tl.constexpr, ROWS: tl.constexpr, INTERP: tl.constexpr):
    rows = r0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    n = tl.arange(0, ROWS)
    off = rows[:, None] * ROWS + n[None, :]
    y = tl.load(x1_r_ptr + layer * (D * ROWS) + off, mask=rm[:, None], other=0.0, cache_modifier=".cg")
    for kc in tl.static_range(DOWN_CHUNKS):
        y += tl.load(dpart_r_ptr + (layer * DOWN_CHUNKS + kc) * (D * ROWS) + off, mask=rm[:, None], other=0.0,
                     cache_modifier=".cg")
    tl.store(xout_r_ptr + layer * (D * ROWS) + off, to_bf16(y, INTERP), mask=rm[:, None])


@register
@dataclass(frozen=True)
class ResidualR(RowsInstruction):
    r0: int
    layer: int

    NAME = "residual_r"
    STAGE = 5
    ARGS = ("x1_r_ptr", "dpart_r_ptr", "xout_r_ptr", "D", "DOWN_CHUNKS", "RED_ROWS", "ROWS", "INTERP")
    CONSTEXPRS = {"RED_ROWS": Residual.CONSTEXPRS["RED_ROWS"]}
    SCRATCH = {"xout_r": "bf16"}
    device = residual_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"xout_r": (lay.cfg.layers, lay.cfg.d, lay.rows)}

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.red_rows, lay.cfg.d)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.red_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        out = [Region("x1_r", (self.layer * c.d + lo) * R, (self.layer * c.d + hi) * R)]
        for kc in range(lay.n_down_k):
            b = (self.layer * lay.n_down_k + kc) * c.d
            out.append(Region("dpart_r", (b + lo) * R, (b + hi) * R))
        return out

    def writes(self, lay: Layout) -> list[Region]:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        return [Region("xout_r", (self.layer * c.d + lo) * R, (self.layer * c.d + hi) * R)]

    def cost(self, lay: Layout) -> Cost:
        R = lay.rows
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=0, l2_bytes=(hi - lo) * R * (4 + 4 * lay.n_down_k + 2), flops=(hi - lo) * R * lay.n_down_k)

    def run_torch(self, lay: Layout, st) -> None:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        y = st.buf["x1_r"].view(c.layers, c.d, R)[self.layer, lo:hi].clone()
        dp = st.buf["dpart_r"].view(c.layers, lay.n_down_k, c.d, R)
        for kc in range(lay.n_down_k):
            y += dp[self.layer, kc, lo:hi]
        st.buf["xout_r"].view(c.layers, c.d, R)[self.layer, lo:hi] = y.to(torch.bfloat16)
