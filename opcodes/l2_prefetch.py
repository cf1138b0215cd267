"""L2_PREFETCH: ask the L2 for weights a later instruction streams, and go on.

    (no result)    NBYTES of weight span a and of span b, into the L2

Issued by SMs that would otherwise wait while the HBM is half idle (the 1B decoder's QKV stage: 96
tiles on 132 SMs), for weights other SMs stream soon after (``Tiling.wo_l2`` / ``gu_l2``, placed by
``schedule.prefetch``). It signals nothing and changes no buffer: a program is the same with or
without it, only sooner. Which spans a tile streams is its opcode's fact
(:meth:`Instruction.weight_spans`); a span is (the per-layer tensor's offset-table column, the
element offset in the layer's tensor). The bytes go as ``cp.async.bulk.prefetch.L2`` copies, one a
thread (the TMA engine fetches them; no register waits on them, and no later load of the SM queues
behind them, bench/NOTES.md run 233).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Timing, in_range, register
from .common import T_WD, T_WG, T_WK, T_WO, T_WU, T_WV, tab_offset

#: the copies a span is cut into (one a thread of a 4-warp CTA, two spans)
_CHUNKS = 64
CHUNKS = tl.constexpr(_CHUNKS)
#: a span's bytes are a multiple of this (64 copies of a multiple of 16 bytes)
COPY_BYTES = 16 * _CHUNKS
#: the weights the opcode can prefetch: the per-layer tensors a GEMV streams
PREFETCHABLE = ("q", "k", "v", "o", "gate", "up", "down")


@triton.jit
def _span_base(layer, col, wtab_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr):
    # the layer's tensor of offset-table column ``col``, as an address
    a = wq_ptr.to(tl.int64)
    a = tl.where(col == T_WK, wk_ptr.to(tl.int64), a)
    a = tl.where(col == T_WV, wv_ptr.to(tl.int64), a)
    a = tl.where(col == T_WO, wo_ptr.to(tl.int64), a)
    a = tl.where(col == T_WG, wg_ptr.to(tl.int64), a)
    a = tl.where(col == T_WU, wu_ptr.to(tl.int64), a)
    a = tl.where(col == T_WD, wd_ptr.to(tl.int64), a)
    return a + 2 * tab_offset(wtab_ptr, layer, col).to(tl.int64)


@triton.jit
def l2_prefetch_device(layer, col_a, off_a, col_b, off_b, nbytes, wtab_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr,
                       wg_ptr, wu_ptr, wd_ptr, INTERP: tl.constexpr):
    if not INTERP:      # the interpreter runs no PTX; the opcode changes nothing it could check
        a = _span_base(layer, col_a, wtab_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr)
        b = _span_base(layer, col_b, wtab_ptr, wq_ptr, wk_ptr, wv_ptr, wo_ptr, wg_ptr, wu_ptr, wd_ptr)
        k = tl.arange(0, 2 * CHUNKS)
        chunk = nbytes // CHUNKS
        addr = tl.where(k < CHUNKS, a + 2 * off_a.to(tl.int64), b + 2 * off_b.to(tl.int64)) \
            + (k % CHUNKS).to(tl.int64) * chunk
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r", [addr, (k * 0 + chunk).to(tl.int32)], dtype=tl.int32, is_pure=False, pack=1)


@register
@dataclass(frozen=True)
class L2Prefetch(Instruction):
    layer: int
    col_a: int      # Layout.column of span a's tensor, off_a its first element in the layer's tensor
    off_a: int
    col_b: int
    off_b: int
    nbytes: int     # bytes of each span, a multiple of 16 * _CHUNKS

    NAME = "l2_prefetch"
    STAGE = 3
    ARGS = ("wtab_ptr", "wq_ptr", "wk_ptr", "wv_ptr", "wo_ptr", "wg_ptr", "wu_ptr", "wd_ptr", "INTERP")
    TIMING = Timing.FIXED
    FIXED_S = 0.5e-6
    IN_EVERY_KERNEL = False     # only the kernels of tapes that hold one (Tiling.wo_l2, gu_l2)
    device = l2_prefetch_device

    @classmethod
    def of_spans(cls, layer: int, spans, nbytes: int) -> "L2Prefetch":
        """The prefetch of the first ``nbytes`` of two spans ((tensor key, element offset, bytes),
        :meth:`Instruction.weight_spans`), at most each span's bytes, rounded down to whole copies."""
        (ka, oa, ba), (kb, ob, bb) = spans
        n = min(nbytes, ba, bb) // COPY_BYTES * COPY_BYTES
        return cls(layer, Layout.column(ka), oa, Layout.column(kb), ob, n)

    def check_operands(self, lay: Layout) -> list[str]:
        cols = [Layout.column(k) for k in PREFETCHABLE]
        bad = in_range("layer", self.layer, lay.cfg.layers)
        for n in ("col_a", "col_b"):
            if getattr(self, n) not in cols:
                bad.append(f"{n} {getattr(self, n)} is not the column of a streamed weight ({', '.join(PREFETCHABLE)})")
        if self.nbytes <= 0 or self.nbytes % COPY_BYTES:
            bad.append(f"nbytes {self.nbytes} is not a positive multiple of {COPY_BYTES}")
        for c, o in ((self.col_a, self.off_a), (self.col_b, self.off_b)):
            if c in cols:
                numel = _layer_numel(lay, c)
                if not (0 <= o and o * 2 + self.nbytes <= numel * 2):
                    bad.append(f"span at element {o} + {self.nbytes} bytes runs past its tensor ({numel} elements)")
        return bad

    def cost(self, lay: Layout) -> Cost:
        return Cost(hbm_bytes=0, l2_bytes=0, flops=0)

    def run_torch(self, lay: Layout, st) -> None:
        return None


def _layer_numel(lay: Layout, col: int) -> int:
    """Elements of one layer's tensor of offset-table column ``col``."""
    c = lay.cfg
    key = [k for k, _ in Layout.TENSORS][col]
    return {"q": c.q_dim * c.d, "k": c.kv_dim * c.d, "v": c.kv_dim * c.d, "o": c.d * c.q_dim,
            "gate": c.ffn * c.d, "up": c.ffn * c.d, "down": c.d * c.ffn}[key]
