"""TP_PUSH: tensor parallel (2 ranks): send this rank's partial of one row block to the peer.

    P_me[r] = sum_{k = 0..CHUNKS-1} part[k, r]            (fp32, chunks in order)
    peer.tp_recv[epoch % 2, layer, stage, r] = P_me[r]    then signal the PEER's counter

``stage`` 0 is the O projection (``part`` = ``opart``, OPROJ's per-chunk partials), stage 1 the
down projection (``part`` = ``dpart``). The receive buffer ``tp_recv`` has two slots (double
buffering by call parity, :attr:`PARITY_SLOTS`): call ``epoch`` writes slot ``epoch % 2``, so a rank
that is one call ahead of its peer never overwrites what the peer has not read yet (a rank cannot be
two calls ahead: every call of a rank waits on counters its peer signals in the same call, see
``schedule.verify``). TP_REDUCE on the peer waits on the signalled counter.

The device function writes through ``peer_recv_ptr`` (:attr:`PEER_POINTERS`), the peer's ``tp_recv``
mapped into this GPU's address space, and the kernel sends its signal to the peer's counters
(``interp/codegen.py``: a system-scope release there). ``interp.tp`` binds them: so far only the CPU
loopback (both ranks in one process under the Triton interpreter) has run; no GPU has run a TP
kernel. No single-GPU kernel holds this opcode (``IN_EVERY_KERNEL = False``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Layout, Region, Timing, in_range, register, tile_start
from .residual import RowBlock

#: stages of a layer whose partials are all-reduced: the O projection, the down projection
STAGES = ("o", "down")


@triton.jit
def tp_partial(layer, stage, rows, rm, opart_ptr, dpart_ptr, D: tl.constexpr, O_CHUNKS: tl.constexpr,
               DOWN_CHUNKS: tl.constexpr, RED_ROWS: tl.constexpr):
    """This rank's partial of ``rows``: its chunks summed in order (fp32)."""
    y = tl.zeros((RED_ROWS,), dtype=tl.float32)
    if stage == 0:
        for k in range(O_CHUNKS):
            y += tl.load(opart_ptr + (layer * O_CHUNKS + k) * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    else:
        for k in range(DOWN_CHUNKS):
            y += tl.load(dpart_ptr + (layer * DOWN_CHUNKS + k) * D + rows, mask=rm, other=0.0,
                         cache_modifier=".cg")
    return y


@triton.jit
def tp_push_device(layer, stage, row0, epoch, opart_ptr, dpart_ptr, peer_recv_ptr,
                   LAYERS: tl.constexpr, D: tl.constexpr, O_CHUNKS: tl.constexpr, DOWN_CHUNKS: tl.constexpr,
                   RED_ROWS: tl.constexpr):
    rows = row0 + tl.arange(0, RED_ROWS)
    rm = rows < D
    y = tp_partial(layer, stage, rows, rm, opart_ptr, dpart_ptr, D, O_CHUNKS, DOWN_CHUNKS, RED_ROWS)
    slot = epoch % 2
    tl.store(peer_recv_ptr + ((slot * LAYERS + layer) * 2 + stage) * D + rows, y, mask=rm)


class TPRowBlock(RowBlock):
    """A row block of one all-reduced stage of a layer (``layer``, ``stage``, ``row0``)."""

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return getattr(lay, "tp_size", 1) == 2

    def check_operands(self, lay: Layout) -> list[str]:
        out = [] if self.applies(lay) else [f"{self.NAME} needs a tensor-parallel layout (TPLayout), got "
                                              f"{type(lay).__name__}"]
        return (out + in_range("layer", self.layer, lay.cfg.layers) + in_range("stage", self.stage, len(STAGES))
                + tile_start("row0", self.row0, lay.tiling.red_rows, lay.cfg.d))

    def own_parts(self, lay: Layout) -> list[Region]:
        """This rank's chunks of the stage's partial, over the block's rows."""
        return (self._partials(lay, "opart", lay.n_o_k) if self.stage == 0
                else self._partials(lay, "dpart", lay.n_down_k))

    def own_partial(self, lay: Layout, st) -> torch.Tensor:
        """The torch value of this rank's partial of the block (chunks summed in order, fp32)."""
        c = lay.cfg
        lo, hi = self._rows(lay)
        buf, n = ("opart", lay.n_o_k) if self.stage == 0 else ("dpart", lay.n_down_k)
        parts = st.buf[buf].view(c.layers, n, c.d)[self.layer, :, lo:hi]
        y = torch.zeros(hi - lo, dtype=torch.float32)
        for k in range(n):
            y += parts[k]
        return y

    def recv_region(self, lay: Layout) -> Region:
        """The block's rows of ``tp_recv`` (offsets inside one parity slot)."""
        lo, hi = self._rows(lay)
        base = (self.layer * len(STAGES) + self.stage) * lay.cfg.d
        return Region("tp_recv", base + lo, base + hi)


def recv_slot(lay: Layout, buf: torch.Tensor, epoch: int) -> torch.Tensor:
    """The slot of ``tp_recv`` (a flat tensor of both slots) that call ``epoch`` uses, as [layers, 2, d]."""
    c = lay.cfg
    return buf.view(2, c.layers, len(STAGES), c.d)[epoch % 2]


@register
@dataclass(frozen=True)
class TPPush(TPRowBlock):
    layer: int
    stage: int      # 0: the O projection's partial, 1: the down projection's
    row0: int

    NAME = "tp_push"
    STAGE = 6
    ARGS = ("epoch", "opart_ptr", "dpart_ptr", "peer_recv_ptr", "LAYERS", "D", "O_CHUNKS", "DOWN_CHUNKS", "RED_ROWS")
    CONSTEXPRS = {"RED_ROWS": lambda lay: lay.tiling.red_rows, "O_CHUNKS": lambda lay: lay.n_o_k}
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    SIGNALS_PEER = True         # its signal is the peer's counter
    WRITES_PEER = True          # its writes land in the peer's tp_recv
    PARITY_SLOTS = {"tp_recv": 2}
    PEER_POINTERS = {"peer_recv_ptr": "tp_recv"}     # the peer's tp_recv
    device = tp_push_device

    SCRATCH = {"tp_recv": "fp32"}     # [slot, layer, stage, d]: what the peer pushed

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"tp_recv": (2, lay.cfg.layers, len(STAGES), lay.cfg.d)}

    def reads(self, lay: Layout) -> list[Region]:
        return self.own_parts(lay)

    def writes(self, lay: Layout) -> list[Region]:
        return [self.recv_region(lay)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._rows(lay)
        n = lay.n_o_k if self.stage == 0 else lay.n_down_k
        return Cost(hbm_bytes=0, l2_bytes=4 * (n + 1) * (hi - lo), flops=n * (hi - lo))

    def run_torch(self, lay: Layout, st) -> None:
        lo, hi = self._rows(lay)
        recv_slot(lay, st.peer_buf["tp_recv"], st.epoch)[self.layer, self.stage, lo:hi] = self.own_partial(lay, st)
