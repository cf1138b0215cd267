"""EMBED_R: one column block of every row's embedding into the rows' layer-0 input (opcodes/rows.py).

    x0_r[c, n] = embed[tok[n], c]    for c in [col0, col0 + EMB_COLS), rows n in [n0, n0 + NT): tok[n] if n < R, else 0
    hn_r[0, c, n] = bf16(x0_r[c, n] * in_norm_0[c]),  ss0_r[col0 / EMB_COLS, n] = sum_c x0_r[c, n]^2
(layer 0's QKV operand, normed: ``common_rows.store_normed``).

``x0_r`` is feature-major ``[d, ROWS]`` bf16 (blocked by ``NT`` columns: ``opcodes.rows``). Tokens come from the ``rows`` state buffer (the host
writes it; a token outside ``[0, vocab)`` is clamped, the host checks the tokens it is handed).
Streams ``EMB_COLS * R * 2`` bytes of the embedding table.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_N1, tab_offset
from .common_rows import store_normed
from .embed import Embed
from .rows import RowsInstruction, bregion, bview, check_n0, read_rows, row_meta, rows_state_shape, store_normed_r


@triton.jit
def embed_r_device(col0, n0, rows_ptr, x0_r_ptr, embed_ptr, hn_r_ptr, ss0_r_ptr, wtab_ptr, n1_ptr, D: tl.constexpr,
                   VOCAB: tl.constexpr, EMB_COLS: tl.constexpr, SS_P0: tl.constexpr, ROWS: tl.constexpr,
                   NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    j = tl.arange(0, NT)
    live, slot, pos, tok = row_meta(rows_ptr, n0 + j, ROWS)
    tok = tl.minimum(tl.maximum(tok, 0), VOCAB - 1).to(tl.int64)
    cols = col0 + tl.arange(0, EMB_COLS)
    cm = cols < D
    v = tl.load(embed_ptr + tok[None, :] * D + cols[:, None], mask=cm[:, None] & live[None, :], other=0.0)
    tl.store(x0_r_ptr + n0 * D + cols[:, None] * NT + j[None, :], v, mask=cm[:, None])
    store_normed(v.to(tl.float32), cols, cm, n1_ptr + tab_offset(wtab_ptr, 0, T_N1), hn_r_ptr, ss0_r_ptr,
                 col0 // EMB_COLS, n0, D, SS_P0, NT, INTERP)


@register
@dataclass(frozen=True)
class EmbedR(RowsInstruction):
    col0: int
    n0: int = 0       # the column block (opcodes.rows)

    NAME = "embed_r"
    STAGE = 0
    ARGS = ("rows_ptr", "x0_r_ptr", "embed_ptr", "hn_r_ptr", "ss0_r_ptr", "wtab_ptr", "n1_ptr", "D", "VOCAB",
            "EMB_COLS", "SS_P0", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {"VOCAB": Embed.CONSTEXPRS["VOCAB"], "EMB_COLS": Embed.CONSTEXPRS["EMB_COLS"]}
    device = embed_r_device

    SCRATCH = {"x0_r": "bf16", "ss0_r": "fp32"}
    STATE = {"rows": "i32"}       # [R, 0, 0, 0] then per row [slot, pos, tok, 0]: written by the host

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"x0_r": (lay.cfg.d, lay.rows), "ss0_r": (lay.ss_parts[0], lay.rows)}

    @classmethod
    def state_shapes(cls, lay: Layout) -> dict:
        return {"rows": rows_state_shape(lay.rows)}

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return ["embed_r needs a RowsLayout (opcodes.rows)"]
        return tile_start("col0", self.col0, lay.emb_cols, lay.cfg.d) + check_n0(self.n0, lay)

    def _cols(self, lay: Layout) -> tuple[int, int]:
        return self.col0, min(self.col0 + lay.emb_cols, lay.cfg.d)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._cols(lay)
        d, part = lay.cfg.d, self.col0 // lay.emb_cols
        return [bregion("x0_r", lay, d, 0, lo, hi, self.n0), bregion("hn_r", lay, d, 0, lo, hi, self.n0),
                bregion("ss0_r", lay, lay.ss_parts[0], 0, part, part + 1, self.n0)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._cols(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * lay.n_tile, l2_bytes=2 * (hi - lo) * lay.n_tile, flops=0)

    def run_torch(self, lay: Layout, st) -> None:
        R, _, _, toks = read_rows(st)
        lo, hi = self._cols(lay)
        c, b, NT = lay.cfg, self.n0 // lay.n_tile, lay.n_tile
        x = bview(st.buf["x0_r"], lay, c.d)[b]
        x[lo:hi] = 0
        for j, t in enumerate(toks[self.n0:self.n0 + NT]):
            x[lo:hi, j] = st.model["embed"][min(max(t, 0), c.vocab - 1), lo:hi]
        store_normed_r(x[lo:hi].float(), lo, hi, st.weights[0]["in_norm"],
                       bview(st.buf["hn_r"], lay, c.d, c.layers + 1)[0, b],
                       bview(st.buf["ss0_r"], lay, lay.ss_parts[0])[b], self.col0 // lay.emb_cols)
