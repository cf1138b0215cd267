"""TP_REDUCE: tensor parallel (2 ranks): the all-reduce of one row block, in a fixed rank order.

    s[r] = P_0[r] + P_1[r]          (fp32; P_me from this rank's chunks, P_peer from tp_recv)
    stage 0:  x1[r]   = x[r] + s[r]                  (fp32; x: the layer input)
    stage 1:  out[r]  = bf16(x1[r] + s[r])           (the layer's output, as RESIDUAL writes it)

Both ranks add rank 0's partial, then rank 1's, and then the residual, the same fp32 operations on
the same values (this rank's own partial is summed from its chunks in the order TP_PUSH sums them),
so the two ranks' residual streams stay bitwise identical. It replaces O_REDUCE (stage 0) and
RESIDUAL (stage 1) in a tensor-parallel program; it waits on this rank's partial counter and on the
counter the peer's TP_PUSH signals. ``tp_recv`` slot ``epoch % 2`` (see ``opcodes/tp_push.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, Timing, register
from .common import layer_input, to_bf16
from .down import Down
from .oproj import OProj
from .residual import Residual
from .tp_push import (TPPush, TPRowBlock, ll_unpack, ll_unpack_torch, parts_offset, parts_offsets, parts_shape,
                      recv_slot, tp_partial)


@triton.jit
def _parts_sum(tp_parts_ptr, layer, stage, rows, rm, src, epoch, LAYERS: tl.constexpr, D: tl.constexpr,
               RED_ROWS: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr):
    """Rank ``src``'s partial of ``rows`` from ``tp_parts`` (``Tiling.tp_direct``): its chunks in order."""
    y = tl.zeros((RED_ROWS,), dtype=tl.float32)
    base = tp_parts_ptr + (epoch % 2) * (LAYERS * 2 * D * (O_CHUNKS + DOWN_CHUNKS))
    for k in range(tl.where(stage == 0, O_CHUNKS, DOWN_CHUNKS)):
        off = parts_offsets(layer, stage, rows, src, k, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS)
        y += ll_unpack(tl.load(base + off, mask=rm, other=0, volatile=True), epoch)
    return y


