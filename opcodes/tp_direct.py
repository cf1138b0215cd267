"""Tensor parallel all-reduces signalled through their data (``Tiling.tp_direct``; not yet measured on a
GPU, bench/NOTES.md v54): O and down tiles that send their partial rows to both ranks themselves, and
the reduce that waits on those rows.

    OPROJ_TP / DOWN_TP:  y[r] = W[r, K_chunk] . v[K_chunk]          (as OPROJ / DOWN compute it)
                         tp_parts[epoch % 2][..][this rank][chunk][r] = epoch << 32 | bits(y[r])
                         on this rank AND on the peer (two 8-byte stores a row; no fence, no counter)
    TP_REDUCE_D:         s[r] = (rank 0's chunks summed in order) + (rank 1's)   (as TP_PUSH + TP_REDUCE)
                         then x1 / the layer output as TP_REDUCE writes them

A word read whole is this call's value exactly when its high half is the call number (one 8-byte
store, as NCCL's LL protocol), so the words are the signal (``TO_BOTH``): the kernel's wait on such a
counter checks the words its instruction reads (``interp.sync.ll_seen``, bounded in time like every
tensor-parallel wait), and the TP_PUSH stage and its dispatch hop disappear. Only the kernels of
tp_direct tapes hold these branches; every other kernel is unchanged.

One parity slot of ``tp_parts`` is, per layer, [stage 0: row block][src rank][O chunk][row] then
[stage 1: ... down chunk ...]: a row block's words, both ranks' and every chunk's, are one range.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, register
from .common import T_WD, T_WO, gemv_stream, tab_offset
from .down import Down
from .oproj import OProj
from .tp_reduce import TPReduce, reduce_store


@triton.jit
def ll_pack(y, epoch):
    """fp32 values -> words ``epoch << 32 | bits(y)``."""
    return (epoch.to(tl.int64) << 32) | (y.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF)


@triton.jit
def ll_unpack(w, epoch):
    """The fp32 values of words; NaN where a word is not call ``epoch``'s (never, if the wait checked
    them: a NaN in the output is a broken protocol made loud)."""
    y = w.to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where((w >> 32).to(tl.int32) == epoch, y, float("nan"))


def ll_pack_torch(y: torch.Tensor, epoch: int) -> torch.Tensor:
    """:func:`ll_pack` in torch (the tape VM)."""
    return (y.float().view(torch.int32).to(torch.int64) & 0xFFFFFFFF) | (int(epoch) << 32)


def ll_unpack_torch(w: torch.Tensor, epoch: int) -> torch.Tensor:
    """:func:`ll_unpack` in torch."""
    lo = w & 0xFFFFFFFF
    y = torch.where(lo >= 2 ** 31, lo - 2 ** 32, lo).to(torch.int32).view(torch.float32)
    return torch.where((w >> 32) == int(epoch), y, torch.full_like(y, float("nan")))


def parts_shape(lay: Layout) -> tuple[int, int]:
    """``tp_parts``: two parity slots of :func:`parts_offset`'s words."""
    return (2, lay.cfg.layers * 2 * lay.cfg.d * (lay.n_o_k + lay.n_down_k))


