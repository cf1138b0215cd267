"""DOWN_RES_R: one tile of the down projection's last K chunk over every row, ending the layer itself
(opcodes/rows.py; ``Tiling.down_res``; bench/notes/s47.md v178).

    y[r, n] = x1_r[layer, r, n] + dpart_r[layer, 0, r, n] + ... + dpart_r[layer, C - 2, r, n]
              + Wd[r, (C-1)*DOWN_K : ffn] . act_r[layer, (C-1)*DOWN_K : ffn, n]     rows r in [r0, r0 + DOWN_ROWS)

(C = ``DOWN_CHUNKS``: the DOWN_R tiles of the other chunks write the ``DPARTS`` = C - 1 partials), then
RESIDUAL_R's epilogue (``rows_residual.layer_out``): ``xout_r`` = bf16(y) and the next GEMM's normed operand. The
tile's rows are one residual block (``down_rows == red_rows``: the same sum-of-squares parts), and it adds the
same fp32 terms in RESIDUAL_R's order (its own dot is the last chunk's partial, unrounded): the bits of DOWN_R +
RESIDUAL_R at that tiling, without the last chunk's partial written and read back, the RESIDUAL_R phase and
its dependency hop. It needs another chunk (``down_k < ffn``): DOWN_R writes the partials buffer (with one
chunk nothing would, and every scratch element is written once a call: ``schedule.verify``).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0
from .rows_down import DownR, down_chunk
from .rows_residual import (ResidualR, layer_out, layer_out_reads, layer_out_torch, layer_out_writes, layer_sum,
                            layer_sum_torch)


@triton.jit
def down_res_r_device(r0, layer, n0, act_r_ptr, dpart_r_ptr, x1_r_ptr, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr,
                      wd_ptr, n1_ptr, fnorm_ptr, LAYERS: tl.constexpr, D: tl.constexpr, FFN: tl.constexpr,
                      DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr, DOWN_CHUNKS: tl.constexpr, DPARTS: tl.constexpr,
                      BK: tl.constexpr, STAGES: tl.constexpr, SS_P: tl.constexpr, ROWS: tl.constexpr,
                      NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    acc, rows, rm = down_chunk(r0, layer, DOWN_CHUNKS - 1, n0, act_r_ptr, wtab_ptr, wd_ptr, D, FFN, DOWN_ROWS, DOWN_K,
                               BK, STAGES, ROWS, NT, INTERP)     # DOWN_R's last chunk: the same sum
    n = tl.arange(0, NT)
    off = n0 * D + rows[:, None] * NT + n[None, :]
    y = layer_sum(x1_r_ptr, dpart_r_ptr, layer, rm, off, D, DPARTS, ROWS) + acc     # RESIDUAL_R's order
    layer_out(y, rows, rm, off, layer, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, n1_ptr, fnorm_ptr, r0, n0, LAYERS,
              D, DOWN_ROWS, SS_P, ROWS, NT, INTERP)


@register
@dataclass(frozen=True)
class DownResR(RowsInstruction):
    r0: int
    layer: int
    n0: int = 0   # the column block (opcodes.rows)

    NAME = "down_res_r"
    STAGE = 4
    ARGS = ("act_r_ptr", "dpart_r_ptr", "x1_r_ptr", "xout_r_ptr", "hn_r_ptr", "ss_r_ptr", "wtab_ptr", "wd_ptr",
            "n1_ptr", "fnorm_ptr", "LAYERS", "D", "FFN", "DOWN_ROWS", "DOWN_K", "DOWN_CHUNKS", "DPARTS", "BK",
            "STAGES", "SS_P", "ROWS", "NT", "INTERP")
    CONSTEXPRS = DownR.CONSTEXPRS
    SCRATCH = {**ResidualR.SCRATCH, **DownR.SCRATCH}
    device = down_res_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {**ResidualR.scratch_shapes(lay), **DownR.scratch_shapes(lay)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.down_rows

    def check_operands(self, lay: Layout) -> list[str]:
        t = lay.tiling
        bad = [] if t.down_res and t.down_rows == t.red_rows and lay.n_down_k > 1 else [
            f"down_res_r needs Tiling.down_res = 1, down_rows = red_rows and 2 or more down K chunks, got down_res "
            f"{t.down_res}, down_rows {t.down_rows}, red_rows {t.red_rows}, {lay.n_down_k} chunk(s)"]
        bad += tile_start("r0", self.r0, t.down_rows, lay.cfg.d) + check_n0(self.n0, lay)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.down_rows, lay.cfg.d)

    def _ks(self, lay: Layout) -> tuple[int, int]:
        return (lay.n_down_k - 1) * lay.tiling.down_k, lay.cfg.ffn

    def reads(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        return [bregion("act_r", lay, lay.cfg.ffn, self.layer, k0, k1, self.n0)] + \
            layer_out_reads(lay, self.layer, lo, hi, self.n0)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return layer_out_writes(lay, self.layer, lo, hi, self.n0, self.r0 // lay.tiling.down_rows)

    def cost(self, lay: Layout) -> Cost:
        R = lay.n_tile
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0),
                    l2_bytes=2 * (k1 - k0) * R + (hi - lo) * R * (4 * lay.n_down_k + 2 + 2),
                    flops=2 * (hi - lo) * (k1 - k0) * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, b = lay.cfg, self.n0 // lay.n_tile
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = bview(st.buf["act_r"], lay, c.ffn, c.layers)[self.layer, b, k0:k1]
        y = layer_sum_torch(lay, st, self.layer, b, lo, hi)
        y += bf16_dot(st.weights[self.layer]["down"][lo:hi, k0:k1], a)
        layer_out_torch(lay, st, self.layer, b, lo, hi, y, self.r0 // lay.tiling.down_rows)
