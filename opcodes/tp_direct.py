"""OPROJ_TP / DOWN_TP (``Tiling.tp_direct``): tensor parallel O and down tiles that send their partial
rows to both ranks themselves.

    y[r] = W[r, K_chunk] . v[K_chunk]          (as OPROJ / DOWN compute it)
    tp_parts[epoch % 2][this rank][chunk][r] = epoch << 32 | bits(y[r])   on this rank AND on the peer

Each word carries the call number (``ll_pack``): the words are the signal (``TO_BOTH``, data-signalled,
no fence, no counter). TP_REDUCE of a row block waits on its words, both ranks' and every chunk's, and
sums rank 0's chunks, then rank 1's, then the two in that order: what TP_PUSH + TP_REDUCE compute,
without the TP_PUSH stage and its dispatch hop. Only tensor-parallel kernels hold these branches.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Layout, Region, register
from .common import T_WD, T_WO, gemv_stream, tab_offset
from .down import Down
from .oproj import OProj
from .tp_push import ll_pack, ll_pack_torch, parts_offset, parts_offsets, parts_shape


@triton.jit
def _store_both(y, rows, rm, layer, stage, ch, epoch, tp_parts_ptr, peer_parts_ptr, LAYERS: tl.constexpr,
                D: tl.constexpr, RED_ROWS: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                TP_RANK: tl.constexpr):
    slot = epoch % 2
    off = slot * (LAYERS * 2 * D * (O_CHUNKS + DOWN_CHUNKS)) + \
        parts_offsets(layer, stage, rows, TP_RANK, ch, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS)
    w = ll_pack(y, epoch)
    tl.store(tp_parts_ptr + off, w, mask=rm)
    tl.store(peer_parts_ptr + off, w, mask=rm)


@triton.jit
def oproj_tp_device(layer, row0, oc, epoch, wtab_ptr, wo_ptr, attn_ptr, tp_parts_ptr, peer_parts_ptr,
                    LAYERS: tl.constexpr, D: tl.constexpr, NQ: tl.constexpr, HD: tl.constexpr, O_ROWS: tl.constexpr,
                    O_K: tl.constexpr, O_BK: tl.constexpr, STAGES: tl.constexpr, RED_ROWS: tl.constexpr,
                    O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr, TP_RANK: tl.constexpr):
    rows = row0 + tl.arange(0, O_ROWS)
    rm = rows < D
    # the GEMV of oproj_device (written out again: a shared helper reorders the one-GPU kernels' PTX)
    QD: tl.constexpr = NQ * HD
    w_ptr = wo_ptr + tab_offset(wtab_ptr, layer, T_WO)
    acc, _, _ = gemv_stream(w_ptr, rows, w_ptr, rows, rm, attn_ptr + layer * QD, attn_ptr, oc * O_K, QD, O_K,
                            O_ROWS, O_BK, STAGES, TWO=False, NORM=False,
                            EVEN=(QD % O_K == 0) and (O_K % O_BK == 0) and (D % O_ROWS == 0))
    y = tl.sum(acc, axis=1)
    _store_both(y, rows, rm, layer, 0, oc, epoch, tp_parts_ptr, peer_parts_ptr, LAYERS, D, RED_ROWS, O_CHUNKS,
                DOWN_CHUNKS, TP_RANK)


@triton.jit
def down_tp_device(layer, row0, kc, epoch, wtab_ptr, wd_ptr, act_ptr, tp_parts_ptr, peer_parts_ptr,
                   LAYERS: tl.constexpr, D: tl.constexpr, FFN: tl.constexpr, DOWN_ROWS: tl.constexpr,
                   DOWN_K: tl.constexpr, DOWN_BK: tl.constexpr, STAGES: tl.constexpr, RED_ROWS: tl.constexpr,
                   O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr, TP_RANK: tl.constexpr):
    rows = row0 + tl.arange(0, DOWN_ROWS)
    rm = rows < D
    # the GEMV of down_device (written out again, as above)
    w_ptr = wd_ptr + tab_offset(wtab_ptr, layer, T_WD)
    acc, _, _ = gemv_stream(w_ptr, rows, w_ptr, rows, rm, act_ptr + layer * FFN, act_ptr, kc * DOWN_K, FFN, DOWN_K,
                            DOWN_ROWS, DOWN_BK, STAGES, TWO=False, NORM=False,
                            EVEN=(FFN % DOWN_K == 0) and (DOWN_K % DOWN_BK == 0) and (D % DOWN_ROWS == 0))
    y = tl.sum(acc, axis=1)
    _store_both(y, rows, rm, layer, 1, kc, epoch, tp_parts_ptr, peer_parts_ptr, LAYERS, D, RED_ROWS, O_CHUNKS,
                DOWN_CHUNKS, TP_RANK)


class _ToBoth:
    """What OPROJ_TP and DOWN_TP share: the ``tp_parts`` words of their rows, on both ranks."""

    TO_BOTH = True
    IN_EVERY_KERNEL = False
    PARITY_SLOTS = {"tp_parts": 2}
    PEER_POINTERS = {"peer_parts_ptr": "tp_parts"}
    SCRATCH = {"tp_parts": "i64"}       # [slot][layer][stage][row block][src][chunk][row]: see opcodes/tp_push.py
    STAGE_OF = 0                        # 0: O, 1: down

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return getattr(lay, "tp_size", 1) == 2

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"tp_parts": parts_shape(lay)}

    @classmethod
    def signals_by_data(cls, lay: Layout) -> bool:
        return True

    def _chunk(self) -> int:
        return self.oc if self.STAGE_OF == 0 else self.kc

    def _region(self, lay: Layout, src: int) -> list[Region]:
        lo, hi = self._rows(lay)
        o = parts_offset(lay, self.layer, self.STAGE_OF, lo, src, self._chunk())
        return [Region("tp_parts", o, o + hi - lo)]

    def writes(self, lay: Layout) -> list[Region]:
        return self._region(lay, lay.tp_rank)

    def mirror_writes(self, lay: Layout) -> list[Region]:
        return self._region(lay, 1 - lay.tp_rank)

    def _send(self, lay: Layout, st, y) -> None:
        lo, _ = self._rows(lay)
        o = parts_offset(lay, self.layer, self.STAGE_OF, lo, lay.tp_rank, self._chunk())
        w = ll_pack_torch(y, st.epoch)
        for buf in (st.buf["tp_parts"], st.peer_buf["tp_parts"]):
            buf.view(2, -1)[st.epoch % 2, o:o + len(w)] = w


@register
@dataclass(frozen=True)
class OProjTP(_ToBoth, OProj):
    NAME = "oproj_tp"
    STAGE_OF = 0
    ARGS = ("epoch", "wtab_ptr", "wo_ptr", "attn_ptr", "tp_parts_ptr", "peer_parts_ptr", "LAYERS", "D", "NQ", "HD",
            "O_ROWS", "O_K", "O_BK", "STAGES", "RED_ROWS", "O_CHUNKS", "DOWN_CHUNKS", "TP_RANK")
    device = oproj_tp_device
    SCRATCH = _ToBoth.SCRATCH

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        k0, k1 = self._ks(lay)
        return [Region("attn", self.layer * c.q_dim + k0, self.layer * c.q_dim + k1)]

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["attn"].view(c.layers, c.q_dim)[self.layer, k0:k1]
        self._send(lay, st, st.weights[self.layer]["o"][lo:hi, k0:k1].float() @ a)


@register
@dataclass(frozen=True)
class DownTP(_ToBoth, Down):
    NAME = "down_tp"
    STAGE_OF = 1
    ARGS = ("epoch", "wtab_ptr", "wd_ptr", "act_ptr", "tp_parts_ptr", "peer_parts_ptr", "LAYERS", "D", "FFN",
            "DOWN_ROWS", "DOWN_K", "DOWN_BK", "STAGES", "RED_ROWS", "O_CHUNKS", "DOWN_CHUNKS", "TP_RANK")
    device = down_tp_device
    SCRATCH = _ToBoth.SCRATCH

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["act"].view(c.layers, c.ffn)[self.layer, k0:k1]
        self._send(lay, st, st.weights[self.layer]["down"][lo:hi, k0:k1].float() @ a)
