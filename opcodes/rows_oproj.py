"""OPROJ_R: one tile of the O projection over every row, with the residual add (opcodes/rows.py).

    x1_r[layer, r, n] = x[r, n] + Wo[r, :] . attn_r[layer, n, :]     rows r in [r0, r0 + O_ROWS)   (fp32)

and the MLP's normed operand (``common_rows.store_normed``): ``hn2_r[layer]`` = bf16(x1_r * post_norm) and
``ss2_r[layer, r0 / O_ROWS]``. ``x`` is the residual stream entering the layer (``x0_r`` or the previous layer's ``xout_r``);
``attn_r`` is row-major (one attention instruction writes one row), read as tl.dot's B operand
with the token stride ``NQ * HD``.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_N2, T_WO, tab_offset
from .common_rows import rows_stream, store_normed
from .oproj import OProj
from .rows import RowsInstruction, bf16_dot, layer_input_r, store_normed_r


@triton.jit
def oproj_r_device(r0, layer, x0_r_ptr, xout_r_ptr, attn_r_ptr, x1_r_ptr, wtab_ptr, wo_ptr, n2_ptr, hn2_r_ptr,
                   ss2_r_ptr, D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr,
                   BK: tl.constexpr, STAGES: tl.constexpr, SS2_P: tl.constexpr, ROWS: tl.constexpr,
                   INTERP: tl.constexpr):
    w = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    rows = r0 + tl.arange(0, O_ROWS)
    rm = rows < D
    acc, acc2 = rows_stream(w, rows, w, rows, rm, attn_r_ptr + layer * (ROWS * NQ * HD), 0, ROWS, 1,
                            NQ * HD, NQ * HD, O_ROWS, ROWS, BK, STAGES, TWO=False,
                            EVEN=((NQ * HD) % BK == 0) & (D % O_ROWS == 0), INTERP=INTERP, NS=NQ * HD)
    if layer == 0:
        xin = x0_r_ptr
    else:
        xin = xout_r_ptr + (layer - 1) * (D * ROWS)
    n = tl.arange(0, ROWS)
    off = rows[:, None] * ROWS + n[None, :]
    x = tl.load(xin + off, mask=rm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    x1 = x + acc
    tl.store(x1_r_ptr + layer * (D * ROWS) + off, x1, mask=rm[:, None])
    store_normed(x1, rows, rm, n2_ptr + tab_offset(wtab_ptr, layer, T_N2), hn2_r_ptr + layer * (D * ROWS),
                 ss2_r_ptr + layer * (SS2_P * ROWS), r0 // O_ROWS, ROWS, INTERP)


@register
@dataclass(frozen=True)
class OProjR(RowsInstruction):
    r0: int
    layer: int

    NAME = "oproj_r"
    STAGE = 2
    ARGS = ("x0_r_ptr", "xout_r_ptr", "attn_r_ptr", "x1_r_ptr", "wtab_ptr", "wo_ptr", "n2_ptr", "hn2_r_ptr",
            "ss2_r_ptr", "D", "NQ", "HD", "O_ROWS", "BK", "STAGES", "SS2_P", "ROWS", "INTERP")
    CONSTEXPRS = {"O_ROWS": OProj.CONSTEXPRS["O_ROWS"]}
    SCRATCH = {"x1_r": "fp32", "hn2_r": "bf16", "ss2_r": "fp32"}
    device = oproj_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c, R = lay.cfg, lay.rows
        return {"x1_r": (c.layers, c.d, R), "hn2_r": (c.layers, c.d, R),
                "ss2_r": (c.layers, lay.ss_parts[2], R)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.o_rows

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.o_rows, lay.cfg.d)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.o_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        src = [Region("x0_r", lo * R, hi * R)] if self.layer == 0 else \
            [Region("xout_r", ((self.layer - 1) * c.d + lo) * R, ((self.layer - 1) * c.d + hi) * R)]
        return [Region("attn_r", self.layer * R * c.q_dim, (self.layer + 1) * R * c.q_dim)] + src

    def writes(self, lay: Layout) -> list[Region]:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        ss0 = (self.layer * lay.ss_parts[2] + self.r0 // lay.tiling.o_rows) * R
        return [Region("x1_r", (self.layer * c.d + lo) * R, (self.layer * c.d + hi) * R),
                Region("hn2_r", (self.layer * c.d + lo) * R, (self.layer * c.d + hi) * R),
                Region("ss2_r", ss0, ss0 + R)]

    def cost(self, lay: Layout) -> Cost:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * c.q_dim, l2_bytes=2 * c.q_dim * R + 8 * (hi - lo) * R,
                    flops=2 * (hi - lo) * c.q_dim * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        a = st.buf["attn_r"].view(c.layers, R, c.q_dim)[self.layer].T            # [q_dim, ROWS]
        y = bf16_dot(st.weights[self.layer]["o"][lo:hi], a)
        x = layer_input_r(st, self.layer)[lo:hi].float()
        st.buf["x1_r"].view(c.layers, c.d, R)[self.layer, lo:hi] = x + y
        store_normed_r(x + y, lo, hi, st.weights[self.layer]["post_norm"],
                       st.buf["hn2_r"].view(c.layers, c.d, R)[self.layer],
                       st.buf["ss2_r"].view(c.layers, -1, R)[self.layer], self.r0 // lay.tiling.o_rows)
