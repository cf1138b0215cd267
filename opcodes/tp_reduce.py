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
from .oproj import OProj
from .residual import Residual
from .tp_push import TPRowBlock, recv_slot, tp_partial


@triton.jit
def tp_reduce_device(layer, stage, row0, epoch, x_ptr, xout_ptr, out_ptr, x1_ptr, opart_ptr, dpart_ptr, tp_recv_ptr,
                     LAYERS: tl.constexpr, D: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                     RED_ROWS: tl.constexpr, TP_RANK: tl.constexpr, INTERP: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    mine = tp_partial(layer, stage, rows, rm, opart_ptr, dpart_ptr, D, O_CHUNKS, DOWN_CHUNKS, RED_ROWS)
    slot = epoch % 2
    peer = tl.load(tp_recv_ptr + ((slot * LAYERS + layer) * 2 + stage) * D + rows, mask=rm, other=0.0,
                   cache_modifier=".cg")
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
    ARGS = ("epoch", "x_ptr", "xout_ptr", "out_ptr", "x1_ptr", "opart_ptr", "dpart_ptr", "tp_recv_ptr", "LAYERS",
            "D", "O_CHUNKS", "DOWN_CHUNKS", "RED_ROWS", "TP_RANK", "INTERP")
    CONSTEXPRS = {"RED_ROWS": lambda lay: lay.tiling.red_rows, "O_CHUNKS": lambda lay: lay.n_o_k,
                  "TP_RANK": lambda lay: getattr(lay, "tp_rank", 0)}
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    device = tp_reduce_device

    SCRATCH = {"x1": "fp32", "xout": "bf16"}       # declared alike by OPROJ / RESIDUAL

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"x1": OProj.scratch_shapes(lay)["x1"], "xout": Residual.scratch_shapes(lay)["xout"]}

    def reads(self, lay: Layout) -> list[Region]:
        d = lay.cfg.d
        lo, hi = self._rows(lay)
        out = self.own_parts(lay) + [self.recv_region(lay)]
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
        mine = self.own_partial(lay, st)
        peer = recv_slot(lay, st.buf["tp_recv"], st.epoch)[self.layer, self.stage, lo:hi]
        s = mine + peer if lay.tp_rank == 0 else peer + mine
        if self.stage == 0:
            st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] = st.layer_input(self.layer)[lo:hi].float() + s
        else:
            y = st.buf["x1"].view(c.layers, c.d)[self.layer, lo:hi] + s
            st.buf["xout"].view(c.layers, c.d)[self.layer, lo:hi] = y.to(torch.bfloat16)
