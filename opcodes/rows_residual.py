"""RESIDUAL_R: one block of a layer's output over every row (opcodes/rows.py).

    xout_r[layer, r, n] = bf16(x1_r[layer, r, n] + dpart_r[layer, 0, r, n] + ... )     r in [r0, r0 + RED_ROWS)
and the next GEMM's normed operand (``common_rows.store_normed``): ``hn_r[layer + 1]``, ``ss_r[layer]``
with the next layer's input norm, or the final norm after the last layer (the LM head's operand).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_N1, tab_offset, to_bf16
from .common_rows import store_normed
from .residual import Residual
from .rows_down import n_parts
from .rows import RowsInstruction, bregion, bview, check_n0, store_normed_r


@triton.jit
def residual_r_device(r0, layer, n0, x1_r_ptr, dpart_r_ptr, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, n1_ptr,
                      fnorm_ptr, LAYERS: tl.constexpr, D: tl.constexpr, DPARTS: tl.constexpr,
                      RED_ROWS: tl.constexpr, SS_P: tl.constexpr, ROWS: tl.constexpr, NT: tl.constexpr,
                      INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    rows = r0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    n = tl.arange(0, NT)
    off = n0 * D + rows[:, None] * NT + n[None, :]
    y = layer_sum(x1_r_ptr, dpart_r_ptr, layer, rm, off, D, DPARTS, ROWS)
    layer_out(y, rows, rm, off, layer, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, n1_ptr, fnorm_ptr, r0, n0, LAYERS,
              D, RED_ROWS, SS_P, ROWS, NT, INTERP)


@triton.jit
def layer_sum(x1_r_ptr, dpart_r_ptr, layer, rm, off, D: tl.constexpr, DPARTS: tl.constexpr, ROWS: tl.constexpr):
    """x1 plus the layer's ``DPARTS`` down partials at ``off`` of a ``[d, ROWS]`` slice, in fp32, in chunk order."""
    y = tl.load(x1_r_ptr + layer * (D * ROWS) + off, mask=rm[:, None], other=0.0, cache_modifier=".cg")
    for kc in tl.static_range(DPARTS):
        y += tl.load(dpart_r_ptr + (layer * DPARTS + kc) * (D * ROWS) + off, mask=rm[:, None], other=0.0,
                     cache_modifier=".cg")
    return y


