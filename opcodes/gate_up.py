"""GATE_UP: one row tile of the SwiGLU input projections, with the post-attention RMSNorm.

    h      = x1 * rsqrt(mean(x1^2) + eps) * post_norm
    act[r] = silu(Wgate[r] . h) * (Wup[r] . h)       for the tile's GU_ROWS rows r

The (1, ffn) activation is produced a block at a time; the down projection consumes each
block as soon as the tiles of its K range are done. Streams ``2 * GU_ROWS * d * 2`` bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, in_range, register, tile_start
from .common import T_N2, T_WG, T_WU, gemv_stream, norm_row_vec, rows_dot, rows_load, tab_offset, tape_waits


@triton.jit
def _gu_rows(row0, g_ptr, u_ptr, nw_ptr, xin, act_out,
             D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
             GU_RB: tl.constexpr, STAGES: tl.constexpr):
    # whole rows, GU_RB of gate and of up per pipeline stage (Tiling.row_bytes)
    hv, rstd = norm_row_vec(xin, nw_ptr, D, DP, EPS)
    EVEN: tl.constexpr = (D == DP) and (FFN % GU_ROWS == 0)
    for b in tl.range(0, GU_ROWS // GU_RB, num_stages=STAGES):
        rows = row0 + b * GU_RB + tl.arange(0, GU_RB)
        rm = rows < FFN
        gv = rows_dot(g_ptr, rows, rm, hv, 0, D, D, DP, EVEN) * rstd
        uv = rows_dot(u_ptr, rows, rm, hv, 0, D, D, DP, EVEN) * rstd
        tl.store(act_out + rows, gv / (1.0 + tl.exp(-gv)) * uv, mask=rm)


@triton.jit
def _gu_rows_waiting(row0, g_ptr, u_ptr, nw_ptr, xin, act_out, ins, cnt_ptr, epoch, spin_limit,
                     D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr,
                     GU_ROWS: tl.constexpr, GU_RB: tl.constexpr, STAGES: tl.constexpr, PROFILE: tl.constexpr):
    # _gu_rows with the instruction's waits and the input vector in the first iteration: the
    # pipeline's prologue (its first STAGES - 1 blocks of weights) is issued before them
    EVEN: tl.constexpr = (D == DP) and (FFN % GU_ROWS == 0)
    hv = tl.zeros([1, DP], dtype=tl.float32)       # [1, DP]: carried in the blocks' layout
    rstd = tl.full([], 0.0, tl.float32)
    bad_c = tl.full([], -1, tl.int32)
    bad_s = tl.full([], 0, tl.int32)
    t_exec = tl.full([], 0, tl.int64)
    for b in tl.range(0, GU_ROWS // GU_RB, num_stages=STAGES):
        rows = row0 + b * GU_RB + tl.arange(0, GU_RB)
        rm = rows < FFN
        if b == 0:      # before the block's loads: the poll does not wait for the first block to land
            bad_c, bad_s, t_exec = tape_waits(ins, cnt_ptr, epoch, spin_limit, PROFILE)
            h1, rstd = norm_row_vec(xin, nw_ptr, D, DP, EPS)
            hv = h1[None, :]
        wg = rows_load(g_ptr, rows, rm, 0, D, D, DP, EVEN)
        wu = rows_load(u_ptr, rows, rm, 0, D, D, DP, EVEN)
        gv = tl.sum(wg.to(tl.float32) * hv, axis=1) * rstd
        uv = tl.sum(wu.to(tl.float32) * hv, axis=1) * rstd
        tl.store(act_out + rows, gv / (1.0 + tl.exp(-gv)) * uv, mask=rm & (bad_c < 0))
    return bad_c, bad_s, t_exec


@triton.jit
def gate_up_device(layer, row0, wtab_ptr, n2_ptr, wg_ptr, wu_ptr, x1_ptr, act_ptr,
                   D: tl.constexpr, DP: tl.constexpr, FFN: tl.constexpr, EPS: tl.constexpr, GU_ROWS: tl.constexpr,
                   GU_RB: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, GU_WAIT: tl.constexpr,
                   ins, cnt_ptr, epoch, spin_limit, PROFILE: tl.constexpr):
    # GU_WAIT (the row loop only): the waits are made here, after the loop's prologue (WAIT_INSIDE)
    g_ptr = wg_ptr + tab_offset(wtab_ptr, layer, T_WG)
    u_ptr = wu_ptr + tab_offset(wtab_ptr, layer, T_WU)
    nw_ptr = n2_ptr + tab_offset(wtab_ptr, layer, T_N2)
    xin = x1_ptr + layer * D
    if GU_WAIT:
        return _gu_rows_waiting(row0, g_ptr, u_ptr, nw_ptr, xin, act_ptr + layer * FFN, ins, cnt_ptr, epoch,
                                spin_limit, D, DP, FFN, EPS, GU_ROWS, GU_RB, STAGES, PROFILE)
    elif GU_RB == 0:
        rows = row0 + tl.arange(0, GU_ROWS)
        rm = rows < FFN
        accg, accu, ss = gemv_stream(g_ptr, rows, u_ptr, rows, rm, xin, nw_ptr, 0, D, D, GU_ROWS, BK, STAGES,
                                     TWO=True, NORM=True, EVEN=(D % BK == 0) and (FFN % GU_ROWS == 0))
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
        gv = tl.sum(accg, axis=1) * rstd
        uv = tl.sum(accu, axis=1) * rstd
        act = gv / (1.0 + tl.exp(-gv)) * uv
        tl.store(act_ptr + layer * FFN + rows, act, mask=rm)
    else:
        _gu_rows(row0, g_ptr, u_ptr, nw_ptr, xin, act_ptr + layer * FFN, D, DP, FFN, EPS, GU_ROWS,
                 GU_RB, STAGES)


@register
@dataclass(frozen=True)
class GateUp(Instruction):
    layer: int
    row0: int

    NAME = "gate_up"
    STAGE = 4
    ARGS = ("wtab_ptr", "n2_ptr", "wg_ptr", "wu_ptr", "x1_ptr", "act_ptr", "D", "DP", "FFN", "EPS", "GU_ROWS", "GU_RB",
            "BK", "STAGES", "GU_WAIT")
    CONSTEXPRS = {"GU_ROWS": lambda lay: lay.tiling.gu_rows,
                  "GU_RB": lambda lay: lay.tiling.rows_per_block(lay.cfg.d, 2, lay.tiling.gu_rows),
                  "GU_WAIT": lambda lay: int(bool(lay.tiling.wait_in & GateUp.WAIT_BIT) and lay.tiling.row_bytes > 0)}
    WAIT_INSIDE = "GU_WAIT"
    WAIT_BIT = 1
    device = gate_up_device

    SCRATCH = {"act": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"act": (lay.cfg.layers, lay.cfg.ffn)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return 2 * lay.tiling.gu_rows           # gate and up

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.gu_rows, lay.cfg.ffn))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.gu_rows, lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        d = lay.cfg.d
        return [Region("x1", self.layer * d, (self.layer + 1) * d)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = self.layer * lay.cfg.ffn
        return [Region("act", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        d = lay.cfg.d
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * 2 * (hi - lo) * d, l2_bytes=4 * d + 2 * d + 4 * (hi - lo),
                    flops=4 * (hi - lo) * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        x = st.buf["x1"].view(c.layers, c.d)[self.layer]
        nw = st.weights[self.layer]["post_norm"].float()
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        h = x * nw
        g = (st.weights[self.layer]["gate"][lo:hi].float() @ h) * rstd
        u = (st.weights[self.layer]["up"][lo:hi].float() @ h) * rstd
        st.buf["act"].view(c.layers, c.ffn)[self.layer, lo:hi] = torch.nn.functional.silu(g) * u