@triton.jit
def tp_reduce_device(layer, stage, row0, epoch, x_ptr, xout_ptr, out_ptr, x1_ptr, opart_ptr, dpart_ptr, tp_recv_ptr,
                     tp_parts_ptr, LAYERS: tl.constexpr, D: tl.constexpr, O_CHUNKS: tl.constexpr,
                     DOWN_CHUNKS: tl.constexpr, RED_ROWS: tl.constexpr, TP_RANK: tl.constexpr,
                     TP_DIRECT: tl.constexpr, INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    if TP_DIRECT:
        s = _parts_sum(tp_parts_ptr, layer, stage, rows, rm, 0, epoch, LAYERS, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS) + \
            _parts_sum(tp_parts_ptr, layer, stage, rows, rm, 1, epoch, LAYERS, D, RED_ROWS, O_CHUNKS, DOWN_CHUNKS)
    else:
        mine = tp_partial(layer, stage, rows, rm, opart_ptr, dpart_ptr, D, O_CHUNKS, DOWN_CHUNKS, RED_ROWS)
        slot = epoch % 2
        peer = ll_unpack(tl.load(tp_recv_ptr + ((slot * LAYERS + layer) * 2 + stage) * D + rows, mask=rm, other=0,
                                 volatile=True), epoch)
        if TP_RANK == 0:
            s = mine + peer
        else:
            s = peer + mine
    if stage == 0:
        xin = layer_input(x_ptr, xout_ptr, layer, D)
        xr = tl.load(xin + rows, mask=rm, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(x1_ptr + layer * D + rows, xr + s, mask=rm)
    else:
        y = tl.load(x1_ptr + layer * D + rows, mask=rm, other=0.0, cache_modifier=".cg") + s
        if layer == LAYERS - 1:
            dst = out_ptr
        else:
            dst = xout_ptr + layer * D
        tl.store(dst + rows, to_bf16(y, INTERP), mask=rm)


@register
@dataclass(frozen=True)
class TPReduce(TPRowBlock):
    layer: int
    stage: int      # 0: x1 = x + all-reduced O projection, 1: out = x1 + all-reduced down projection
    row0: int

    NAME = "tp_reduce"
    STAGE = 6
    ARGS = ("epoch", "x_ptr", "xout_ptr", "out_ptr", "x1_ptr", "opart_ptr", "dpart_ptr", "tp_recv_ptr", "tp_parts_ptr",
            "LAYERS", "D", "O_CHUNKS", "DOWN_CHUNKS", "RED_ROWS", "TP_RANK", "TP_DIRECT", "INTERP")
    CONSTEXPRS = {"RED_ROWS": lambda lay: lay.tiling.red_rows, "O_CHUNKS": lambda lay: lay.n_o_k,
                  "TP_RANK": lambda lay: getattr(lay, "tp_rank", 0),
                  "TP_DIRECT": lambda lay: lay.tiling.tp_direct}
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    device = tp_reduce_device

    # x1, xout: declared alike by OPROJ / RESIDUAL; the buffers it reads what the ranks sent in, tp_recv
    # and tp_parts (Tiling.tp_direct), alike by TP_PUSH and OPROJ_TP / DOWN_TP (one of them is empty)
    # (and opart / dpart alike by OPROJ / DOWN, which a tp_direct tape does not hold)
    SCRATCH = {"x1": "fp32", "xout": "bf16", "tp_recv": "i64", "tp_parts": "i64", "opart": "fp32", "dpart": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"x1": OProj.scratch_shapes(lay)["x1"], "xout": Residual.scratch_shapes(lay)["xout"],
                "tp_recv": TPPush.scratch_shapes(lay)["tp_recv"], "tp_parts": parts_shape(lay),
                "opart": (0,) if lay.tiling.tp_direct else OProj.scratch_shapes(lay)["opart"],
                "dpart": (0,) if lay.tiling.tp_direct else Down.scratch_shapes(lay)["dpart"]}

    def parts_region(self, lay: Layout) -> Region:
        """``Tiling.tp_direct``: the block's words in ``tp_parts``, both ranks' and every chunk's."""
        lo, hi = self._rows(lay)
        o = parts_offset(lay, self.layer, self.stage, lo, 0, 0)
        chs = lay.n_o_k if self.stage == 0 else lay.n_down_k
        return Region("tp_parts", o, o + 2 * chs * (hi - lo))

    def reads(self, lay: Layout) -> list[Region]:
        d = lay.cfg.d
        lo, hi = self._rows(lay)
        out = [self.parts_region(lay)] if lay.tiling.tp_direct else self.own_parts(lay) + [self.recv_region(lay)]
        if self.stage == 1:
            out.append(Region("x1", self.layer * d + lo, self.layer * d + hi))
        elif self.layer > 0:
            out.append(Region("xout", (self.layer - 1) * d + lo, (self.layer - 1) * d + hi))
        return out

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._rows(lay)
        base = self.layer * lay.cfg.d
        return [Region("x1" if self.stage == 0 else "xout", base + lo, base + hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        n = lay.n_o_k if self.stage == 0 else lay.n_down_k
        return Cost(hbm_bytes=0, l2_bytes=4 * (n + 3) * (hi - lo), flops=(n + 2) * (hi - lo))

    def run_torch(self, lay: Layout, st) -> None:
        c = lay.cfg
        lo, hi = self._rows(lay)
        if lay.tiling.tp_direct:
            chs = lay.n_o_k if self.stage == 0 else lay.n_down_k
            words = st.buf["tp_parts"].view(2, -1)[st.epoch % 2]
            p = []
            for src in (0, 1):
                y = torch.zeros(hi - lo, dtype=torch.float32)
                for k in range(chs):
                    o = parts_offset(lay, self.layer, self.stage, lo, src, k)
                    y += ll_unpack_torch(words[o:o + hi - lo], st.epoch)
                p.append(y)
            s = p[0] + p[1]
        else:
            mine = self.own_partial(lay, st)
            peer = ll_unpack_torch(recv_slot(lay, st.buf["tp_recv"], st.epoch)[self.layer, self.stage, lo:hi], st.epoch)
            s = mine + peer if lay.tp_rank == 0 else peer + mine
        if self.stage == 0:
            st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = st.layer_input(self.layer)[lo:hi].float() + s
        else:
            y = st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] + s
            st.buf["xout"].view(c.layers, c.d)[self.layer, lo:hi] = y.to(torch.bfloat16)