@triton.jit
def layer_out(y, rows, rm, off, layer, xout_r_ptr, hn_r_ptr, ss_r_ptr, wtab_ptr, n1_ptr, fnorm_ptr, r0, n0,
              LAYERS: tl.constexpr, D: tl.constexpr, RED_ROWS: tl.constexpr, SS_P: tl.constexpr, ROWS: tl.constexpr,
              NT: tl.constexpr, INTERP: tl.constexpr):
    """The end of a layer for the fp32 block ``y`` = x1 + the down projection ([T, NT], features ``rows``, at
    ``off`` of a ``[d, ROWS]`` slice): ``xout_r`` = bf16(y), and the next GEMM's normed operand from it (the
    next layer's input norm, or the final norm after the last layer) with its sums of squares at part
    ``r0 / RED_ROWS`` (the block's first feature ``r0``).
    RESIDUAL_R's, and DOWN_RES_R's (``opcodes.rows_down_res``: the last K chunk's tile with ``Tiling.down_res``)."""
    yb = to_bf16(y, INTERP)
    tl.store(xout_r_ptr + layer * (D * ROWS) + off, yb, mask=rm[:, None])
    if layer == LAYERS - 1:
        nw = fnorm_ptr
    else:
        nw = n1_ptr + tab_offset(wtab_ptr, layer + 1, T_N1)
    store_normed(yb.to(tl.float32), rows, rm, nw, hn_r_ptr + (layer + 1) * (D * ROWS),
                 ss_r_ptr + layer * (SS_P * ROWS), r0 // RED_ROWS, n0, D, SS_P, NT, INTERP)


@register
@dataclass(frozen=True)
class ResidualR(RowsInstruction):
    r0: int
    layer: int
    n0: int = 0       # the column block (opcodes.rows)

    NAME = "residual_r"
    STAGE = 5
    ARGS = ("x1_r_ptr", "dpart_r_ptr", "xout_r_ptr", "hn_r_ptr", "ss_r_ptr", "wtab_ptr", "n1_ptr", "fnorm_ptr",
            "LAYERS", "D", "DPARTS", "RED_ROWS", "SS_P", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"RED_ROWS": Residual.CONSTEXPRS["RED_ROWS"], "DPARTS": n_parts}
    # hn_r [L + 1, d, ROWS]: the normed QKV operand of each layer (0: EMBED_R's) and the LM head's (L);
    # ss_r [L, parts, ROWS]: its sums of squares after layer l (layer 0's input: EMBED_R's ss0_r)
    SCRATCH = {"xout_r": "bf16", "hn_r": "bf16", "ss_r": "fp32"}
    device = residual_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c, R = lay.cfg, lay.rows
        return {"xout_r": (c.layers, c.d, R), "hn_r": (c.layers + 1, c.d, R),
                "ss_r": (c.layers, lay.ss_parts[1], R)}

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.red_rows, lay.cfg.d) + check_n0(self.n0, lay)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.red_rows, lay.cfg.d)

    def reads(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return layer_out_reads(lay, self.layer, lo, hi, self.n0)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return layer_out_writes(lay, self.layer, lo, hi, self.n0, self.r0 // lay.tiling.red_rows)

    def cost(self, lay: Layout) -> Cost:
        R = lay.n_tile
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=0, l2_bytes=(hi - lo) * R * (4 + 4 * n_parts(lay) + 4),
                    flops=(hi - lo) * R * n_parts(lay))

    def run_torch(self, lay: Layout, st) -> None:
        c, b = lay.cfg, self.n0 // lay.n_tile
        lo, hi = self._rows(lay)
        y = layer_sum_torch(lay, st, self.layer, b, lo, hi)
        layer_out_torch(lay, st, self.layer, b, lo, hi, y, self.r0 // lay.tiling.red_rows)


def layer_sum_torch(lay: Layout, st, layer: int, b: int, lo: int, hi: int) -> torch.Tensor:
    """VM: :func:`layer_sum` for features ``[lo, hi)`` of column block ``b`` (a fresh tensor)."""
    c = lay.cfg
    y = bview(st.buf["x1_r"], lay, c.d, c.layers)[layer, b, lo:hi].clone()
    dp = bview(st.buf["dpart_r"], lay, c.d, c.layers, n_parts(lay))
    for kc in range(n_parts(lay)):
        y += dp[layer, kc, b, lo:hi]
    return y


def layer_out_reads(lay: Layout, layer: int, lo: int, hi: int, n0: int) -> list[Region]:
    """The sum's terms but the last chunk's dot: x1 and the ``n_parts`` partials, features ``[lo, hi)``."""
    c = lay.cfg
    return [bregion("x1_r", lay, c.d, layer, lo, hi, n0)] + \
        [bregion("dpart_r", lay, c.d, layer * n_parts(lay) + kc, lo, hi, n0) for kc in range(n_parts(lay))]


def layer_out_writes(lay: Layout, layer: int, lo: int, hi: int, n0: int, part: int) -> list[Region]:
    """What :func:`layer_out` writes for features ``[lo, hi)`` of column block ``n0``."""
    c = lay.cfg
    return [bregion("xout_r", lay, c.d, layer, lo, hi, n0), bregion("hn_r", lay, c.d, layer + 1, lo, hi, n0),
            bregion("ss_r", lay, lay.ss_parts[1], layer, part, part + 1, n0)]


def layer_out_torch(lay: Layout, st, layer: int, b: int, lo: int, hi: int, y: torch.Tensor, part: int) -> None:
    """VM: :func:`layer_out` for features ``[lo, hi)`` of column block ``b``."""
    c = lay.cfg
    bview(st.buf["xout_r"], lay, c.d, c.layers)[layer, b, lo:hi] = y.to(torch.bfloat16)
    nw = st.model["final_norm"] if layer == c.layers - 1 else st.weights[layer + 1]["in_norm"]
    store_normed_r(y.to(torch.bfloat16).float(), lo, hi, nw,
                   bview(st.buf["hn_r"], lay, c.d, c.layers + 1)[layer + 1, b],
                   bview(st.buf["ss_r"], lay, lay.ss_parts[1], c.layers)[layer, b], part)