def parts_offset(lay: Layout, layer: int, stage: int, row: int, src: int, ch: int) -> int:
    """The word of ``row`` of rank ``src``'s chunk ``ch`` of ``stage`` (0: O, 1: down) in one slot."""
    d, rr = lay.cfg.d, lay.tiling.red_rows
    chs = lay.n_o_k if stage == 0 else lay.n_down_k
    base = layer * 2 * d * (lay.n_o_k + lay.n_down_k) + stage * 2 * d * lay.n_o_k
    return base + ((row // rr * 2 + src) * chs + ch) * rr + row % rr


@triton.jit
def parts_offsets(layer, stage, rows, src, ch, D: tl.constexpr, RED_ROWS: tl.constexpr, O_CHUNKS: tl.constexpr,
                  DOWN_CHUNKS: tl.constexpr):
    """:func:`parts_offset` of the rows ``rows`` (a tensor), in the kernel."""
    chs = tl.where(stage == 0, O_CHUNKS, DOWN_CHUNKS)
    base = layer * (2 * D * (O_CHUNKS + DOWN_CHUNKS)) + stage * (2 * D * O_CHUNKS)
    return base + ((rows // RED_ROWS * 2 + src) * chs + ch) * RED_ROWS + rows % RED_ROWS


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
    SCRATCH = {"tp_parts": "i64"}       # [slot][layer][stage][row block][src][chunk][row] (module docstring)
    STAGE_OF = 0                        # 0: O, 1: down

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return getattr(lay, "tp_size", 1) == 2

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"tp_parts": parts_shape(lay)}

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
    # and an empty dpart: QKV takes its pointer (the residual fold, never on in a TP layout)
    SCRATCH = {**_ToBoth.SCRATCH, "dpart": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"tp_parts": parts_shape(lay), "dpart": (0,)}

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        k0, k1 = self._ks(lay)
        a = st.buf["act"].view(c.layers, c.ffn)[self.layer, k0:k1]
        self._send(lay, st, st.weights[self.layer]["down"][lo:hi, k0:k1].float() @ a)


@triton.jit
def _parts_sum(tp_parts_ptr, layer, stage, rows, rm, src, epoch, LAYERS: tl.constexpr, D: tl.constexpr,
               RED_ROWS: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr):
    """Rank ``src``'s partial of ``rows``: its chunks in order (fp32, as TP_PUSH sums them)."""
    y = tl.zeros((RED_ROWS,), dtype=tl.float32)
    base = tp_parts_ptr + (epoch % 2) * (LAYERS * 2 * D * (O_CHUNKS + DOWN_CHUNKS))
    for k in range(tl.where(stage == 0, O_CHUNKS, DOWN_CHUNKS)):
        off = parts_offsets(layer, stage, rows, src, k, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS)
        y += ll_unpack(tl.load(base + off, mask=rm, other=0, volatile=True), epoch)
    return y


@triton.jit
def tp_reduce_d_device(layer, stage, row0, epoch, x_ptr, xout_ptr, out_ptr, x1_ptr, tp_parts_ptr,
                       LAYERS: tl.constexpr, D: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                       RED_ROWS: tl.constexpr, INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    s = _parts_sum(tp_parts_ptr, layer, stage, rows, rm, 0, epoch, LAYERS, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS) + \
        _parts_sum(tp_parts_ptr, layer, stage, rows, rm, 1, epoch, LAYERS, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS)
    reduce_store(s, layer, stage, rows, rm, x_ptr, xout_ptr, out_ptr, x1_ptr, LAYERS, D, INTERP)


@register
@dataclass(frozen=True)
class TPReduceD(TPReduce):
    """TP_REDUCE of a tp_direct tape: both ranks' partials from ``tp_parts`` (module docstring)."""

    NAME = "tp_reduce_d"
    ARGS = ("epoch", "x_ptr", "xout_ptr", "out_ptr", "x1_ptr", "tp_parts_ptr", "LAYERS", "D", "O_CHUNKS",
            "DOWN_CHUNKS", "RED_ROWS", "INTERP")
    device = tp_reduce_d_device
    SCRATCH = {"x1": "fp32", "xout": "bf16", "tp_parts": "i64"}     # declared alike by OPROJ / RESIDUAL / OPROJ_TP

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {**{k: v for k, v in TPReduce.scratch_shapes(lay).items() if k in cls.SCRATCH},
                "tp_parts": parts_shape(lay)}

    def parts_region(self, lay: Layout) -> Region:
        """The block's words in ``tp_parts``, both ranks' and every chunk's."""
        lo, hi = self._rows(lay)
        o = parts_offset(lay, self.layer, self.stage, lo, 0, 0)
        chs = lay.n_o_k if self.stage == 0 else lay.n_down_k
        return Region("tp_parts", o, o + 2 * chs * (hi - lo))

    def reads(self, lay: Layout) -> list[Region]:
        return [self.parts_region(lay)] + self.residual_reads(lay)

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        n = 2 * (lay.n_o_k if self.stage == 0 else lay.n_down_k)       # both ranks' chunks, 8-byte words
        return Cost(hbm_bytes=0, l2_bytes=(8 * n + 3 * 4) * (hi - lo), flops=(n + 1) * (hi - lo))

    def stage_sum(self, lay: Layout, st) -> torch.Tensor:
        lo, hi = self._rows(lay)
        chs = lay.n_o_k if self.stage == 0 else lay.n_down_k
        words = st.buf["tp_parts"].view(2, -1)[st.epoch % 2]
        p = []
        for src in (0, 1):
            y = torch.zeros(hi - lo, dtype=torch.float32)
            for k in range(chs):
                o = parts_offset(lay, self.layer, self.stage, lo, src, k)
                y += ll_unpack_torch(words[o:o + hi - lo], st.epoch)
            p.append(y)
        return p[0] + p[1]
