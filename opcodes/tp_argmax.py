"""TP_ARGMAX_PUSH and TP_ARGMAX: tensor parallel (2 ranks): the greedy token across the ranks'
vocabulary slices, the same on both ranks.

Each rank's LM_HEAD tiles cover its vocabulary slice (``opcodes.tp.TPDecoderLayout``: ``lm_vocab =
vocab / 2`` rows, local indices) and leave one (max, local index) partial per tile in ``amax``. Then

    TP_ARGMAX_PUSH(nparts):  (v_me, i_me) = the rank's best partial (largest value, then lowest index),
                             i_me += tp_rank * lm_vocab                       (the global vocabulary id)
                             peer.tp_am_recv[epoch % 2] = (v_me, i_me)        then signal the PEER's counter
    TP_ARGMAX(nparts):       waits on its own LM head tiles and on the counter the peer's push signals;
                             (v_me, i_me) again from its own partials, (v_peer, i_peer) from tp_am_recv;
                             rank 0's pair, then rank 1's: tok = i_1 if v_1 > v_0 else i_0
                             tok_ptr[0] = tok, toks_ptr[pos] = tok            (where ARGMAX writes them)

Rank 0's ids are all below rank 1's, so taking rank 1's pair only when its value is strictly larger
gives ties to the lowest global index (``opcodes.tp.tp_argmax``); both ranks compare the same two
fp32 pairs in the same order, so they write the same token, and the next call's EMBED on each rank
reads its own ``tok``. Two instructions, not one, because a wait precedes an instruction and its
signal follows it: the push must signal before the pick can wait on the peer's push (the pattern of
TP_PUSH / TP_REDUCE, ``opcodes/tp_push.py``; TP_ARGMAX recomputes its own pair from ``amax`` as
TP_REDUCE recomputes its own partial). The receive buffer has two slots, by call parity
(:attr:`PARITY_SLOTS`; why two suffice: ``schedule.verify``).

The device function of the push writes through ``peer_am_recv_ptr``, the peer's ``tp_am_recv``
mapped into this GPU's address space, with plain stores, as TP_PUSH does: the kernel's signal after
the instruction is the release (a system-scope release on the peer's counter in a TP kernel, and
the peer's wait a system-scope acquire: ``interp/codegen.py``; run so far only in the CPU loopback
of ``interp.tp``); TP_ARGMAX
reads the peer's pair with ``.cg`` loads after its wait, as TP_REDUCE reads ``tp_recv``. No
single-GPU kernel holds either opcode (``IN_EVERY_KERNEL = False``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .argmax import Argmax
from .argmax import best_pair, best_partial
from .base import Cost, Instruction, Layout, Region, Timing, register
from .lm_head import LMHead
from .tp_reduce import TPReduce


@triton.jit
def tp_local_best(nparts, amax_ptr, LM_VOCAB: tl.constexpr, AM_BLOCK: tl.constexpr, TP_RANK: tl.constexpr):
    """(largest value, lowest GLOBAL index attaining it) of this rank's ``nparts`` LM head partials:
    ARGMAX's reduction, the index then moved to the rank's vocabulary slice."""
    best_v, best_i = best_partial(nparts, amax_ptr, LM_VOCAB, AM_BLOCK)
    return best_v, best_i + TP_RANK * LM_VOCAB           # exact in fp32 below 2^24


@triton.jit
def tp_argmax_push_device(nparts, epoch, amax_ptr, peer_am_recv_ptr, LM_VOCAB: tl.constexpr, AM_BLOCK: tl.constexpr,
                          TP_RANK: tl.constexpr):
    v, i = tp_local_best(nparts, amax_ptr, LM_VOCAB, AM_BLOCK, TP_RANK)
    slot = epoch % 2
    tl.store(peer_am_recv_ptr + 2 * slot, v)
    tl.store(peer_am_recv_ptr + 2 * slot + 1, i)


@triton.jit
def tp_argmax_device(nparts, epoch, pos, amax_ptr, tp_am_recv_ptr, tok_ptr, toks_ptr, LM_VOCAB: tl.constexpr,
                     AM_BLOCK: tl.constexpr, TP_RANK: tl.constexpr):
    v, i = tp_local_best(nparts, amax_ptr, LM_VOCAB, AM_BLOCK, TP_RANK)
    slot = epoch % 2
    pv = tl.load(tp_am_recv_ptr + 2 * slot, cache_modifier=".cg")
    pi = tl.load(tp_am_recv_ptr + 2 * slot + 1, cache_modifier=".cg")
    if TP_RANK == 0:
        tok = tl.where(pv > v, pi, i)            # rank 0's pair is mine, rank 1's the peer's
    else:
        tok = tl.where(v > pv, i, pi)            # rank 0's pair is the peer's, rank 1's mine
    tok = tok.to(tl.int32)
    tl.store(tok_ptr, tok)
    tl.store(toks_ptr + pos, tok)


def local_best(lay: Layout, amax: torch.Tensor, nparts: int) -> tuple[float, int]:
    """The device function's (value, global index) of this rank's partials, in torch (for the VM)."""
    best_v, best_i = best_pair(amax, nparts, lay.lm_vocab)
    return best_v, int(best_i) + lay.tp_rank * lay.lm_vocab


def pick(rank0: tuple[float, float], rank1: tuple[float, float]) -> int:
    """The token from rank 0's and rank 1's (value, global index) pairs: rank 1's only if larger."""
    return int(rank1[1] if rank1[0] > rank0[0] else rank0[1])


