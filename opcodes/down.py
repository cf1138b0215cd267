"""DOWN: one (row tile, K chunk) of the down projection, written as a partial sum.

    dpart[kc, r] = Wdown[r, K_kc] . act[K_kc]     K_kc = [kc*DOWN_K, (kc+1)*DOWN_K) of ffn

A tile waits only for the gate/up tiles of its own K chunk. Partials are summed in a fixed
order by RESIDUAL, so the result does not depend on the schedule (bitwise).
With ``Tiling.fold`` the tile of the last K chunk also waits for the other chunks of its rows and
does RESIDUAL's work for them: ``out = x1 + sum_kc dpart[kc]`` in the same order (bitwise the same),
written to ``xout[layer]`` (or the caller's output for the last layer).
Streams ``DOWN_ROWS * DOWN_K * 2`` bytes of Wdown.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, in_range, register, tile_start
from .common import T_WD, prefetch_rows, residual_partial_sum, residual_torch, store_layer_output, tab_offset


@triton.jit
def down_device(layer, row0, kc, wtab_ptr, wd_ptr, act_ptr, dpart_ptr, out_ptr, xout_ptr, x1_ptr,
                NL: tl.constexpr, D: tl.constexpr, FFN: tl.constexpr, DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr,
                NKC: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, FOLD: tl.constexpr,
                INTERP: tl.constexpr):
    EVEN: tl.constexpr = (FFN % DOWN_K == 0) and (DOWN_K % BK == 0) and (D % DOWN_ROWS == 0)
    rows = row0 + tl.arange(0, DOWN_ROWS)
    rm = rows < D
    w_ptr = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    a_ptr = act_ptr + layer * FFN
    kbase = kc * DOWN_K
    acc = tl.zeros([DOWN_ROWS, BK], dtype=tl.float32)
    # each iteration streams DOWN_ROWS x BK bf16 of Wdown
    for kk in tl.range(0, DOWN_K, BK, num_stages=STAGES):
        cols = kbase + kk + tl.arange(0, BK)
        if EVEN:
            a = tl.load(a_ptr + cols, cache_modifier=".cg")
            w = tl.load(w_ptr + rows[:, None] * FFN + cols[None, :], eviction_policy="evict_first")
        else:
            cm = ((kk + tl.arange(0, BK)) < DOWN_K) & (cols < FFN)
            a = tl.load(a_ptr + cols, mask=cm, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + rows[:, None] * FFN + cols[None, :], mask=rm[:, None] & cm[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    part = tl.sum(acc, axis=1)
    tl.store(dpart_ptr + (layer * NKC + kc) * D + rows, part, mask=rm)
    if FOLD:
        if kc == NKC - 1:          # RESIDUAL's sum for these rows, in its order (own partial last)
            y = residual_partial_sum(layer, rows, rm, x1_ptr, dpart_ptr, D, NKC, NKC - 1) + part
            store_layer_output(layer, rows, rm, y, out_ptr, xout_ptr, NL, D, INTERP)


@triton.jit
def down_prefetch(layer, row0, kc, n, wtab_ptr, wd_ptr, D: tl.constexpr, FFN: tl.constexpr,
                  DOWN_ROWS: tl.constexpr, DOWN_K: tl.constexpr, BK: tl.constexpr):
    rows = row0 + tl.arange(0, DOWN_ROWS)
    w_ptr = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    prefetch_rows(w_ptr, rows, rows < D, FFN, kc * DOWN_K + n * BK, DOWN_K - n * BK, BK)


@register
@dataclass(frozen=True)
class Down(Instruction):
    layer: int
    row0: int
    kc: int

    NAME = "down"
    STAGE = 5
    ARGS = ("wtab_ptr", "wd_ptr", "act_ptr", "dpart_ptr", "out_ptr", "xout_ptr", "x1_ptr", "NL", "D", "FFN",
            "DOWN_ROWS", "DOWN_K", "NKC", "BK", "STAGES", "FOLD", "INTERP")
    device = down_device
    prefetch = down_prefetch
    PREFETCH_ARGS = ("wtab_ptr", "wd_ptr", "D", "FFN", "DOWN_ROWS", "DOWN_K", "BK")

    def check_operands(self, lay: Layout) -> list[str]:
        return (in_range("layer", self.layer, lay.cfg.layers)
                + tile_start("row0", self.row0, lay.tiling.down_rows, lay.cfg.d)
                + in_range("kc", self.kc, lay.n_down_k))

    def _rows(self, lay: Layout) -> tuple[int, int]:
        return self.row0, min(self.row0 + lay.tiling.down_rows, lay.cfg.d)

    def _ks(self, lay: Layout) -> tuple[int, int]:
        k = lay.tiling.down_k
        return self.kc * k, min((self.kc + 1) * k, lay.cfg.ffn)

    def folds(self, lay: Layout) -> bool:
        """This tile also does RESIDUAL's work for its rows (``Tiling.fold``, last K chunk)."""
        return bool(lay.tiling.fold) and self.kc == lay.n_down_k - 1

    def reads(self, lay: Layout) -> list[Region]:
        k0, k1 = self._ks(lay)
        base = self.layer * lay.cfg.ffn
        out = [Region("act", base + k0, base + k1)]
        if self.folds(lay):
            lo, hi = self._rows(lay)
            d = lay.cfg.d
            out.append(Region("x1", self.layer * d + lo, self.layer * d + hi))
            out += [Region("dpart", (self.layer * lay.n_down_k + k) * d + lo, (self.layer * lay.n_down_k + k) * d + hi)
                    for k in range(lay.n_down_k - 1)]
        return out

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = (self.layer * lay.n_down_k + self.kc) * lay.cfg.d
        out = [Region("dpart", base + lo, base + hi)]
        if self.folds(lay):
            out.append(Region("xout", self.layer * lay.cfg.d + lo, self.layer * lay.cfg.d + hi))
        return out

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        extra = (4 * lay.n_down_k + 2) * (hi - lo) if self.folds(lay) else 0
        return Cost(hbm_bytes=2 * (hi - lo) * (k1 - k0), l2_bytes=4 * (k1 - k0) + 4 * (hi - lo) + extra,
                    flops=2 * (hi - lo) * (k1 - k0))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["act"].view(c.layers, c.ffn)[self.layer, k0:k1]
        y = st.weights[self.layer]["down"][lo:hi, k0:k1].float() @ a
        st.buf["dpart"].view(c.layers, lay.n_down_k, c.d)[self.layer, self.kc, lo:hi] = y
        if self.folds(lay):                  # RESIDUAL's sum, in its order
            residual_torch(lay, st, self.layer, lo, hi)
