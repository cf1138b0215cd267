"""GATE_UP_R: one tile of the gate and up projections over every row, with the post-attention RMSNorm
and SiLU (opcodes/rows.py).

    h[:, n]   = x1[:, n] * post_norm,  rstd[n] = rsqrt(mean(x1[:, n]^2) + eps)
    act[r, n] = bf16(silu(g) * u),  g = (Wg[r, :] . bf16(h[:, n])) * rstd[n],  u likewise with Wu

``bf16(h)`` and the parts of ``sum(x1^2)`` come built by the O projection's tiles (``hn2_r``, ``ss2_r``:
``common_rows.store_normed``). Rows r in [r0, r0 + GU_ROWS) of gate and of up; ``act_r`` bf16 ``[L, ffn, ROWS]`` (the down projection's
operand, rounded as the oracle's bf16 product).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_WG, T_WU, tab_offset, to_bf16
from .common_rows import col_rstd, rows_stream
from .gate_up import GateUp
from .rows import RowsInstruction, bf16_dot, col_rstd_r


@triton.jit
def gate_up_r_device(r0, layer, hn2_r_ptr, ss2_r_ptr, act_r_ptr, wtab_ptr, wg_ptr, wu_ptr,
                     D: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, SS2_P: tl.constexpr, SS2_PP: tl.constexpr, ROWS: tl.constexpr,
                     INTERP: tl.constexpr):
    wg = wg_ptr + tab_offset(wtab_ptr, layer, T_WG)
    wu = wu_ptr + tab_offset(wtab_ptr, layer, T_WU)
    rows = r0 + tl.arange(0, GU_ROWS)
    rm = rows < FFN
    acc1, acc2 = rows_stream(wg, rows, wu, rows, rm, hn2_r_ptr + layer * (D * ROWS), 0, ROWS, ROWS, D, D,
                             GU_ROWS, ROWS, BK, STAGES, TWO=True,
                             EVEN=(D % BK == 0) & (FFN % GU_ROWS == 0), INTERP=INTERP)
    rstd = col_rstd(ss2_r_ptr + layer * (SS2_P * ROWS), SS2_P, SS2_PP, D, EPS, ROWS)
    g = acc1 * rstd[None, :]
    u = acc2 * rstd[None, :]
    act = g / (1.0 + tl.exp(-g)) * u
    n = tl.arange(0, ROWS)
    tl.store(act_r_ptr + layer * (FFN * ROWS) + rows[:, None] * ROWS + n[None, :], to_bf16(act, INTERP),
             mask=rm[:, None])


@register
@dataclass(frozen=True)
class GateUpR(RowsInstruction):
    r0: int
    layer: int

    NAME = "gate_up_r"
    STAGE = 3
    ARGS = ("hn2_r_ptr", "ss2_r_ptr", "act_r_ptr", "wtab_ptr", "wg_ptr", "wu_ptr",
            "D", "FFN", "EPS", "GU_ROWS", "BK", "STAGES", "SS2_P", "SS2_PP", "ROWS", "INTERP")
    CONSTEXPRS = {"GU_ROWS": GateUp.CONSTEXPRS["GU_ROWS"]}
    SCRATCH = {"act_r": "bf16"}
    device = gate_up_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"act_r": (lay.cfg.layers, lay.cfg.ffn, lay.rows)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * lay.tiling.gu_rows

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.gu_rows, lay.cfg.ffn)
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.gu_rows, lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        d, R, l = lay.cfg.d, lay.rows, self.layer
        p = lay.ss_parts[2]
        return [Region("hn2_r", l * d * R, (l + 1) * d * R), Region("ss2_r", l * p * R, (l + 1) * p * R)]

    def writes(self, lay: Layout) -> list[Region]:
        f, R = lay.cfg.ffn, lay.rows
        lo, hi = self._rows(lay)
        return [Region("act_r", (self.layer * f + lo) * R, (self.layer * f + hi) * R)]

    def cost(self, lay: Layout) -> Cost:
        d, R = lay.cfg.d, lay.rows
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * 2 * (hi - lo) * d, l2_bytes=2 * d * R + 2 * (hi - lo) * R,
                    flops=4 * (hi - lo) * d * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        lw = st.weights[self.layer]
        xb = st.buf["hn2_r"].view(c.layers, c.d, R)[self.layer]
        rstd = col_rstd_r(st.buf["ss2_r"].view(c.layers, -1, R)[self.layer], lay.ss_parts[2], c.d, c.eps)
        g = bf16_dot(lw["gate"][lo:hi], xb) * rstd[None, :]
        u = bf16_dot(lw["up"][lo:hi], xb) * rstd[None, :]
        act = torch.nn.functional.silu(g) * u
        st.buf["act_r"].view(c.layers, c.ffn, R)[self.layer, lo:hi] = act.to(torch.bfloat16)
