"""LM_HEAD: one row tile of the logits, with the final RMSNorm fused in (like GATE_UP's).

    h         = x * rsqrt(mean(x^2) + eps) * final_norm      x: the last layer's output (bf16)
    logits[r] = lm_head[r, :] . h            for the tile's LM_ROWS vocabulary rows r (fp32)
    amax[t]   = (max of the tile's logits, lowest row index attaining it)

The per-tile (max, argmax) partial lets ARGMAX reduce ``vocab / LM_ROWS`` pairs instead of the
whole vocabulary. ``x`` is the last layer's RESIDUAL output (the call's ``out_ptr``); the tiles
wait on the last layer's ``out`` counter (``lower(..., signal_last=True)``).
The tiles cover the layout's ``lm_vocab`` rows (kernel constexpr ``LM_VOCAB``, the device
function's ``VOCAB``): the whole vocabulary on one GPU; in a tensor-parallel decoder
(``opcodes.tp.TPDecoderLayout``) the rank's vocabulary slice, its ``lm_head`` shard's rows, so
``logits`` and the partials' indices are local to the slice (TP_ARGMAX_PUSH / TP_ARGMAX make them
global: ``opcodes/tp_argmax.py``).
Streams ``LM_ROWS * d * 2`` bytes of ``lm_head`` (which may be the embedding table: tied).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, register, tile_start
from .common import gemv_stream, row_loop_dot, row_loop_store, row_loop_vec


@triton.jit
def lm_head_device(row0, out_ptr, fnorm_ptr, lmh_ptr, logits_ptr, amax_ptr,
                   D: tl.constexpr, DP: tl.constexpr, VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr,
                   LM_RB: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, WARP_ROWS: tl.constexpr,
                   INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, LM_ROWS)
    rm = rows < VOCAB
    if LM_RB == 0:
        rows64 = rows.to(tl.int64)                 # vocab x d elements can pass 2^31
        acc, _, ss = gemv_stream(lmh_ptr, rows64, lmh_ptr, rows64, rm, out_ptr, fnorm_ptr, 0, D, D, LM_ROWS, BK,
                                 STAGES, TWO=False, NORM=True, EVEN=(D % BK == 0) and (VOCAB % LM_ROWS == 0))
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
        y = tl.sum(acc, axis=1) * rstd
        tl.store(logits_ptr + rows, y, mask=rm)
    else:
        y = _lm_rows(row0, out_ptr, fnorm_ptr, lmh_ptr, logits_ptr, D, DP, VOCAB, EPS, LM_ROWS, LM_RB, STAGES,
                     WARP_ROWS, INTERP)
    _lm_tile_max(y, rows, rm, row0, amax_ptr, VOCAB, LM_ROWS)


@triton.jit
def _lm_tile_max(y, rows, rm, row0, amax_ptr, VOCAB: tl.constexpr, LM_ROWS: tl.constexpr):
    # the tile's (max, lowest index attaining it); the index is exact in fp32 below 2^24
    yv = tl.where(rm, y, float("-inf"))
    m = tl.max(yv, axis=0)
    idx = tl.min(tl.where(yv == m, rows, VOCAB), axis=0)
    t = row0 // LM_ROWS
    tl.store(amax_ptr + 2 * t, m)
    tl.store(amax_ptr + 2 * t + 1, idx.to(tl.float32))


@triton.jit
def _lm_rows(row0, out_ptr, fnorm_ptr, lmh_ptr, logits_ptr, D: tl.constexpr, DP: tl.constexpr,
             VOCAB: tl.constexpr, EPS: tl.constexpr, LM_ROWS: tl.constexpr, LM_RB: tl.constexpr, STAGES: tl.constexpr,
             WARP_ROWS: tl.constexpr, INTERP: tl.constexpr):
    # whole rows, LM_RB per pipeline stage (Tiling.row_bytes); WARP_ROWS: each row summed inside one
    # warp (Tiling.warp_rows). Returns the tile's logits, read back for its (max, argmax).
    hv, rstd = row_loop_vec(out_ptr, fnorm_ptr, D, DP, EPS, WARP_ROWS)
    EVEN: tl.constexpr = (D == DP) and (VOCAB % LM_ROWS == 0)
    for b in tl.range(0, LM_ROWS // LM_RB, num_stages=STAGES):
        r = row0 + b * LM_RB + tl.arange(0, LM_RB)
        m = r < VOCAB
        row_loop_store(logits_ptr + r, row_loop_dot(lmh_ptr, r.to(tl.int64), m, hv, D, DP, EVEN, WARP_ROWS) * rstd, m,
                       WARP_ROWS, INTERP)
    tl.debug_barrier()                         # this CTA's stores, visible to all its threads
    rows = row0 + tl.arange(0, LM_ROWS)
    return tl.load(logits_ptr + rows, mask=rows < VOCAB, other=0.0)


def tile_argmax(y: torch.Tensor, row0: int, vocab: int) -> tuple[float, int]:
    """(max, lowest index attaining it) of a tile's fp32 logits, as the device function computes
    it (``vocab`` when nothing equals the max: NaN logits)."""
    m = torch.max(y)
    hit = torch.nonzero(y == m)
    return float(m), (row0 + int(hit[0, 0])) if len(hit) else vocab


@register
@dataclass(frozen=True)
class LMHead(Instruction):
    row0: int

    NAME = "lm_head"
    STAGE = 7
    # the device function's VOCAB parameter is LM_VOCAB, the rows of this program's LM head (on one
    # GPU the vocabulary: the same value as VOCAB)
    ARGS = ("out_ptr", "fnorm_ptr", "lmh_ptr", "logits_ptr", "amax_ptr", "D", "DP", "LM_VOCAB", "EPS", "LM_ROWS",
            "LM_RB", "BK", "STAGES", "WARP_ROWS", "INTERP")
    # the branch is in every kernel; on a layout without a vocabulary it is never taken and is
    # compiled at the smallest tile
    CONSTEXPRS = {"VOCAB": lambda lay: max(1, lay.cfg.vocab),
                  "LM_VOCAB": lambda lay: lay.lm_vocab if LMHead.applies(lay) else max(1, lay.cfg.vocab),
                  "LM_ROWS": lambda lay: lay.lm_rows if LMHead.applies(lay) else 16,
                  "LM_RB": lambda lay: lay.tiling.rows_per_block(lay.cfg.d, 1, lay.lm_rows if LMHead.applies(lay)
                                                                 else 16)}
    WHOLE_MODEL = True
    device = lm_head_device

    # fp32 logits (what decode_step returns) and per tile [max logit, its index as fp32 (exact below 2^24)]
    SCRATCH = {"logits": "fp32", "amax": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"logits": (lay.lm_vocab,), "amax": (lay.n_lm_tiles, 2)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.lm_rows

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return ["lm_head needs a DecoderLayout (opcodes.decoder)"]
        return tile_start("row0", self.row0, lay.lm_rows, lay.lm_vocab)

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.lm_rows, lay.lm_vocab)

    def reads(self, lay: Layout) -> list[Region]:
        d, L = lay.cfg.d, lay.cfg.layers
        r = lay.xout_row(L - 1)
        return [Region("xout", r * d, (r + 1) * d)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        t = self.row0 // lay.lm_rows
        return [Region("logits", lo, hi), Region("amax", 2 * t, 2 * t + 2)]

    def cost(self, lay: Layout) -> Cost:
        d = lay.cfg.d
        lo, hi = self._rows(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * d, l2_bytes=2 * d + 2 * d + 4 * (hi - lo) + 8,
                    flops=2 * (hi - lo) * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        x = st.buf["xout"].view(-1, c.d)[lay.xout_row(c.layers - 1)].float()
        nw = st.model["final_norm"].float()
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        y = (st.model["lm_head"][lo:hi].float() @ (x * nw)) * rstd
        st.buf["logits"][lo:hi] = y
        m, idx = tile_argmax(y, lo, lay.lm_vocab)
        t = self.row0 // lay.lm_rows
        st.buf["amax"][2 * t] = m
        st.buf["amax"][2 * t + 1] = float(idx)
