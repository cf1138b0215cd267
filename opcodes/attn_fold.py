"""ATTN_PARTIAL_FOLD: an attention partial that also does its KV group's merge when it is the last
of the group to finish (``Tiling.attn_fold``; a "last arriver" reduction, ``Instruction.ARRIVAL``).

It computes and stores its partial exactly as ATTN_PARTIAL does, then counts itself on the group's
arrival counter (operand ``arrive``, ``part[l,g]``) with one acq_rel atomic add. The partial whose
add sees ``SPLITS * epoch - 1`` (the others of this call have all arrived, and their partials are
visible: each released its stores with its add, this add acquires them) merges ALL splits of the
group's query heads with ATTN_REDUCE's own code (``attn_reduce_load`` / ``attn_reduce_store``, so the
result is bitwise what ATTN_REDUCE writes, whichever partial is last; four heads at a time, their
loads before their stores), and signals the tape's counter (``attn[l]``, or
``attn[l,oc]`` with a split O projection), whose per-call target is the number of groups. The
others signal nothing. So the O projection waits one dependency hop less: no ATTN_REDUCE instruction
polls the partials' counter and then signals its own.

The arrival counter is never waited on; like every counter it grows by its target (SPLITS) per
call, and the kernel zeroes it with the others every ``epoch_limit`` calls (the epoch starts over).
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .attn_partial import AttnPartial, attn_partial_device
from .attn_reduce import AttnReduce, attn_reduce_load, attn_reduce_store
from .base import Cost, Layout, Region, register


@triton.jit
def _signal(ptr):
    # interp.sync.signal_counter (not imported: the interp package imports the opcodes)
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def _merge4(layer, h, LEFT: tl.constexpr, part_o_ptr, part_ml_ptr, attn_ptr,
            NQ: tl.constexpr, HD: tl.constexpr, SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    # heads h .. h + min(4, LEFT) - 1: every load, then every merge and store (ATTN_REDUCE's code)
    m0, l0, o0 = attn_reduce_load(layer, h, part_o_ptr, part_ml_ptr, NQ, HD, SPLITS, SPLITS_PAD)
    if LEFT > 1:
        m1, l1, o1 = attn_reduce_load(layer, h + 1, part_o_ptr, part_ml_ptr, NQ, HD, SPLITS, SPLITS_PAD)
        if LEFT > 2:
            m2, l2, o2 = attn_reduce_load(layer, h + 2, part_o_ptr, part_ml_ptr, NQ, HD, SPLITS, SPLITS_PAD)
            if LEFT > 3:
                m3, l3, o3 = attn_reduce_load(layer, h + 3, part_o_ptr, part_ml_ptr, NQ, HD, SPLITS, SPLITS_PAD)
                attn_reduce_store(layer, h + 3, m3, l3, o3, attn_ptr, NQ, HD, SPLITS, SPLITS_PAD)
            attn_reduce_store(layer, h + 2, m2, l2, o2, attn_ptr, NQ, HD, SPLITS, SPLITS_PAD)
        attn_reduce_store(layer, h + 1, m1, l1, o1, attn_ptr, NQ, HD, SPLITS, SPLITS_PAD)
    attn_reduce_store(layer, h, m0, l0, o0, attn_ptr, NQ, HD, SPLITS, SPLITS_PAD)


@triton.jit
def attn_partial_fold_device(layer, g, s, arrive, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, part_o_ptr, part_ml_ptr,
                             attn_ptr, ins, cnt_ptr, epoch,
                             NQ: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                             MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, SPLITS: tl.constexpr,
                             SPLITS_PAD: tl.constexpr, ATTN_BLOCK: tl.constexpr, INTERP: tl.constexpr,
                             ATTN_STAGES: tl.constexpr):
    attn_partial_device(layer, g, s, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, part_o_ptr, part_ml_ptr,
                        NQ, HD, GROUP, GROUP_PAD, MAX_SEQ, QSCALE, SPLITS, ATTN_BLOCK, INTERP, ATTN_STAGES)
    # every thread's partial stores, then one arrival: release them, acquire the earlier arrivals'
    tl.debug_barrier()
    seen = tl.atomic_add(cnt_ptr + arrive, 1, sem="acq_rel", scope="gpu")
    if seen == SPLITS * epoch - 1:
        # the last of the group: merge every split, in ATTN_REDUCE's order and arithmetic. Four heads
        # at a time, their loads before any store (a store in between would keep the compiler from
        # issuing the next head's loads early: one L2 round trip per head)
        for hh in tl.static_range(0, GROUP, 4):
            _merge4(layer, g * GROUP + hh, GROUP - hh, part_o_ptr, part_ml_ptr, attn_ptr, NQ, HD, SPLITS, SPLITS_PAD)
        sig = tl.load(ins + 5)
        if sig >= 0:
            _signal(cnt_ptr + sig)


@register
@dataclass(frozen=True)
class AttnPartialFold(AttnPartial):
    # ATTN_PARTIAL's operands (layer, g, s), then:
    arrive: int   # the group's arrival counter (part[l,g])

    NAME = "attn_partial_fold"
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "part_o_ptr", "part_ml_ptr", "attn_ptr",
            "ins", "cnt_ptr", "epoch",
            "NQ", "HD", "GROUP", "GROUP_PAD", "MAX_SEQ", "QSCALE", "SPLITS", "SPLITS_PAD", "ATTN_BLOCK", "INTERP",
            "ATTN_STAGES")
    CONSTEXPRS = {**AttnPartial.CONSTEXPRS, "SPLITS_PAD": AttnReduce.CONSTEXPRS["SPLITS_PAD"]}
    # only in the kernels of tapes that hold it (Tiling.attn_fold): the default kernels keep their code
    IN_EVERY_KERNEL = False
    ARRIVAL = "arrive"
    SIGNALS_ITSELF = True
    device = attn_partial_fold_device

    SCRATCH = {"part_o": "fp32", "part_ml": "fp32", "attn": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {**AttnPartial.scratch_shapes(lay), **AttnReduce.scratch_shapes(lay)}

    @classmethod
    def arrivals(cls, lay: Layout) -> int:
        return lay.tiling.attn_splits

    def merge_key(self) -> tuple:
        return (self.layer, self.g)

    def _reduces(self, lay: Layout) -> list[AttnReduce]:
        G = lay.cfg.group
        return [AttnReduce(self.layer, h) for h in range(self.g * G, (self.g + 1) * G)]

    def merge_reads(self, lay: Layout) -> list[Region]:
        return [r for red in self._reduces(lay) for r in red.reads(lay)]

    def merge_writes(self, lay: Layout) -> list[Region]:
        return [r for red in self._reduces(lay) for r in red.writes(lay)]

    def merge_torch(self, lay: Layout, st) -> None:
        for red in self._reduces(lay):
            red.run_torch(lay, st)

    def check_operands(self, lay: Layout) -> list[str]:
        bad = super().check_operands(lay)
        if self.arrive < 0:
            bad.append(f"arrive {self.arrive} is not a counter")
        return bad

    def cost(self, lay: Layout, n_keys: int | None = None) -> Cost:
        """The partial's; the merge (one in ``SPLITS`` of them runs it) is counted evenly."""
        p = super().cost(lay, n_keys)
        r = AttnReduce(self.layer, 0).cost(lay)
        ns, G = lay.tiling.attn_splits, lay.cfg.group
        return Cost(p.hbm_bytes, p.l2_bytes + G * r.l2_bytes // ns, p.flops + G * r.flops // ns)
