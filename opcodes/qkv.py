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
from .tiling import next_pow2
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
                NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr, INTERP: tl.constexpr, mask=None):
    """RoPE on (q, k) dims ``dims`` of both halves of the head, then q -> scratch, k / v -> cache row ``pos``.
    ``head``: the head, or each lane's (a run of pairs); ``mask``: the lanes that store (None: all)."""
    rot = sec < 2
    c = tl.load(cos_ptr + pos * (HD // 2) + dims)
    s = tl.load(sin_ptr + pos * (HD // 2) + dims)
    c = tl.where(rot, c, 1.0)
    s = tl.where(rot, s, 0.0)
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if sec == 0:
        qb = q_ptr + layer * (NQ * HD) + head * HD
        tl.store(qb + dims, o1, mask=mask)
        tl.store(qb + HD // 2 + dims, o2, mask=mask)
    else:
        if sec == 1:
            cb = kc_ptr + tab_offset(wtab_ptr, layer, T_KC)
        else:
            cb = vc_ptr + tab_offset(wtab_ptr, layer, T_VC)
        cb = cb + head * (MAX_SEQ * HD) + pos * HD
        tl.store(cb + dims, to_bf16(o1, INTERP), mask=mask)
        tl.store(cb + HD // 2 + dims, to_bf16(o2, INTERP), mask=mask)


@triton.jit
def _qkv_rows(w_ptr, xin, nw_ptr, rows1, rows2, layer, x1_ptr, dpart_ptr, D: tl.constexpr, EPS: tl.constexpr,
              M: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
              RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    """(y1, y2): rows ``rows1`` and ``rows2`` ([M] each) of the weights at ``w_ptr`` dotted with the layer input
    ``xin``, RMSNorm'ed by ``nw_ptr`` (the norm's scale applied after the dot)."""
    if RES_FOLD:
        if layer > 0:
            # the previous layer's RESIDUAL, folded in: x = bf16(x1 + dpart[0] + ...), as RESIDUAL rounds it
            acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, x1_ptr + (layer - 1) * D, nw_ptr, 0, D,
                                         D, M, BK, STAGES, TWO=True, NORM=True, EVEN=(D % BK == 0),
                                         xp_ptr=dpart_ptr + (layer - 1) * DOWN_CHUNKS * D, XP=DOWN_CHUNKS,
                                         INTERP=INTERP)
        else:
            acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, xin, nw_ptr, 0, D, D, M, BK,
                                         STAGES, TWO=True, NORM=True, EVEN=(D % BK == 0))
    else:
        acc1, acc2, ss = gemv_stream(w_ptr, rows1, w_ptr, rows2, rows1 >= 0, xin, nw_ptr, 0, D, D, M, BK, STAGES,
                                     TWO=True, NORM=True, EVEN=(D % BK == 0))
    rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=0) / D + EPS)
    return tl.sum(acc1, axis=1) * rstd, tl.sum(acc2, axis=1) * rstd


@triton.jit
def _qkv_pairs(layer, sec, head, j, n, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
               wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
               D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr,
               EPS: tl.constexpr, NP: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr, INTERP: tl.constexpr):
    """``Tiling.qkv_pairs``: the ``n`` (<= NP) RoPE pairs from pair ``head * HD/2 + j`` of section ``sec``, which
    may run into the next head of the same KV group; each pair's rows are summed by ``_qkv_tile``'s code (the
    lanes past ``n`` repeat the first pair's rows and store nothing)."""
    H2: tl.constexpr = HD // 2
    w_ptr = section_weights(layer, sec, wtab_ptr, wq_ptr, wk_ptr, wv_ptr)
    xin = layer_input(x_ptr, xout_ptr, layer, D)
    nw_ptr = n1_ptr + tab_offset(wtab_ptr, layer, T_N1)
    i = tl.arange(0, NP)
    live = i < n
    pr = head * H2 + j + tl.where(live, i, 0)                  # the pair of each lane (its section's numbering)
    ph = pr // H2                                             # its head
    dims = pr % H2
    rows1 = ph * HD + dims
    y1, y2 = _qkv_rows(w_ptr, xin, nw_ptr, rows1, rows1 + H2, layer, x1_ptr, dpart_ptr, D, EPS, NP, BK, STAGES,
                       DOWN_CHUNKS, RES_FOLD, INTERP)
    _rope_store(y1, y2, dims, layer, sec, ph, pos, wtab_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
                NQ, HD, MAX_SEQ, INTERP, mask=live)


@triton.jit
def qkv_device(layer, sec, head, j, n, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
               wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
               D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr,
               EPS: tl.constexpr, QKV_ROWS: tl.constexpr, KV_ROWS: tl.constexpr, QKV_PAIRS: tl.constexpr,
               BK: tl.constexpr, STAGES: tl.constexpr, DOWN_CHUNKS: tl.constexpr, RES_FOLD: tl.constexpr,
               INTERP: tl.constexpr):
    if QKV_PAIRS > 0:
        _qkv_pairs(layer, sec, head, j, n, pos, x_ptr, xout_ptr, x1_ptr, dpart_ptr, wtab_ptr, n1_ptr, wq_ptr, wk_ptr,
                   wv_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr, D, NQ, HD, MAX_SEQ, EPS, QKV_PAIRS, BK, STAGES,
                   DOWN_CHUNKS, RES_FOLD, INTERP)
    elif KV_ROWS == QKV_ROWS:
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
    y1, y2 = _qkv_rows(w_ptr, xin, nw_ptr, rows1, rows2, layer, x1_ptr, dpart_ptr, D, EPS, HALF, BK, STAGES,
                       DOWN_CHUNKS, RES_FOLD, INTERP)
    _rope_store(y1, y2, dims, layer, sec, head, pos, wtab_ptr, kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_ptr,
                NQ, HD, MAX_SEQ, INTERP)


@register
@dataclass(frozen=True)
class QKV(Instruction):
    layer: int
    sec: int      # 0: q, 1: k, 2: v
    head: int     # query head (sec 0) or KV head (sec 1, 2)
    j: int        # which QKV_ROWS/2-wide (K and V: KV_ROWS/2-wide) block of the half-head; with n: the first pair's dim
    # > 0 (Tiling.qkv_pairs): n RoPE pairs from pair head * hd/2 + j of the section, into the next heads of the
    # same KV group (QKV.pair_spans); 0: the QKV_ROWS / KV_ROWS tile (head, j)
    n: int = 0

    NAME = "qkv"
    STAGE = 0
    ARGS = ("pos", "x_ptr", "xout_ptr", "x1_ptr", "dpart_ptr", "wtab_ptr", "n1_ptr", "wq_ptr", "wk_ptr", "wv_ptr",
            "kc_ptr", "vc_ptr", "cos_ptr", "sin_ptr", "q_ptr",
            "D", "NQ", "HD", "MAX_SEQ", "EPS", "QKV_ROWS", "KV_ROWS", "QKV_PAIRS", "BK", "STAGES", "DOWN_CHUNKS",
            "RES_FOLD", "INTERP")
    CONSTEXPRS = {"QKV_ROWS": lambda lay: lay.tiling.qkv_rows, "KV_ROWS": lambda lay: lay.kv_rows,
                  # a pairs tile's lanes (Tiling.qkv_pairs, padded to a power of two); 0: the (head, j) tiles
                  "QKV_PAIRS": lambda lay: next_pow2(lay.tiling.qkv_pairs) if lay.tiling.qkv_pairs else 0}
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
        return 2 * cls.CONSTEXPRS["QKV_PAIRS"](lay) or lay.tiling.qkv_rows

    @classmethod
    def tiles(cls, lay: Layout, sec: int, g: int) -> list[tuple[int, int, int]]:
        """Section ``sec``'s tiles of KV group ``g`` as (head, j, n) operands, in tape order: with
        ``Tiling.qkv_pairs`` its runs of pairs (:meth:`pair_spans`), else each head's ``n_tiles_per_head``
        blocks (q: the group's heads; k, v: head g)."""
        if lay.tiling.qkv_pairs:
            return cls.pair_spans(lay, sec, g)
        heads = range(g * lay.cfg.group, (g + 1) * lay.cfg.group) if sec == 0 else (g,)
        return [(h, j, 0) for h in heads for j in range(lay.n_tiles_per_head(sec))]

    @staticmethod
    def pair_spans(lay: Layout, sec: int, g: int) -> list[tuple[int, int, int]]:
        """``Tiling.qkv_pairs`` = P: section ``sec``'s RoPE pairs of KV group ``g`` (q: its ``group`` heads;
        k, v: head g) as (head, j, n) operands, ``ceil(pairs / P)`` tiles as equal as whole pairs allow, the
        larger first (the 1B at P = 13: q 10 tiles of 12-13 pairs a group, k and v 3 of 10-11: 128 tiles
        a layer, not 96 of 16; bench/notes/s43.md v170)."""
        c, p = lay.cfg, lay.tiling.qkv_pairs
        h2 = c.hd // 2
        heads = c.group if sec == 0 else 1
        first = (g * c.group if sec == 0 else g) * h2
        total = heads * h2
        n_t = -(-total // p)
        q, extra = divmod(total, n_t)
        out, pr = [], first
        for t in range(n_t):
            n = q + (t < extra)
            out.append((pr // h2, pr % h2, n))
            pr += n
        return out

    def _pairs(self, lay: Layout) -> list[int]:
        """The section's pair numbers this tile covers."""
        if self.n:
            p0 = self.head * (lay.cfg.hd // 2) + self.j
            return list(range(p0, p0 + self.n))
        lo, hi = self._dims(lay)
        return [self.head * (lay.cfg.hd // 2) + d for d in range(lo, hi)]

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if self.n:
            h2, p = c.hd // 2, lay.tiling.qkv_pairs
            nh = c.n_q if self.sec == 0 else c.n_kv
            if not p:
                return [f"n {self.n}: a tile of RoPE pairs needs Tiling.qkv_pairs"]
            if not 0 <= self.layer < c.layers:
                bad.append(f"layer {self.layer} not in [0, {c.layers})")
            if self.sec not in (0, 1, 2):
                return bad + [f"sec {self.sec} not in (0, 1, 2)"]
            if not 0 <= self.head < nh or not 0 <= self.j < h2:
                return bad + [f"head {self.head} / j {self.j}: the first pair not in [0, {nh}) x [0, {h2})"]
            if not 0 < self.n <= p:
                bad.append(f"n {self.n} not in (0, qkv_pairs = {p}]")
            per = c.group if self.sec == 0 else 1           # heads of one KV group in this section
            last = (self.head * h2 + self.j + self.n - 1) // h2
            if last // per != self.head // per:
                bad.append(f"pairs {self.head * h2 + self.j} .. {self.head * h2 + self.j + self.n - 1} of section "
                           f"{self.sec} leave KV group {self.head // per} (a tile signals one group's counter)")
            return bad
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
        if self.n:          # a run of pairs a head it touches, both halves
            h2, out = c.hd // 2, []
            ps = self._pairs(lay)
            for h in sorted({p // h2 for p in ps}):
                lo = min(p for p in ps if p // h2 == h) % h2
                hi = max(p for p in ps if p // h2 == h) % h2 + 1
                base = self.layer * width + h * c.hd
                out += [Region(buf, base + lo, base + hi), Region(buf, base + h2 + lo, base + h2 + hi)]
            return out
        base = self.layer * width + self.head * c.hd
        lo, hi = self._dims(lay)
        return [Region(buf, base + lo, base + hi), Region(buf, base + c.hd // 2 + lo, base + c.hd // 2 + hi)]

    def reads(self, lay: Layout) -> list[Region]:
        return lay.input_regions(self.layer, 0, lay.cfg.d)

    def cost(self, lay: Layout) -> Cost:
        d, rows = lay.cfg.d, (2 * self.n or lay.section_rows(self.sec))
        return Cost(hbm_bytes=2 * rows * d, l2_bytes=2 * 2 * d + 4 * rows, flops=2 * rows * d)

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        h2 = c.hd // 2
        x = st.layer_input(self.layer).float()
        w = st.weights[self.layer][SECTIONS[self.sec]]
        nw = st.weights[self.layer]["in_norm"].float()
        ps = torch.tensor(self._pairs(lay))
        heads, dims = ps // h2, ps % h2
        rows1 = heads * c.hd + dims
        rows2 = rows1 + h2
        h = x * nw
        rstd = torch.rsqrt((x * x).sum() / c.d + c.eps)
        y1 = (w[rows1].float() @ h) * rstd
        y2 = (w[rows2].float() @ h) * rstd
        if self.sec < 2:
            cos, sin = st.tables["cos_ptr"][st.pos, dims], st.tables["sin_ptr"][st.pos, dims]
            y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
        if self.sec == 0:
            q = st.buf["q"].view(c.layers, c.n_q, c.hd)
            q[self.layer, heads, dims] = y1
            q[self.layer, heads, h2 + dims] = y2
        else:
            cache = st.kv[self.layer][self.sec - 1]
            cache[0, heads, st.pos, dims] = y1.to(torch.bfloat16)
            cache[0, heads, st.pos, h2 + dims] = y2.to(torch.bfloat16)