@dataclass(frozen=True)
class _TPArgmaxBase(Instruction):
    """The operand and the checks both opcodes share: ``nparts`` LM head partials of a
    tensor-parallel decoder layout."""
    nparts: int      # LM head partials of this rank (= TPDecoderLayout.n_lm_tiles)

    STAGE = 8
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    WHOLE_MODEL = True
    # declared alike by LM_HEAD, ARGMAX and TP_REDUCE (one value per kernel)
    CONSTEXPRS = {"LM_VOCAB": LMHead.CONSTEXPRS["LM_VOCAB"], "AM_BLOCK": Argmax.CONSTEXPRS["AM_BLOCK"],
                  "TP_RANK": TPReduce.CONSTEXPRS["TP_RANK"]}

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return lay.WHOLE_MODEL and getattr(lay, "tp_size", 1) == 2

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return [f"{self.NAME} needs a tensor-parallel decoder layout (opcodes.tp.TPDecoderLayout), got "
                    f"{type(lay).__name__}"]
        n = lay.n_lm_tiles
        if self.nparts != n:
            return [f"nparts {self.nparts} is not the number of LM head tiles ({n})"]
        return []

    def cost(self, lay: Layout) -> Cost:
        return Cost(hbm_bytes=0, l2_bytes=8 * self.nparts + 16, flops=2 * self.nparts)

    def own_pair(self, lay: Layout, st) -> tuple[float, int]:
        return local_best(lay, st.buf["amax"], self.nparts)


def recv_slot(buf: torch.Tensor, epoch: int) -> torch.Tensor:
    """The (value, index) pair of ``tp_am_recv`` (a flat tensor of both slots) that call ``epoch`` uses."""
    return buf.view(2, 2)[epoch % 2]


@register
@dataclass(frozen=True)
class TPArgmaxPush(_TPArgmaxBase):
    NAME = "tp_argmax_push"
    ARGS = ("epoch", "amax_ptr", "peer_am_recv_ptr", "LM_VOCAB", "AM_BLOCK", "TP_RANK")
    SIGNALS_PEER = True         # its signal is the peer's counter
    WRITES_PEER = True          # its writes land in the peer's tp_am_recv
    PARITY_SLOTS = {"tp_am_recv": 2}
    PEER_POINTERS = {"peer_am_recv_ptr": "tp_am_recv"}     # the peer's tp_am_recv
    device = tp_argmax_push_device

    SCRATCH = {"tp_am_recv": "fp32"}      # [slot, (max logit, global index)]: what the peer pushed

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"tp_am_recv": (2, 2)}

    def reads(self, lay: Layout) -> list[Region]:
        return [Region("amax", 0, 2 * self.nparts)]

    def writes(self, lay: Layout) -> list[Region]:
        return [Region("tp_am_recv", 0, 2)]

    def run_torch(self, lay: Layout, st) -> None:
        v, i = self.own_pair(lay, st)
        slot = recv_slot(st.peer_buf["tp_am_recv"], st.epoch)
        slot[0] = v
        slot[1] = float(i)


@register
@dataclass(frozen=True)
class TPArgmax(_TPArgmaxBase):
    NAME = "tp_argmax"
    ARGS = ("epoch", "pos", "amax_ptr", "tp_am_recv_ptr", "tok_ptr", "toks_ptr", "LM_VOCAB", "AM_BLOCK", "TP_RANK")
    device = tp_argmax_device

    # as ARGMAX: tok read by the next call's EMBED, toks[pos] the token predicted at pos
    STATE = {"tok": "i32", "toks": "i32"}

    @classmethod
    def state_shapes(cls, lay: Layout) -> dict:
        return Argmax.state_shapes(lay)

    def reads(self, lay: Layout) -> list[Region]:
        return [Region("amax", 0, 2 * self.nparts), Region("tp_am_recv", 0, 2)]

    def run_torch(self, lay: Layout, st) -> None:
        mine = self.own_pair(lay, st)
        pv, pi = (float(t) for t in recv_slot(st.buf["tp_am_recv"], st.epoch))
        peer = (pv, pi)
        st.next_token = pick(mine, peer) if lay.tp_rank == 0 else pick(peer, mine)
