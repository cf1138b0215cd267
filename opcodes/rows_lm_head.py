"""LM_HEAD_R: one tile of the final RMSNorm and LM head over every row (opcodes/rows.py).

    logits_r[v, n] = (lm_head[v, :] . bf16(xout_r[L-1, :, n] * final_norm)) * rstd[n]     v in [v0, v0 + LM_ROWS)

``bf16(xout_r[L-1] * final_norm)`` and the parts of ``sum(xout_r[L-1]^2)`` come built by the last layer's
RESIDUAL_R tiles (``hn_r[L]``, ``ss_r[L - 1]``: ``common_rows.store_normed``). Logits fp32, feature-major
``[vocab, ROWS]``: the host reads row n's logits as column n. A step whose ``rows`` buffer says no logits (a
prefill chunk before the prompt's last) returns at once: no LM head weights read. One that asks for one group of
16 columns (a prompt's last row: ``opcodes.rows.LOGIT_GROUP``) computes those alone, a dot of N 16 instead of the
block's NT, in the tiles of the group's column block (the other block's return at once); the weights are read
as before, the MMA work is 16 / NT of it (a 1B prompt's last 128-row chunk: 59 of 67 GFLOP spared). The decode
buckets (16 and 32 rows) compute every column in either mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common_rows import col_rstd, rows_stream
from .embed import Embed
from .lm_head import LMHead
from .rows import (DECODE_ROWS_MAX, LOGIT_GROUP_C, RowsInstruction, bf16_dot, bregion, bview, check_n0, col_rstd_r,
                   logit_columns)


@triton.jit
def lm_head_r_device(v0, n0, rows_ptr, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS: tl.constexpr,
                     D: tl.constexpr, VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, SS_P: tl.constexpr, SS_PP: tl.constexpr, ROWS: tl.constexpr,
                     NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    w = tl.load(rows_ptr + 1)           # 0: no logits (a prefill chunk before the prompt's last); 1: all;
    if w == 1:                          # 2 + k: column group k (never in the decode buckets: rows_state)
        _lm_head_r(v0, n0, 0, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS, D, VOCAB, EPS, LM_ROWS, BK, STAGES,
                   SS_P, SS_PP, ROWS, NT, NT, INTERP)
    if ROWS > DECODE_ROWS_MAX:          # (the decode buckets compile no group path: the 8B's 32-row one spilled)
        # the group's first column in this tile's block; a multiple of 16 (n0 is one of NT), which the compiler
        # must be told: unproven, the activation loads stay 2-byte scalars it will not pipeline (cp.async takes
        # >= 4), and each K block waited a full L2 round trip (v193, bench/notes/s53.md)
        c = tl.multiple_of((w - 2) * LOGIT_GROUP_C - n0, LOGIT_GROUP_C)
        if (w >= 2) & (c >= 0) & (c < NT):
            _lm_head_r(v0, n0, c, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS, D, VOCAB, EPS, LM_ROWS, BK,
                       STAGES, SS_P, SS_PP, ROWS, NT, LOGIT_GROUP_C, INTERP)


@triton.jit
def _lm_head_r(v0, n0, c, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS: tl.constexpr, D: tl.constexpr,
               VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, SS_P: tl.constexpr, SS_PP: tl.constexpr, ROWS: tl.constexpr,
               NT: tl.constexpr, N: tl.constexpr, INTERP: tl.constexpr):
    """Columns [c, c + N) of column block n0 (N: NT, or one 16-column group)."""
    rows = v0 + tl.arange(0, LM_ROWS)
    rm = rows < VOCAB
    acc, acc2 = rows_stream(lmh_ptr, rows, lmh_ptr, rows, rm, hn_r_ptr + LAYERS * (D * ROWS) + n0 * D + c,
                            0, N, NT, D, D, LM_ROWS, N, BK, STAGES, TWO=False,
                            EVEN=(D % BK == 0) & (VOCAB % LM_ROWS == 0), INTERP=INTERP)
    rstd = col_rstd(ss_r_ptr + (LAYERS - 1) * (SS_P * ROWS) + n0 * SS_P + c, SS_P, SS_PP, D, EPS, N, NT)
    n = c + tl.arange(0, N)
    tl.store(logits_r_ptr + n0 * VOCAB + rows[:, None].to(tl.int64) * NT + n[None, :],
             acc * rstd[None, :], mask=rm[:, None])


@register
@dataclass(frozen=True)
class LMHeadR(RowsInstruction):
    v0: int
    n0: int = 0       # the column block (opcodes.rows)

    NAME = "lm_head_r"
    STAGE = 6
    ARGS = ("rows_ptr", "hn_r_ptr", "ss_r_ptr", "lmh_ptr", "logits_r_ptr", "LAYERS", "D", "VOCAB", "EPS", "LM_ROWS",
            "BK", "STAGES", "SS_P", "SS_PP", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"VOCAB": Embed.CONSTEXPRS["VOCAB"], "LM_ROWS": LMHead.CONSTEXPRS["LM_ROWS"]}
    SCRATCH = {"logits_r": "fp32"}
    device = lm_head_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"logits_r": (lay.cfg.vocab, lay.rows)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.lm_rows

    def check_operands(self, lay: Layout) -> list[str]:
        return tile_start("v0", self.v0, lay.lm_rows, lay.cfg.vocab) + check_n0(self.n0, lay)

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.v0, min(self.v0 + lay.lm_rows, lay.cfg.vocab)

    def reads(self, lay: Layout) -> list[Region]:
        c, L, p = lay.cfg, lay.cfg.layers, lay.ss_parts[1]
        return [bregion("hn_r", lay, c.d, L, 0, c.d, self.n0), bregion("ss_r", lay, p, L - 1, 0, p, self.n0)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return [bregion("logits_r", lay, lay.cfg.vocab, 0, lo, hi, self.n0)]

    def cost(self, lay: Layout) -> Cost:
        d, R = lay.cfg.d, lay.n_tile
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * d, l2_bytes=2 * d * R + 4 * (hi - lo) * R, flops=2 * (hi - lo) * d * R)

    def run_torch(self, lay: Layout, st) -> None:
        cols = [n - self.n0 for n in logit_columns(st, lay.rows) if self.n0 <= n < self.n0 + lay.n_tile]
        if not cols:
            return
        c, b, p = lay.cfg, self.n0 // lay.n_tile, lay.ss_parts[1]
        lo, hi = self._rows(lay)
        n = slice(cols[0], cols[-1] + 1)
        xb = bview(st.buf["hn_r"], lay, c.d, c.layers + 1)[c.layers, b][:, n]
        rstd = col_rstd_r(bview(st.buf["ss_r"], lay, p, c.layers)[c.layers - 1, b][:, n], p, c.d, c.eps, lay.n_tile)
        bview(st.buf["logits_r"], lay, c.vocab)[b, lo:hi, n] = bf16_dot(st.model["lm_head"][lo:hi], xb) * rstd[None, :]
