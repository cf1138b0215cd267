"""QKV_R: one tile of the fused Q/K/V projection over every row of the step (opcodes/rows.py), with
RMSNorm, RoPE at each row's own position and the K/V append into each row's (slot, position).

    h[:, n]  = x[:, n] * in_norm,   rstd[n] = rsqrt(mean(x[:, n]^2) + eps)
    y[r, n]  = (W[r, :] . bf16(h[:, n])) * rstd[n]       for the tile's rows r of Wq, Wk or Wv

``bf16(h)`` and the parts of ``sum(x^2)`` come built by the layer input's producers (``hn_r[layer]`` and
EMBED_R's ``ss0_r``, or the previous layer's RESIDUAL_R's ``ss_r[layer - 1]``; ``common_rows.store_normed``).
    q/k      = rope(y[:, n], pos[n])
    q -> q_r[layer, :, n] (fp32);  k, v -> kv_cache[layer][slot[n], head, pos[n]] (bf16, in place)

As QKV, a tile covers ``QKV_ROWS`` rows of one head, ``QKV_ROWS/2`` dims of each RoPE half; it is one
``tl.dot`` tile of ``QKV_ROWS/2`` weight rows per half (``QKV_M``: at least 16, the rest masked) by
``ROWS`` columns (``opcodes.common_rows``), or, where a half is 32 rows or more, one dot of both halves'
rows (M 64 or more: Hopper's ``wgmma``, not two ``mma.sync``; runs 299-300: QKV -34% / -38% a tile) split
for RoPE after it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register
from .common import T_KC, T_VC, tab_offset, to_bf16
from .common_rows import col_rstd, rows_stream
from .qkv import QKV, SECTIONS, section_weights
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0, col_rstd_r, read_rows, row_meta


@triton.jit
def qkv_r_device(layer, sec, head, j, n0, rows_ptr, hn_r_ptr, ss0_r_ptr, ss_r_ptr, wtab_ptr, wq_ptr, wk_ptr, wv_ptr,
                 kc_ptr, vc_ptr, cos_ptr, sin_ptr, q_r_ptr,
                 D: tl.constexpr, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr, MAX_SEQ: tl.constexpr,
                 EPS: tl.constexpr, QKV_ROWS: tl.constexpr, QKV_M: tl.constexpr, BK: tl.constexpr,
                 STAGES: tl.constexpr, SS_P0: tl.constexpr, SS_P: tl.constexpr, SS_PP: tl.constexpr,
                 ROWS: tl.constexpr, NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    HALF: tl.constexpr = QKV_ROWS // 2
    w_ptr = section_weights(layer, sec, wtab_ptr, wq_ptr, wk_ptr, wv_ptr)
    xt = hn_r_ptr + layer * (D * ROWS) + n0 * D
    # QKV_M >= 16 rows a half (tl.dot's M): the HALF dims of the tile, the rest masked (hd < 32)
    dm = tl.arange(0, QKV_M) < HALF
    dims = j * HALF + tl.arange(0, QKV_M)
    rows1 = head * HD + dims
    rows2 = rows1 + HD // 2
    if QKV_M == HALF and QKV_M >= 32:
        # one dot of both halves' rows (M = 2 * HALF >= 64: a wgmma, not two mma.sync of M 32; bench/notes/s43.md
        # v165), its accumulator split into the halves for RoPE
        i = tl.arange(0, 2 * QKV_M)
        rows12 = head * HD + j * HALF + i % HALF + (i // HALF) * (HD // 2)
        acc, _ = rows_stream(w_ptr, rows12, w_ptr, rows12, i < 2 * QKV_M, xt, 0, NT, NT, D, D, 2 * QKV_M, NT,
                             BK, STAGES, TWO=False, EVEN=(D % BK == 0), INTERP=INTERP)
        acc1, acc2 = tl.split(tl.permute(tl.reshape(acc, [2, QKV_M, NT]), [1, 2, 0]))
    else:
        acc1, acc2 = rows_stream(w_ptr, rows1, w_ptr, rows2, dm, xt, 0, NT, NT, D, D, QKV_M, NT,
                                 BK, STAGES, TWO=True, EVEN=(D % BK == 0) & (QKV_M == HALF),
                                 INTERP=INTERP)
    if layer == 0:
        ss_ptr = ss0_r_ptr + n0 * SS_P0
    else:
        ss_ptr = ss_r_ptr + (layer - 1) * (SS_P * ROWS) + n0 * SS_P
    rstd = col_rstd(ss_ptr, tl.where(layer == 0, SS_P0, SS_P), SS_PP, D, EPS, NT)
    y1 = acc1 * rstd[None, :]
    y2 = acc2 * rstd[None, :]
    n = tl.arange(0, NT)
    live, slot, pos, tok = row_meta(rows_ptr, n0 + n, ROWS)
    rot = sec < 2
    c = tl.load(cos_ptr + pos[None, :] * (HD // 2) + dims[:, None], mask=dm[:, None], other=1.0)
    s = tl.load(sin_ptr + pos[None, :] * (HD // 2) + dims[:, None], mask=dm[:, None], other=0.0)
    c = tl.where(rot, c, 1.0)
    s = tl.where(rot, s, 0.0)
    o1 = y1 * c - y2 * s
    o2 = y2 * c + y1 * s
    if sec == 0:
        qb = q_r_ptr + layer * (NQ * HD * ROWS) + n0 * (NQ * HD)
        tl.store(qb + rows1[:, None] * NT + n[None, :], o1, mask=dm[:, None])
        tl.store(qb + rows2[:, None] * NT + n[None, :], o2, mask=dm[:, None])
    else:
        if sec == 1:
            cb = kc_ptr + tab_offset(wtab_ptr, layer, T_KC)
        else:
            cb = vc_ptr + tab_offset(wtab_ptr, layer, T_VC)
        off = slot.to(tl.int64) * (NKV * MAX_SEQ * HD) + head * (MAX_SEQ * HD) + pos.to(tl.int64) * HD
        m = dm[:, None] & live[None, :]
        tl.store(cb + off[None, :] + dims[:, None], to_bf16(o1, INTERP), mask=m)
        tl.store(cb + off[None, :] + (HD // 2) + dims[:, None], to_bf16(o2, INTERP), mask=m)


@register
@dataclass(frozen=True)
class QKVR(RowsInstruction):
    layer: int
    sec: int      # 0: q, 1: k, 2: v
    head: int     # query head (sec 0) or KV head (sec 1, 2)
    j: int        # which QKV_ROWS/2-wide block of the half-head
    n0: int = 0   # the column block (opcodes.rows)

    NAME = "qkv_r"
    STAGE = 0
    ARGS = ("rows_ptr", "hn_r_ptr", "ss0_r_ptr", "ss_r_ptr", "wtab_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "kc_ptr",
            "vc_ptr", "cos_ptr", "sin_ptr", "q_r_ptr",
            "D", "NQ", "NKV", "HD", "MAX_SEQ", "EPS", "QKV_ROWS", "QKV_M", "BK", "STAGES", "SS_P0", "SS_P", "SS_PP",
            "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"QKV_ROWS": QKV.CONSTEXPRS["QKV_ROWS"],
                  "QKV_M": lambda lay: max(16, lay.tiling.qkv_rows // 2)}   # tl.dot's M: >= 16
    TABLES = QKV.TABLES
    # the new K/V rows live in the caller's cache: tracked by the verifier as a whole layer's (a column block's),
    # not allocated
    VIRTUAL = ("kv_new_k_r", "kv_new_v_r")
    SCRATCH = {"q_r": "fp32", "kv_new_k_r": "bf16", "kv_new_v_r": "bf16"}
    device = qkv_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c = lay.cfg
        return {"q_r": (c.layers, c.q_dim, lay.rows), "kv_new_k_r": (c.layers, lay.n_blocks, c.kv_dim),
                "kv_new_v_r": (c.layers, lay.n_blocks, c.kv_dim)}

    @classmethod
    def tables(cls, lay: Layout, device) -> dict:
        return QKV.tables(lay, device)

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.qkv_rows

    def check_operands(self, lay: Layout) -> list[str]:
        return QKV(self.layer, self.sec, self.head, self.j).check_operands(lay) + check_n0(self.n0, lay)

    def _dims(self, lay: Layout) -> tuple[int, int]:
        half = lay.tiling.qkv_rows // 2
        return self.j * half, (self.j + 1) * half

    def writes(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        lo, hi = self._dims(lay)
        if self.sec == 0:
            h0 = self.head * c.hd
            return [bregion("q_r", lay, c.q_dim, self.layer, h0 + lo, h0 + hi, self.n0),
                    bregion("q_r", lay, c.q_dim, self.layer, h0 + c.hd // 2 + lo, h0 + c.hd // 2 + hi, self.n0)]
        buf = ("kv_new_k_r", "kv_new_v_r")[self.sec - 1]
        base = (self.layer * lay.n_blocks + self.n0 // lay.n_tile) * c.kv_dim + self.head * c.hd
        return [Region(buf, base + lo, base + hi), Region(buf, base + c.hd // 2 + lo, base + c.hd // 2 + hi)]

    def reads(self, lay: Layout) -> list[Region]:
        d, l = lay.cfg.d, self.layer
        p0, p, _ = lay.ss_parts
        ss = bregion("ss0_r", lay, p0, 0, 0, p0, self.n0) if l == 0 else bregion("ss_r", lay, p, l - 1, 0, p, self.n0)
        return [bregion("hn_r", lay, d, l, 0, d, self.n0), ss]

    def cost(self, lay: Layout) -> Cost:
        d, rows, R = lay.cfg.d, lay.tiling.qkv_rows, lay.n_tile
        return Cost(hbm_bytes=2 * rows * d, l2_bytes=2 * d * R + 4 * rows * R, flops=2 * rows * d * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, NR, b, n0 = lay.cfg, lay.n_tile, self.n0 // lay.n_tile, self.n0
        R, slots, pos, _ = read_rows(st)
        R, slots, pos = max(0, min(R - n0, NR)), slots[n0:n0 + NR], pos[n0:n0 + NR]      # the block's rows
        w = st.weights[self.layer][SECTIONS[self.sec]]
        xb = bview(st.buf["hn_r"], lay, c.d, c.layers + 1)[self.layer, b]
        p0, p, _ = lay.ss_parts
        ss = bview(st.buf["ss0_r"], lay, p0)[b] if self.layer == 0 else \
            bview(st.buf["ss_r"], lay, p, c.layers)[self.layer - 1, b]
        rstd = col_rstd_r(ss, ss.shape[0], c.d, c.eps)              # [ROWS]
        lo, hi = self._dims(lay)
        dims = torch.arange(lo, hi)
        rows1 = self.head * c.hd + dims
        rows2 = rows1 + c.hd // 2
        y1 = bf16_dot(w[rows1], xb) * rstd[None, :]
        y2 = bf16_dot(w[rows2], xb) * rstd[None, :]
        if self.sec < 2:
            p = torch.tensor(pos + [0] * (NR - R), dtype=torch.long)
            cos, sin = st.tables["cos_ptr"][p][:, lo:hi].T, st.tables["sin_ptr"][p][:, lo:hi].T
            y1, y2 = y1 * cos - y2 * sin, y2 * cos + y1 * sin
        if self.sec == 0:
            q = bview(st.buf["q_r"], lay, c.q_dim, c.layers)[self.layer, b].view(c.n_q, c.hd, NR)
            q[self.head, lo:hi] = y1
            q[self.head, c.hd // 2 + lo: c.hd // 2 + hi] = y2
        else:
            cache = st.kv[self.layer][self.sec - 1]
            for n in range(R):
                cache[slots[n], self.head, pos[n], lo:hi] = y1[:, n].to(torch.bfloat16)
                cache[slots[n], self.head, pos[n], c.hd // 2 + lo: c.hd // 2 + hi] = y2[:, n].to(torch.bfloat16)
