"""DOWN_R: one tile of the down projection over every row, for one K chunk of the ffn (opcodes/rows.py).

    dpart_r[layer, kc, r, n] = Wd[r, kc*DOWN_K : (kc+1)*DOWN_K] . act_r[layer, kc*DOWN_K : ..., n]   (fp32)

rows r in [r0, r0 + DOWN_ROWS); RESIDUAL_R adds the chunks and x1 (or, with ``Tiling.down_res``, the last
chunk's DOWN_RES_R adds the others' and its own dot: ``opcodes.rows_down_res``).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Layout, Region, register, tile_start
from .common import T_WD, tab_offset
from .common_rows import rows_stream
from .down import Down
from .rows import RowsInstruction, bf16_dot, bregion, bview, check_n0


def n_parts(lay: Layout) -> int:
    """The down partials of a layer (``dpart_r``'s chunks, the constexpr ``DPARTS``): one a K chunk, but the
    last chunk's with ``Tiling.down_res`` (DOWN_RES_R adds that dot itself)."""
    return lay.n_down_k - lay.tiling.down_res


@triton.jit
def down_chunk(r0, layer, kc, n0, act_r_ptr, wtab_ptr, wd_ptr, D: tl.constexpr, FFN: tl.constexpr,
               DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr,
               ROWS: tl.constexpr, NT: tl.constexpr, INTERP: tl.constexpr):
    """The fp32 [DOWN_ROWS, NT] dot of K chunk ``kc`` for rows ``r0 ..`` of Wd (column block ``n0``, already 0
    where one block holds every row), and the rows with their mask: DOWN_R's, and DOWN_RES_R's last chunk."""
    w = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    rows = r0 + tl.arange(0, DOWN_ROWS)
    rm = rows < D
    acc, acc2 = rows_stream(w, rows, w, rows, rm, act_r_ptr + layer * (FFN * ROWS) + n0 * FFN, kc * DOWN_K, NT,
                            NT, FFN, DOWN_K, DOWN_ROWS, NT, BK, STAGES, TWO=False,
                            EVEN=(FFN % DOWN_K == 0) & (DOWN_K % BK == 0) & (D % DOWN_ROWS == 0), INTERP=INTERP)
    return acc, rows, rm


@triton.jit
def down_r_device(r0, layer, kc, n0, act_r_ptr, dpart_r_ptr, wtab_ptr, wd_ptr,
                  D: tl.constexpr, FFN: tl.constexpr, DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr,
                  DPARTS: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, ROWS: tl.constexpr,
                  NT: tl.constexpr, INTERP: tl.constexpr):
    if NT == ROWS:
        n0 = 0
    acc, rows, rm = down_chunk(r0, layer, kc, n0, act_r_ptr, wtab_ptr, wd_ptr, D, FFN, DOWN_ROWS, DOWN_K, BK, STAGES,
                               ROWS, NT, INTERP)
    n = tl.arange(0, NT)
    tl.store(dpart_r_ptr + (layer * DPARTS + kc) * (D * ROWS) + n0 * D + rows[:, None] * NT + n[None, :], acc,
             mask=rm[:, None])


@register
@dataclass(frozen=True)
class DownR(RowsInstruction):
    r0: int
    layer: int
    kc: int       # K chunk of the ffn
    n0: int = 0   # the column block (opcodes.rows)

    NAME = "down_r"
    STAGE = 4
    ARGS = ("act_r_ptr", "dpart_r_ptr", "wtab_ptr", "wd_ptr",
            "D", "FFN", "DOWN_ROWS", "DOWN_K", "DPARTS", "BK", "STAGES", "ROWS", "NT", "INTERP")
    CONSTEXPRS = {**{k: Down.CONSTEXPRS[k] for k in ("DOWN_ROWS", "DOWN_K")}, "DPARTS": n_parts}
    SCRATCH = {"dpart_r": "fp32"}
    device = down_r_device

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"dpart_r": (lay.cfg.layers, n_parts(lay), lay.cfg.d, lay.rows)}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.down_rows

    def check_operands(self, lay: Layout) -> list[str]:
        bad = tile_start("r0", self.r0, lay.tiling.down_rows, lay.cfg.d) + check_n0(self.n0, lay)
        if not 0 <= self.kc < n_parts(lay):
            bad.append(f"kc {self.kc} not in [0, {n_parts(lay)})" + (" (down_res: the last chunk is DOWN_RES_R's)"
                                                                     if lay.tiling.down_res else ""))
        return bad + ([] if 0 <= self.layer < lay.cfg.layers else [f"layer {self.layer} not in [0, {lay.cfg.layers})"])

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.r0, min(self.r0 + lay.tiling.down_rows, lay.cfg.d)

    def _ks(self, lay: Layout) -> tuple[int, int]:
        k = lay.tiling.down_k
        return self.kc * k, min((self.kc + 1) * k, lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        k0, k1 = self._ks(lay)
        return [bregion("act_r", lay, lay.cfg.ffn, self.layer, k0, k1, self.n0)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        return [bregion("dpart_r", lay, lay.cfg.d, self.layer * n_parts(lay) + self.kc, lo, hi, self.n0)]

    def cost(self, lay: Layout) -> Cost:
        R = lay.n_tile
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0), l2_bytes=2 * (k1 - k0) * R + 4 * (hi - lo) * R,
                    flops=2 * (hi - lo) * (k1 - k0) * R)

    def run_torch(self, lay: Layout, st) -> None:
        c, b = lay.cfg, self.n0 // lay.n_tile
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = bview(st.buf["act_r"], lay, c.ffn, c.layers)[self.layer, b, k0:k1]
        y = bf16_dot(st.weights[self.layer]["down"][lo:hi, k0:k1], a)
        bview(st.buf["dpart_r"], lay, c.d, c.layers, n_parts(lay))[self.layer, self.kc, b, lo:hi] = y
