"""O_REDUCE: the first residual add over a split O projection, summing its K chunks in order.

    x1[r] = x[r] + sum_{oc = 0..O_CHUNKS-1} opart[oc, r]

Only used when the O projection is split along K (``Tiling.o_k < n_q*hd``). Reads
``(O_CHUNKS + 1) * RED_ROWS * 4`` bytes from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, Timing, register
from .oproj import OProj
from .common import layer_rows
from .residual import RowBlock


@triton.jit
def o_reduce_device(layer, row0, x_ptr, xout_ptr, opart_ptr, x1_ptr, dpart_ptr,
                    D: tl.constexpr, O_CHUNKS: tl.constexpr, RED_ROWS: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                    RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    y = layer_rows(x_ptr, xout_ptr, x1_ptr, dpart_ptr, layer, rows, rm, D, DOWN_CHUNKS, RES_FOLD, INTERP)
    for oc in range(O_CHUNKS):
        y += tl.load(opart_ptr + (layer * O_CHUNKS + oc) * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    tl.store(x1_ptr + layer * D + rows, y, mask=rm)


@register
@dataclass(frozen=True)
class OReduce(RowBlock):
    layer: int
    row0: int

    NAME = "o_reduce"
    STAGE = 3
    ARGS = ("x_ptr", "xout_ptr", "opart_ptr", "x1_ptr", "dpart_ptr", "D", "O_CHUNKS", "RED_ROWS", "DOWN_CHUNKS",
            "RES_FOLD", "INTERP")
    CONSTEXPRS = {"RED_ROWS": lambda lay: lay.tiling.red_rows, "O_CHUNKS": lambda lay: lay.n_o_k}
    TIMING = Timing.FIXED
    FIXED_S = 1.5e-6          # measured on the H200
    device = o_reduce_device

    SCRATCH = OProj.SCRATCH      # x1 and the O partials (OPROJ owns them; declared alike)

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return OProj.scratch_shapes(lay)

    def reads(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return self._partials(lay, "opart", lay.n_o_k) + lay.input_regions(self.layer, lo, hi)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = self.layer * lay.cfg.d
        return [Region("x1", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=0, l2_bytes=4 * (lay.n_o_k + 2) * (hi - lo), flops=lay.n_o_k * (hi - lo))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        y = st.layer_input(self.layer)[lo:hi].float().clone()
        op = st.buf["opart"].view(c.layers, lay.n_o_k, c.d)
        for oc in range(lay.n_o_k):
            y += op[self.layer, oc, lo:hi]
        st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = y
