"""LM_HEAD_R: one tile of the final RMSNorm and LM head over every row (opcodes/rows.py).

    logits_r[v, n] = (lm_head[v, :] . bf16(xout_r[L-1, :, n] * final_norm)) * rstd[n]     v in [v0, v0 + LM_ROWS)

``bf16(xout_r[L-1] * final_norm)`` and the parts of ``sum(xout_r[L-1]^2)`` come built by the last layer's
RESIDUAL_R tiles (``hn_r[L]``, ``ss_r[L - 1]``: ``common_rows.store_normed``). Logits fp32, feature-major ``[vocab, ROWS]``: the host reads row n's logits as column n. A step whose ``rows``
buffer says no logits (a prefill chunk before the prompt's last) returns at once: no LM head weights read.
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
from .rows import RowsInstruction, bf16_dot, col_rstd_r, wants_logits


@triton.jit
def lm_head_r_device(v0, rows_ptr, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS: tl.constexpr,
                     D: tl.constexpr, VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr, BK: tl.constexpr,
                     STAGES: tl.constexpr, SS_P: tl.constexpr, SS_PP: tl.constexpr, ROWS: tl.constexpr,
                     INTERP: tl.constexpr):
    if tl.load(rows_ptr + 1) != 0:     # the step wants logits (not a prefill chunk before the prompt's last)
        _lm_head_r(v0, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS, D, VOCAB, EPS, LM_ROWS, BK, STAGES, SS_P,
                   SS_PP, ROWS, INTERP)


@triton.jit
def _lm_head_r(v0, hn_r_ptr, ss_r_ptr, lmh_ptr, logits_r_ptr, LAYERS: tl.constexpr, D: tl.constexpr,
               VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, SS_P: tl.constexpr, SS_PP: tl.constexpr, ROWS: tl.constexpr,
               INTERP: tl.constexpr):
    rows = v0 + tl.arange(0, LM_ROWS)
    rm = rows < VOCAB
    acc, acc2 = rows_stream(lmh_ptr, rows, lmh_ptr, rows, rm, hn_r_ptr + LAYERS * (D * ROWS),
                            0, ROWS, ROWS, D, D, LM_ROWS, ROWS, BK, STAGES, TWO=False,
                            EVEN=(D % BK == 0) & (VOCAB % LM_ROWS == 0), INTERP=INTERP)
    rstd = col_rstd(ss_r_ptr + (LAYERS - 1) * (SS_P * ROWS), SS_P, SS_PP, D, EPS, ROWS)
    n = tl.arange(0, ROWS)
    tl.store(logits_r_ptr + rows[:, None].to(tl.int64) * ROWS + n[None, :], acc * rstd[None, :], mask=rm[:, None])


@register
@dataclass(frozen=True)
class LMHeadR(RowsInstruction):
    v0: int

    NAME = "lm_head_r"
    STAGE = 6
    ARGS = ("rows_ptr", "hn_r_ptr", "ss_r_ptr", "lmh_ptr", "logits_r_ptr", "LAYERS", "D", "VOCAB", "EPS", "LM_ROWS",
            "BK", "STAGES", "SS_P", "SS_PP", "ROWS", "INTERP")
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
        return tile_start("v0", self.v0, lay.lm_rows, lay.cfg.vocab)

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.v0, min(self.v0 + lay.lm_rows, lay.cfg.vocab)

    def reads(self, lay: Layout) -> list[Region]:
        c, R, L = lay.cfg, lay.rows, lay.cfg.layers
        p = lay.ss_parts[1]
        return [Region("hn_r", L * c.d * R, (L + 1) * c.d * R), Region("ss_r", (L - 1) * p * R, L * p * R)]

    def writes(self, lay: Layout) -> list[Region]:
        R = lay.rows
        lo, hi = self._rows(lay)
        return [Region("logits_r", lo * R, hi * R)]

    def cost(self, lay: Layout) -> Cost:
        d, R = lay.cfg.d, lay.rows
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * d, l2_bytes=2 * d * R + 4 * (hi - lo) * R, flops=2 * (hi - lo) * d * R)

    def run_torch(self, lay: Layout, st) -> None:
        if not wants_logits(st):
            return
        c, R = lay.cfg, lay.rows
        lo, hi = self._rows(lay)
        xb = st.buf["hn_r"].view(c.layers + 1, c.d, R)[c.layers]
        rstd = col_rstd_r(st.buf["ss_r"].view(c.layers, -1, R)[c.layers - 1], lay.ss_parts[1], c.d, c.eps)
        st.buf["logits_r"].view(c.vocab, R)[lo:hi] = bf16_dot(st.model["lm_head"][lo:hi], xb) * rstd[None, :]
