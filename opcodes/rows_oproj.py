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
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0, layer_input_r, store_normed_r


@triton.jit
def oproj_r_device(r0, layer, n0, x0_r_ptr, xout_r_ptr, attn_r_ptr, x1_r_ptr, wtab_ptr, wo_ptr, n2_ptr, hn2_r_ptr,
                   ss2_r_ptr, D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr,
                   BK: tl.constexpr, STAGES: tl.constexpr, SS2_P: tl.constexpr, ROWS: tl.constexpr,
                   NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    w = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    rows = r0 + tl.arange(0, O_ROWS)
    rm = rows < D
    acc, acc2 = rows_stream(w, rows, w, rows, rm, attn_r_ptr + (layer * ROWS + n0) * (NQ * HD), 0, NT, 1,
                            NQ * HD, NQ * HD, O_ROWS, NT, BK, STAGES, TWO=False,
                            EVEN=((NQ * HD) % BK == 0) & (D % O_ROWS == 0), INTERP=INTERP, NS=NQ * HD)
    if layer == 0:
        xin = x0_r_ptr
    else:
        xin = xout_r_ptr + (layer - 1) * (D * ROWS)
    n = tl.arange(0, NT)
    off = n0 * D + rows[:, None] * NT + n[None, :]
    x = tl.load(xin + off, mask=rm[:, None], other=0.0, cache_modifier=".cg").to(tl.float32)
    x1 = x + acc
    tl.store(x1_r_ptr + layer * (D * ROWS) + off, x1, mask=rm[:, None])
    store_normed(x1, rows, rm, n2_ptr + tab_offset(wtab_ptr, layer, T_N2), hn2_r_ptr + layer * (D * ROWS),
                 ss2_r_ptr + layer * (SS2_P * ROWS), r0 // O_ROWS, n0, D, SS2_P, NT, INTERP)


@register
@dataclass(frozen=True)
class OProjR(RowsInstruction):
    r0: int
    layer: int
    n0: int = 0       # the column block (opcodes.rows)

    NAME = "oproj_r"
    STAGE = 2
    ARGS = ("x0_r_ptr", "xout_r_ptr", "attn_r_ptr", "x1_r_ptr", "wtab_ptr", "wo_ptr", "n2_ptr", "hn2_r_ptr",
            "ss2_r_ptr", "D", "NQ", "HD", "O_ROWS", "BK", "STAGES", "SS2_P", "ROWS", "NT", "INTERP")
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
        bad = tile_start("r0", self.r0, lay.tiling.o_rows, lay.cfg.d) + check_n0(self.n0, lay)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.o_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        c, R, NT = lay.cfg, lay.rows, lay.n_tile
        lo, hi = self._rows(lay)
        src = bregion("x0_r", lay, c.d, 0, lo, hi, self.n0) if self.layer == 0 else \
            bregion("xout_r", lay, c.d, self.layer - 1, lo, hi, self.n0)
        a0 = (self.layer * R + self.n0) * c.q_dim
        return [Region("attn_r", a0, a0 + NT * c.q_dim), src]

    def writes(self, lay: Layout) -> list[Region]:
        c, l, n0 = lay.cfg, self.layer, self.n0
        lo, hi = self._rows(lay)
        part = self.r0 // lay.tiling.o_rows
        return [bregion("x1_r", lay, c.d, l, lo, hi, n0), bregion("hn2_r", lay, c.d, l, lo, hi, n0),
                bregion("ss2_r", lay, lay.ss_parts[2], l, part, part + 1, n0)]

    def cost(self, lay: Layout) -> Cost:
        c, R = lay.cfg, lay.n_tile
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * c.q_dim, l2_bytes=2 * c.q_dim * R + 8 * (hi - lo) * R,
                    flops=2 * (hi - lo) * c.q_dim * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, R, NT, b = lay.cfg, lay.rows, lay.n_tile, self.n0 // lay.n_tile
        lo, hi = self._rows(lay)
        a = st.buf["attn_r"].view(c.layers, R, c.q_dim)[self.layer, self.n0:self.n0 + NT].T    # [q_dim, NT]
        y = bf16_dot(st.weights[self.layer]["o"][lo:hi], a)
        x = layer_input_r(st, self.layer, b)[lo:hi].float()
        bview(st.buf["x1_r"], lay, c.d, c.layers)[self.layer, b, lo:hi] = x + y
        store_normed_r(x + y, lo, hi, st.weights[self.layer]["post_norm"],
                       bview(st.buf["hn2_r"], lay, c.d, c.layers)[self.layer, b],
                       bview(st.buf["ss2_r"], lay, lay.ss_parts[2], c.layers)[self.layer, b],
                       self.r0 // lay.tiling.o_rows)
