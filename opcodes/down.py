"""DOWN: one (row tile, K chunk) of the down projection, written as a partial sum.

    dpart[kc, r] = Wdown[r, K_kc] . act[K_kc]     K_kc = [kc*DOWN_K, (kc+1)*DOWN_K) of ffn

A tile waits only for the gate/up tiles of its own K chunk. Partials are summed in a fixed
order by RESIDUAL, so the result does not depend on the schedule (bitwise).
Streams ``DOWN_ROWS * DOWN_K * 2`` bytes of Wdown.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, in_range, register, tile_start
from .tiling import ROW_BYTES, next_pow2
from .common import T_WD, gemv_stream, rows_load, tab_offset, tape_waits


@triton.jit
def _down_rows_waiting(row0, kc, w_ptr, act_in, out, ins, cnt_ptr, epoch, spin_limit,
                       D: tl.constexpr, FFN: tl.constexpr, DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr,
                       DKP: tl.constexpr, D_RB: tl.constexpr, STAGES: tl.constexpr, PROFILE: tl.constexpr):
    # D_WAIT: whole rows of the tile's K chunk, D_RB a pipeline stage; the loop's prologue (its first
    # STAGES - 1 blocks) issued before the waits, made in the first iteration with the read they guard
    # (the chunk of act, [1, DKP] in the blocks' layout)
    NB: tl.constexpr = DOWN_ROWS // D_RB
    EVEN: tl.constexpr = (DOWN_K == DKP) and (FFN % DOWN_K == 0) and (D % DOWN_ROWS == 0)
    k0 = kc * DOWN_K
    klen = tl.minimum(FFN - k0, DOWN_K)
    hv = tl.zeros([1, DKP], dtype=tl.float32)
    bad_c = tl.full([], -1, tl.int32)
    bad_s = tl.full([], 0, tl.int32)
    t_exec = tl.full([], 0, tl.int64)
    for b in tl.range(0, NB, num_stages=STAGES):
        if b == 0:
            bad_c, bad_s, t_exec = tape_waits(ins, cnt_ptr, epoch, spin_limit, PROFILE)
            cols = tl.arange(0, DKP)
            hv = tl.load(act_in + k0 + cols, mask=cols < klen, other=0.0, cache_modifier=".cg")[None, :]
        r = row0 + b * D_RB + tl.arange(0, D_RB)
        rm = r < D
        w = rows_load(w_ptr, r, rm, k0, FFN, klen, DKP, EVEN)
        tl.store(out + r, tl.sum(w.to(tl.float32) * hv, axis=1), mask=rm & (bad_c < 0))
    return bad_c, bad_s, t_exec


@triton.jit
def down_device(layer, row0, kc, wtab_ptr, wd_ptr, act_ptr, dpart_ptr,
                D: tl.constexpr, FFN: tl.constexpr, DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr,
                DOWN_CHUNKS: tl.constexpr, DOWN_BK: tl.constexpr, STAGES: tl.constexpr, D_WAIT: tl.constexpr,
                D_RB: tl.constexpr, DKP: tl.constexpr, ins, cnt_ptr, epoch, spin_limit, PROFILE: tl.constexpr):
    w_ptr = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    out = dpart_ptr + (layer * DOWN_CHUNKS + kc) * D
    if D_WAIT:      # the row loop, waiting inside (Down.WAIT_INSIDE)
        return _down_rows_waiting(row0, kc, w_ptr, act_ptr + layer * FFN, out, ins, cnt_ptr, epoch, spin_limit,
                                  D, FFN, DOWN_ROWS, DOWN_K, DKP, D_RB, STAGES, PROFILE)
    rows = row0 + tl.arange(0, DOWN_ROWS)
    rm = rows < D
    acc, _, _ = gemv_stream(w_ptr, rows, w_ptr, rows, rm, act_ptr + layer * FFN, act_ptr, kc * DOWN_K, FFN, DOWN_K,
                            DOWN_ROWS, DOWN_BK, STAGES, TWO=False, NORM=False,
                            EVEN=(FFN % DOWN_K == 0) and (DOWN_K % DOWN_BK == 0) and (D % DOWN_ROWS == 0))
    tl.store(out + rows, tl.sum(acc, axis=1), mask=rm)


@register
@dataclass(frozen=True)
class Down(Instruction):
    layer: int
    row0: int
    kc: int

    NAME = "down"
    STAGE = 5
    ARGS = ("wtab_ptr", "wd_ptr", "act_ptr", "dpart_ptr", "D", "FFN", "DOWN_ROWS", "DOWN_K", "DOWN_CHUNKS",
            "DOWN_BK", "STAGES", "D_WAIT", "D_RB", "DKP")
    CONSTEXPRS = {"DOWN_ROWS": lambda lay: lay.tiling.down_rows, "DOWN_K": lambda lay: lay.tiling.down_k,
                  "DOWN_BK": lambda lay: lay.tiling.down_bk or lay.tiling.bk,
                  "D_WAIT": lambda lay: lay.tiling.down_wait,
                  # the waiting row loop's rows a stage (Tiling.row_bytes, else ROW_BYTES) and padded K chunk
                  "D_RB": lambda lay: lay.tiling.rows_per_block(Down._chunk(lay), 1, lay.tiling.down_rows,
                                                                row_bytes=lay.tiling.row_bytes or ROW_BYTES),
                  "DKP": lambda lay: next_pow2(Down._chunk(lay))}
    WAIT_INSIDE = "D_WAIT"
    device = down_device

    SCRATCH = {"dpart": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"dpart": (lay.cfg.layers, lay.n_down_k, lay.cfg.d)}

    @staticmethod
    def _chunk(lay: Layout) -> int:
        """Columns of a K chunk (the last one may be shorter)."""
        return min(lay.tiling.down_k, lay.cfg.ffn)

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        return lay.tiling.down_rows

    @classmethod
    def stream_width(cls, lay: Layout) -> int:
        return cls.CONSTEXPRS["DOWN_BK"](lay)

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.down_rows, lay.cfg.d)
                + in_range("kc", self.kc, lay.n_down_k))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.down_rows, lay.cfg.d)

    def _ks(self, lay: Layout) -> tuple[int, int]:
        k = lay.tiling.down_k
        return self.kc * k, min((self.kc + 1) * k, lay.cfg.ffn)

    def reads(self, lay: Layout) -> list[Region]:
        k0, k1 = self._ks(lay)
        base = self.layer * lay.cfg.ffn
        return [Region("act", base + k0, base + k1)]

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = (self.layer * lay.n_down_k + self.kc) * lay.cfg.d
        return [Region("dpart", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0), l2_bytes=4 * (k1 - k0) + 4 * (hi - lo),
                    flops=2 * (hi - lo) * (k1 - k0))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["act"].view(c.layers, c.ffn)[self.layer, k0:k1]
        y = st.weights[self.layer]["down"][lo:hi, k0:k1].float() @ a
        st.buf["dpart"].view(c.layers, lay.n_down_k, c.d)[self.layer, self.kc, lo:hi] = y
