"""RESIDUAL: the second residual add, summing the down-projection partials in a fixed order.

    out[r] = x1[r] + sum_{kc = 0..DOWN_CHUNKS-1} dpart[kc, r]      (bf16)

The last layer writes the caller's fresh output tensor; other layers write ``xout[layer]``,
which the next layer reads. Reads ``(DOWN_CHUNKS + 1) * RED_ROWS * 4`` bytes from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, in_range, register, tile_start
from .common import to_bf16


@triton.jit
def residual_device(layer, row0, out_ptr, xout_ptr, x1_ptr, dpart_ptr,
                    LAYERS: tl.constexpr, D: tl.constexpr, DOWN_CHUNKS: tl.constexpr, RED_ROWS: tl.constexpr,
                    INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    y = tl.load(x1_ptr + layer * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    for kc in range(DOWN_CHUNKS):
        y += tl.load(dpart_ptr + (layer * DOWN_CHUNKS + kc) * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    # the last layer writes the caller's tensor, the others the next layer's input
    if layer == LAYERS - 1:
        dst = out_ptr
    else:
        dst = xout_ptr + layer * D
    tl.store(dst + rows, to_bf16(y, INTERP), mask=rm)


class RowBlock(Instruction):
    """An instruction over ``RED_ROWS`` rows of the residual stream (``layer``, ``row0`` operands)
    that sums per-chunk partials of those rows in a fixed order: RESIDUAL, O_REDUCE."""

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.red_rows, lay.cfg.d))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.red_rows, lay.cfg.d)

    def _partials(self, lay: Layout, buf: str, n: int) -> list[Region]:
        """The block's rows of the ``n`` partials of ``buf`` (laid out [layers, n, d])."""
        lo, hi = self._rows(lay)
        d = lay.cfg.d
        return [Region(buf, (self.layer * n + k) * d + lo, (self.layer * n + k) * d + hi) for k in range(n)]


@register
@dataclass(frozen=True)
class Residual(RowBlock):
    layer: int
    row0: int

    NAME = "residual"
    STAGE = 6
    ARGS = ("out_ptr", "xout_ptr", "x1_ptr", "dpart_ptr", "LAYERS", "D", "DOWN_CHUNKS", "RED_ROWS", "INTERP")
    CONSTEXPRS = {"RED_ROWS": lambda lay: lay.tiling.red_rows}
    TIMING = Timing.FIXED
    FIXED_S = 0.9e-6          # measured on the H200
    device = residual_device

    SCRATCH = {"xout": "bf16"}   # the layers' outputs; the last layer's row stands for the caller's tensor

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"xout": (lay.n_xout_rows, lay.cfg.d)}

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        lo, hi = self._rows(lay)
        return [Region("x1", self.layer * c.d + lo, self.layer * c.d + hi)] + self._partials(lay, "dpart", lay.n_down_k)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = lay.xout_row(self.layer) * lay.cfg.d
        return [Region("xout", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=0, l2_bytes=4 * (lay.n_down_k + 1) * (hi - lo) + 2 * (hi - lo),
                    flops=lay.n_down_k * (hi - lo))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        y = st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi].clone()
        dp = st.buf["dpart"].view(c.layers, lay.n_down_k, c.d)
        for kc in range(lay.n_down_k):
            y += dp[self.layer, kc, lo:hi]
        st.buf["xout"].view(-1, c.d)[lay.xout_row(self.layer), lo:hi] = y.to(torch.bfloat16)
