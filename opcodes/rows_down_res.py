"""DOWN_RES_R: one tile of the down projection over every row and the whole ffn, ending the layer itself
(opcodes/rows.py; bench/notes/s47.md v177).

    y[r, n] = x1_r[layer, r, n] + Wd[r, :] . act_r[layer, :, n]        rows r in [r0, r0 + DOWN_ROWS)   (fp32)

then RESIDUAL_R's epilogue (``rows_residual.layer_out``): ``xout_r`` = bf16(y) and the next GEMM's normed
operand. Where one down tile spans the ffn (``Tiling.down_k >= ffn``) and its rows are a residual block
(``down_rows == red_rows``: the same sum-of-squares parts), the partial it would write is the only one
RESIDUAL_R would add to x1, in the same fp32 order: this tile computes the same bits with no partial
written and read back and no RESIDUAL_R phase (one dependency hop a layer less). ``applies_to`` is the
condition; ``schedule.rows_program`` lowers to it where it holds.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_WD, tab_offset
from .common_rows import rows_stream
from .down import Down
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0
from .rows_residual import ResidualR, layer_out, layer_out_torch


@triton.jit
def down_res_r_device(r0, layer, n0, act_r_ptr, x1_r_ptr, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, wd_ptr, n1_ptr,
                      fnorm_ptr, LAYERS: tl.constexpr, D: tl.constexpr, FFN: tl.constexpr,
                      DOWN_ROWS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, SS_P: tl.constexpr,
                      ROWS: tl.constexpr, NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    w = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    rows = r0 + tl.arange(0, DOWN_ROWS)
    rm = rows < D
    acc, acc2 = rows_stream(w, rows, w, rows, rm, act_r_ptr + layer * (FFN * ROWS) + n0 * FFN, 0, NT,
                            NT, FFN, FFN, DOWN_ROWS, NT, BK, STAGES, TWO=False,
                            EVEN=(FFN % BK == 0) & (D % DOWN_ROWS == 0), INTERP=INTERP)
    n = tl.arange(0, NT)
    off = n0 * D + rows[:, None] * NT + n[None, :]
    y = tl.load(x1_r_ptr + layer * (D * ROWS) + off, mask=rm[:, None], other=0.0, cache_modifier=".cg")
    y += acc
    layer_out(y, rows, rm, off, layer, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, n1_ptr, fnorm_ptr, r0 // DOWN_ROWS,
              n0, LAYERS, D, SS_P, ROWS, NT, INTERP)


@register
@dataclass(frozen=True)
class DownResR(RowsInstruction):
    r0: int
    layer: int
    n0: int = 0   # the column block (opcodes.rows)

    NAME = "down_res_r"
    STAGE = 4
    ARGS = ("act_r_ptr", "x1_r_ptr", "xout_r_ptr", "hn_r_ptr", "ss_r_ptr", "wtab_ptr", "wd_ptr", "n1_ptr", "fnorm_ptr",
            "LAYERS", "D", "FFN", "DOWN_ROWS", "BK", "STAGES", "SS_P", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"DOWN_ROWS": Down.CONSTEXPRS["DOWN_ROWS"]}
    SCRATCH = dict(ResidualR.SCRATCH)
    device = down_res_r_device

    @staticmethod
    def applies_to(lay: Layout) -> bool:
        """Whether a rows program of ``lay`` ends its layers in DOWN_RES_R tiles instead of DOWN_R + RESIDUAL_R."""
        return lay.n_down_k == 1 and lay.tiling.down_rows == lay.tiling.red_rows

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return ResidualR.scratch_shapes(lay)

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.down_rows

    def check_operands(self, lay: Layout) -> list[str]:
        bad = [] if self.applies_to(lay) else [
            f"down_res_r needs one down K chunk and down_rows = red_rows, got down_k {lay.tiling.down_k} "
            f"(ffn {lay.cfg.ffn}), down_rows {lay.tiling.down_rows}, red_rows {lay.tiling.red_rows}"]
        bad += tile_start("r0", self.r0, lay.tiling.down_rows, lay.cfg.d) + check_n0(self.n0, lay)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.down_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        lo, hi = self._rows(lay)
        return [bregion("act_r", lay, c.ffn, self.layer, 0, c.ffn, self.n0),
                bregion("x1_r", lay, c.d, self.layer, lo, hi, self.n0)]

    def writes(self, lay: Layout) -> list[Region]:
        c, n0 = lay.cfg, self.n0
        lo, hi = self._rows(lay)
        part = self.r0 // lay.tiling.down_rows
        return [bregion("xout_r", lay, c.d, self.layer, lo, hi, n0),
                bregion("hn_r", lay, c.d, self.layer + 1, lo, hi, n0),
                bregion("ss_r", lay, lay.ss_parts[1], self.layer, part, part + 1, n0)]

    def cost(self, lay: Layout) -> Cost:
        R, f = lay.n_tile, lay.cfg.ffn
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * f, l2_bytes=2 * f * R + (hi - lo) * R * (4 + 2 + 2),
                    flops=2 * (hi - lo) * f * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, b = lay.cfg, self.n0 // lay.n_tile
        lo, hi = self._rows(lay)
        a = bview(st.buf["act_r"], lay, c.ffn, c.layers)[self.layer, b]
        y = bview(st.buf["x1_r"], lay, c.d, c.layers)[self.layer, b, lo:hi].clone()
        y += bf16_dot(st.weights[self.layer]["down"][lo:hi], a)
        layer_out_torch(lay, st, self.layer, b, lo, hi, y, self.r0 // lay.tiling.down_rows)
