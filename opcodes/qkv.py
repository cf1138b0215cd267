"""QKV: one tile of the fused Q/K/V projection, with RMSNorm, RoPE and the KV append fused in.

    h      = x * rsqrt(mean(x^2) + eps) * in_norm           (fp32, the scale applied at the end)
    y[r]   = W[r, :] . h          for the tile's rows r of Wq, Wk or Wv
    q/k    = rope(y, pos)         rotate_half, fp32 cos/sin
    q -> q scratch (fp32);  k, v -> kv_cache[layer][:, head, pos] (bf16, in place)

A tile covers ``QKV_ROWS`` rows of one head: ``QKV_ROWS/2`` dims ``[j*H, (j+1)*H)`` of the first
half of the head and the same dims of the second half, so each RoPE pair lives in one tile.
The tile reads ``QKV_ROWS * d * 2`` bytes of weights; x and in_norm (2 x 2d bytes) come from L2.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, register
from .reference import rope_tables
from .common import T_KC, T_N1, T_VC, T_WK, T_WQ, T_WV, gemv_stream, layer_input, tab_offset, to_bf16

SECTIONS = ("q", "k", "v")


@triton.jit
def section_weights(layer, sec, wtab_ptr, wq_ptr, wk_ptr, wv_ptr):
    """Wq, Wk or Wv (``sec`` 0, 1, 2) of ``layer``."""
    if sec == 0:
        w_ptr = wq_ptr + tab_offset(wtab_ptr, layer, T_WQ)
    elif sec == 1:
        w_ptr = wk_ptr + tab_offset(wtab_ptr, layer, T_WK)
    else:
        w_ptr = wv_ptr + tab_offset(wtab_ptr, layer, T_WV)
    return w_ptr


@triton.jit
def _rope_store(y1, y2, dims, layer, sec, head, pos, wtab_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
                NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr, INTERP: tl.constexpr):
    """RoPE on (q, k) dims ``dims`` of both halves of the head, then q -> scratch, k / v -> cache row ``pos``."""
    rot = sec < 2
    c = tl.load(cos_ptr + pos * (HD // 2) + dims)
    s = tl.load(sin_ptr + pos * (HD // 2) + dims)
    c = tl.where(rot, c, 1.0)
    s = tl.where(rot, s, 0.0)
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if sec == 0:
        qb = q_ptr + layer * (NQ * HD) + head * HD
        tl.store(qb + dims, o1)
        tl.store(qb + HD // 2 + dims, o2)
    else:
        if sec == 1:
            cb = kc_ptr + tab_offset(wtab_ptr, layer, T_KC)
        else:
            cb = vc_ptr + tab_offset(wtab_ptr, layer, T_VC)
        cb = cb + head * (MAX_SEQ * HD) + pos * HD
        tl.store(cb + dims, to_bf16(o1, INTERP))
        tl.store(cb + HD // 2 + dims, to_bf16(o2, INTERP))


@triton.jit
def qkv_device(layer, sec, head, j, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr, wv_ptr,
               kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
               D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr,
               EPS: tl.constexpr, QKV_ROWS: tl.constexpr, KV_ROWS: tl.constexpr, BK: tl.constexpr,
               STAGES: tl.constexpr, DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    if KV_ROWS == QKV_ROWS:
        _qkv_tile(layer, sec, head, j, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
                  wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, D, NQ, HD, MAX_SEQ, EPS, QKV_ROWS, BK, STAGES,
                  DOWN_CHUNKS, RES_FOLD, INTERP)
    elif sec == 0:
        _qkv_tile(layer, sec, head, j, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
                  wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, D, NQ, HD, MAX_SEQ, EPS, QKV_ROWS, BK, STAGES,
                  DOWN_CHUNKS, RES_FOLD, INTERP)
    else:
        _qkv_tile(layer, sec, head, j, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
                  wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, D, NQ, HD, MAX_SEQ, EPS, KV_ROWS, BK, STAGES,
                  DOWN_CHUNKS, RES_FOLD, INTERP)


@triton.jit
def _qkv_tile(layer, sec, head, j, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr, wv_ptr,
              kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
              D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr,
              EPS: tl.constexpr, QKV_ROWS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
              DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    """One tile of ``QKV_ROWS`` rows (the Q tiles' ``Tiling.qkv_rows`` or the K/V tiles' ``kv_rows``)."""
    HALF: tl.constexpr = QKV_ROWS // 2
    w_ptr = section_weights(layer, sec, wtab_ptr, wq_ptr, wk_ptr, wv_ptr)
    xin = layer_input(x_ptr, xout_ptr, layer, D)
    nw_ptr = n1_ptr + tab_offset(wtab_ptr, layer, T_N1)
    dims = j * HALF + tl.arange(0, HALF)                       # [HALF] in [0, HD/2)
    rows1 = head * HD + dims
    rows2 = rows1 + HD // 2
    if RES_FOLD:
        if layer > 0:
            # the previous layer's RESIDUAL, folded in: x = bf16(x1 + dpart[0] + ...), as RESIDUAL rounds it
            acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, x1_ptr + (layer - 1) * D, nw_ptr, 0, D,
                                         D, HALF, BK, STAGES, TWO=True, NORM=True, EVEN=(D % BK == 0),
                                         xp_ptr=dpart_ptr + (layer - 1) * DOWN_CHUNKS * D, XP=DOWN_CHUNKS,
                                         INTERP=INTERP)
        else:
            acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, xin, nw_ptr, 0, D, D, HALF, BK,
                                         STAGES, TWO=True, NORM=True, EVEN=(D % BK == 0))
    else:
        acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, xin, nw_ptr, 0, D, D, HALF, BK, STAGES,
                                     TWO=True, NORM=True, EVEN=(D % BK == 0))
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
    y1 = tl.sum(acc1, axis=1) * rstd
    y2 = tl.sum(acc2, axis=1) * rstd
    _rope_store(y1, y2, dims, layer, sec, head, pos, wtab_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
                NQ, HD, MAX_SEQ, INTERP)


@register
@dataclass(frozen=True)
class QKV(Instruction):
    layer: int
    sec: int      # 0: q, 1: k, 2: v
    head: int     # query head (sec 0) or KV head (sec 1, 2)
    j: int        # which QKV_ROWS/2-wide (K and V: KV_ROWS/2-wide) block of the half-head

    NAME = "qkv"
    STAGE = 0
    ARGS = ("pos", "x_ptr", "xout_ptr", "x1_ptr", "dpart_ptr", "wtab_ptr", "n1_ptr", "wq_ptr", "wk_ptr", "wv_ptr",
            "kc_ptr", "vc_ptr", "cos_ptr", "sin_ptr", "q_ptr",
            "D", "NQ", "HD", "MAX_SEQ", "EPS", "QKV_ROWS", "KV_ROWS", "BK", "STAGES", "DOWN_CHUNKS", "RES_FOLD",
            "INTERP")
    CONSTEXPRS = {"QKV_ROWS": lambda lay: lay.tiling.qkv_rows, "KV_ROWS": lambda lay: lay.kv_rows}
    TABLES = {"cos_ptr": "fp32", "sin_ptr": "fp32"}
    # the new K/V rows live in the caller's cache (row ``pos``): tracked by the verifier, not allocated
    VIRTUAL = ("kv_new_k", "kv_new_v")
    device = qkv_device

    SCRATCH = {"q": "fp32", "kv_new_k": "bf16", "kv_new_v": "bf16"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c = lay.cfg
        return {"q": (c.layers, c.q_dim), "kv_new_k": (c.layers, c.kv_dim), "kv_new_v": (c.layers, c.kv_dim)}

    @classmethod
    def tables(cls, lay: Layout, device) -> dict:
        cos, sin = rope_tables(lay.cfg, lay.max_seq, device=device)
        return {"cos_ptr": cos, "sin_ptr": sin}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.qkv_rows

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if self.sec not in (0, 1, 2):
            bad.append(f"sec {self.sec} not in (0, 1, 2)")
        nh = c.n_q if self.sec == 0 else c.n_kv
        if not 0 <= self.head < nh:
            bad.append(f"head {self.head} not in [0, {nh})")
        if self.sec in (0, 1, 2) and not 0 <= self.j < lay.n_tiles_per_head(self.sec):
            bad.append(f"j {self.j} not in [0, {lay.n_tiles_per_head(self.sec)})")
        return bad

    def _dims(self, lay: Layout) -> tuple[int, int]:
        half = lay.section_rows(self.sec) // 2
        return self.j * half, (self.j + 1) * half

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        buf = ("q", "kv_new_k", "kv_new_v")[self.sec]
        width = c.q_dim if self.sec == 0 else c.kv_dim
        base = self.layer * width + self.head * c.hd
        lo, hi = self._dims(lay)
        return [Region(buf, base + lo, base + hi), Region(buf, base + c.hd // 2 + lo, base + c.hd // 2 + hi)]

    def reads(self, lay: Layout) -> list[Region]:
        return lay.input_regions(self.layer, 0, lay.cfg.d)

    def cost(self, lay: Layout) -> Cost:
        d, rows = lay.cfg.d, lay.section_rows(self.sec)
        return Cost(hbm_bytes=2 * rows * d, l2_bytes=2 * 2 * d + 4 * rows, flops=2 * rows * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        x = st.layer_input(self.layer).float()
        w = st.weights[self.layer][SECTIONS[self.sec]]
        nw = st.weights[self.layer]["in_norm"].float()
        lo, hi = self._dims(lay)
        dims = torch.arange(lo, hi)
        rows1 = self.head * c.hd + dims
        rows2 = rows1 + c.hd // 2
        h = x * nw
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        y1 = (w[rows1].float() @ h) * rstd
        y2 = (w[rows2].float() @ h) * rstd
        if self.sec < 2:
            cos, sin = st.tables["cos_ptr"][st.pos, lo:hi], st.tables["sin_ptr"][st.pos, lo:hi]
            y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
        if self.sec == 0:
            q = st.buf["q"].view(c.layers, c.n_q, c.hd)
            q[self.layer, self.head, lo:hi] = y1
            q[self.layer, self.head, c.hd // 2 + lo: c.hd // 2 + hi] = y2
        else:
            cache = st.kv[self.layer][self.sec - 1]
            cache[0, self.head, st.pos, lo:hi] = y1.to(torch.bfloat16)
            cache[0, self.head, st.pos, c.hd // 2 + lo: c.hd // 2 + hi] = y2.to(torch.bfloat16)
