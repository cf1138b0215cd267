"""ATTN_PARTIAL: flash-decoding partial attention of one KV head's query group over one split
of the key sequence (with ``Tiling.attn_splits`` 1: over every key, writing the merged output).

The cache prefix ``[0, pos)`` is cut into ``SPLITS - 1`` equal splits at run time (the tape is the
same at every position): split ``s < SPLITS-1`` covers ``[s*c, min((s+1)*c, pos))`` with
``c = cdiv(pos, SPLITS-1)``; split ``SPLITS-1`` covers the one key at ``pos`` that this call writes.
So only the last split depends on this call's K/V tiles: the prefix splits (nearly all the KV
bytes) wait for the group's Q tiles alone and run while K and V are still being projected.
The G = n_q / n_kv query heads that share KV head ``g`` are processed together, so each K/V
block is loaded once for all of them (GQA). Writes per query head the running max ``m``, the
sum ``l`` (base 2) and the unnormalised ``acc = sum_t p_t v_t`` for the reduction.
Bytes: ``2 * c * hd * 2`` of K and V from HBM.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, register
from .tiling import cdiv
from .common import T_KC, T_VC, mma, tab_offset, tape_waits, to_bf16


#: an attention split on the H200: (t0, per loaded HBM round trip, per key block) seconds, fitted
#: to six variants of block size and pipelining depth; see attention_latency
ATTN_LATENCY_H200 = (2.6e-6, 2.1e-6, 0.2e-6)


def attention_latency(lay: Layout, keys: int, t0: float = ATTN_LATENCY_H200[0], rt: float = ATTN_LATENCY_H200[1],
                      per_block: float = ATTN_LATENCY_H200[2]) -> float:
    """Seconds of one attention split over ``keys`` keys: ``t0 + trips * rt + blocks * per_block``
    with ``blocks = ceil(keys / attn_block)`` and ``trips = ceil(blocks / (attn_stages - 1))``: the
    pipelined key loop keeps ``attn_stages - 1`` blocks in flight."""
    t = lay.tiling
    blocks = max(1, -(-keys // t.attn_block))
    trips = -(-blocks // max(1, t.attn_stages - 1))
    return t0 + trips * rt + blocks * per_block


@triton.jit
def _attn_block(qs, k, v, km, m_i, l_i, acc, INTERP: tl.constexpr):
    """One K/V block of the online softmax: (m, l, acc) updated with the block's keys ``km``."""
    sc = mma(qs, tl.trans(k), INTERP)                           # [GROUP_PAD, ATTN_BLOCK] fp32
    sc = tl.where(km[None, :], sc, float("-inf"))
    return softmax_step(sc, v, m_i, l_i, acc, INTERP)


@triton.jit
def softmax_step(sc, v, m_i, l_i, acc, INTERP: tl.constexpr, AX: tl.constexpr = 1, EMPTY: tl.constexpr = False):
    """The online softmax's (m, l, acc) with one block more: its scores ``sc`` (fp32, base 2, masked keys
    -inf, keys along axis ``AX``: 2 for a batch of key groups) and values ``v`` (bf16). Each row's running max is
    finite after its first block, or with ``EMPTY`` may stay -inf (a key group with no key yet: its p and alpha
    are then 0, not NaN)."""
    m_new = tl.maximum(m_i, tl.max(sc, axis=AX))
    if EMPTY:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(sc - tl.expand_dims(m_use, AX))
    alpha = tl.exp2(m_i - m_use)
    l_i = l_i * alpha + tl.sum(p, axis=AX)
    acc = acc * tl.expand_dims(alpha, AX) + mma(to_bf16(p, INTERP), v, INTERP)
    return m_new, l_i, acc


@triton.jit
def _q_scaled(q_ptr, layer, qrow, hm, dcol, NQ: tl.constexpr, HD: tl.constexpr, QSCALE: tl.constexpr,
              INTERP: tl.constexpr):
    q = tl.load(q_ptr + layer * (NQ * HD) + qrow[:, None] * HD + dcol[None, :], mask=hm[:, None],
                other=0.0, cache_modifier=".cg")
    return to_bf16(q * QSCALE, INTERP)                        # scores come out in base 2


@triton.jit
def _merge_key(qs, kn, vn, m_i, l_i, acc):
    """The online softmax's (l, acc) with one more key, ``kn`` / ``vn`` (bf16, [HD]): the key at pos,
    scored as the one-key split scores it (bf16 q * scale, fp32 sums)."""
    kn = kn.to(tl.float32)
    vn = vn.to(tl.float32)
    s_new = tl.sum(qs.to(tl.float32) * kn[None, :], axis=1)
    m_new = tl.maximum(m_i, s_new)
    alpha = tl.exp2(m_i - m_new)
    p_new = tl.exp2(s_new - m_new)
    return l_i * alpha + p_new, acc * alpha[:, None] + p_new[:, None] * vn[None, :]


@triton.jit
def _attn_whole(layer, pos, kbase, vbase, q_ptr, attn_ptr, qrow, hm, dcol, ins, cnt_ptr, epoch, spin_limit,
                NQ: tl.constexpr, HD: tl.constexpr, GROUP_PAD: tl.constexpr, QSCALE: tl.constexpr,
                ATTN_BLOCK: tl.constexpr, INTERP: tl.constexpr, ATTN_STAGES: tl.constexpr, PROFILE: tl.constexpr):
    # Tiling.attn_splits 1: every key of the group's heads, the merged output to attn. The prefix [0, pos)
    # was written by earlier calls, so the key loop's prologue issues it before the instruction's waits,
    # made in its first iteration with q's read; the key at pos (this call's K/V tiles') is attended to
    # after the loop. With no prefix (pos 0) the waits come first
    bad_c = tl.full([], -1, tl.int32)
    bad_s = tl.full([], 0, tl.int32)
    t_exec = tl.full([], 0, tl.int64)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HD], dtype=tl.float32)
    qs = tl.zeros([GROUP_PAD, HD], dtype=tl.bfloat16)
    kn = tl.zeros([HD], dtype=tl.bfloat16)
    vn = tl.zeros([HD], dtype=tl.bfloat16)
    if pos == 0:
        bad_c, bad_s, t_exec = tape_waits(ins, cnt_ptr, epoch, spin_limit, PROFILE)
        qs = _q_scaled(q_ptr, layer, qrow, hm, dcol, NQ, HD, QSCALE, INTERP)
        kn = tl.load(kbase + pos * HD + dcol, cache_modifier=".cg")
        vn = tl.load(vbase + pos * HD + dcol, cache_modifier=".cg")
    for kb in tl.range(0, pos, ATTN_BLOCK, num_stages=ATTN_STAGES):
        keys = kb + tl.arange(0, ATTN_BLOCK)
        km = keys < pos
        k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
        v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0, cache_modifier=".cg")
        if kb == 0:
            # after the waits: q and the key at pos (this call's), read together (one L2 round trip)
            bad_c, bad_s, t_exec = tape_waits(ins, cnt_ptr, epoch, spin_limit, PROFILE)
            qs = _q_scaled(q_ptr, layer, qrow, hm, dcol, NQ, HD, QSCALE, INTERP)
            kn = tl.load(kbase + pos * HD + dcol, cache_modifier=".cg")
            vn = tl.load(vbase + pos * HD + dcol, cache_modifier=".cg")
        m_i, l_i, acc = _attn_block(qs, k, v, km, m_i, l_i, acc, INTERP)
    l_i, acc = _merge_key(qs, kn, vn, m_i, l_i, acc)
    ok = bad_c < 0
    tl.store(attn_ptr + layer * (NQ * HD) + qrow[:, None] * HD + dcol[None, :], acc / l_i[:, None],
             mask=hm[:, None] & ok)
    return bad_c, bad_s, t_exec


@triton.jit
def attn_partial_device(layer, g, s, pos, wtab_ptr, kc_ptr, vc_ptr, q_ptr, part_o_ptr, part_ml_ptr, attn_ptr,
                        NQ: tl.constexpr, HD: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                        MAX_SEQ: tl.constexpr, QSCALE: tl.constexpr, SPLITS: tl.constexpr, PART_SPLITS: tl.constexpr,
                        ATTN_BLOCK: tl.constexpr, INTERP: tl.constexpr, ATTN_STAGES: tl.constexpr,
                        A_WAIT: tl.constexpr, ins, cnt_ptr, epoch, spin_limit, PROFILE: tl.constexpr):
    if A_WAIT:          # Tiling.attn_splits 1 (SPLITS 1): the whole attention, waiting inside
        hq = tl.arange(0, GROUP_PAD)
        kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + g * (MAX_SEQ * HD)
        vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + g * (MAX_SEQ * HD)
        return _attn_whole(layer, pos, kbase, vbase, q_ptr, attn_ptr, g * GROUP + hq, hq < GROUP, tl.arange(0, HD),
                           ins, cnt_ptr, epoch, spin_limit, NQ, HD, GROUP_PAD, QSCALE, ATTN_BLOCK, INTERP,
                           ATTN_STAGES, PROFILE)
    last = s == SPLITS - 1
    chunk = (pos + SPLITS - 2) // (SPLITS - 1)
    start = tl.where(last, pos, s * chunk)
    stop = tl.where(last, pos + 1, tl.minimum(s * chunk + chunk, pos))
    hq = tl.arange(0, GROUP_PAD)
    hm = hq < GROUP
    dcol = tl.arange(0, HD)
    qrow = g * GROUP + hq
    q = tl.load(q_ptr + layer * (NQ * HD) + qrow[:, None] * HD + dcol[None, :], mask=hm[:, None],
                other=0.0, cache_modifier=".cg")
    qs = to_bf16(q * QSCALE, INTERP)                          # scores come out in base 2
    kbase = kc_ptr + tab_offset(wtab_ptr, layer, T_KC) + g * (MAX_SEQ * HD)
    vbase = vc_ptr + tab_offset(wtab_ptr, layer, T_VC) + g * (MAX_SEQ * HD)
    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HD], dtype=tl.float32)
    # each iteration streams 2 x ATTN_BLOCK x HD bf16 of K and V
    for kb in tl.range(start, stop, ATTN_BLOCK, num_stages=ATTN_STAGES):
        keys = kb + tl.arange(0, ATTN_BLOCK)
        km = keys < stop
        k = tl.load(kbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0,
                    cache_modifier=".cg")
        v = tl.load(vbase + keys[:, None] * HD + dcol[None, :], mask=km[:, None], other=0.0,
                    cache_modifier=".cg")                      # issued with K: one round trip a block
        m_i, l_i, acc = _attn_block(qs, k, v, km, m_i, l_i, acc, INTERP)
    prow = (layer * NQ + qrow) * PART_SPLITS + s
    tl.store(part_o_ptr + prow[:, None] * HD + dcol[None, :], acc, mask=hm[:, None])
    tl.store(part_ml_ptr + prow * 2, m_i, mask=hm)
    tl.store(part_ml_ptr + prow * 2 + 1, l_i, mask=hm)
    return tl.full([], -1, tl.int32), tl.full([], 0, tl.int32), tl.full([], 0, tl.int64)


@register
@dataclass(frozen=True)
class AttnPartial(Instruction):
    layer: int
    g: int        # KV head
    s: int        # split of the key sequence

    NAME = "attn_partial"
    STAGE = 1
    ARGS = ("pos", "wtab_ptr", "kc_ptr", "vc_ptr", "q_ptr", "part_o_ptr", "part_ml_ptr", "attn_ptr",
            "NQ", "HD", "GROUP", "GROUP_PAD", "MAX_SEQ", "QSCALE", "SPLITS", "PART_SPLITS", "ATTN_BLOCK", "INTERP",
            "ATTN_STAGES", "A_WAIT")
    CONSTEXPRS = {
        "GROUP": lambda lay: lay.cfg.group,                                  # query heads per KV head
        "GROUP_PAD": lambda lay: max(16, triton.next_power_of_2(lay.cfg.group)),   # rows of tl.dot
        "SPLITS": lambda lay: lay.tiling.attn_splits,
        "PART_SPLITS": lambda lay: lay.attn_instr_splits,        # partials per query head (row stride)
        "ATTN_BLOCK": lambda lay: lay.tiling.attn_block,
        "ATTN_STAGES": lambda lay: lay.tiling.attn_stages,
        "QSCALE": lambda lay: float(1.4426950408889634 / math.sqrt(lay.cfg.hd)),   # log2(e) / sqrt(hd)
        "A_WAIT": lambda lay: int(lay.attn_merged),         # the whole attention waits inside (_attn_whole)
    }
    WAIT_INSIDE = "A_WAIT"
    #: the longest KV cache (positions) for which ``Tiling.for_config`` picks ``attn_splits`` 1 on its own
    #: (d <= 2048): the 1B on the H200, one instruction a KV head against 16 splits and their merge,
    #: alternated: -1.7% at pos 128, equal at 256, +2.3% at 384, +10.6% at 1024;
    #: also the positions of a longer cache that a decoder runs on a second, merged tape (``Tiling.short_prefix``)
    MERGED_MAX_SEQ = 256
    TIMING = Timing.LATENCY
    TORCH_RTOL = 1e-2         # the tensor-core dots take bf16 q and p; run_torch keeps them fp32
    device = attn_partial_device

    # attn: the merged output, written here with Tiling.attn_splits 1 (else by ATTN_REDUCE, which declares it alike)
    SCRATCH = {"part_o": "fp32", "part_ml": "fp32", "attn": "fp32"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        c = lay.cfg
        ns = 0 if lay.attn_merged else lay.attn_instr_splits        # merged: no partials
        return {"part_o": (c.layers, c.n_q, ns, c.hd), "part_ml": (c.layers, c.n_q, ns, 2), "attn": (c.layers, c.q_dim)}

    def latency_time(self, lay: Layout) -> float:
        """Seconds of this split at ``lay.max_seq`` keys on the H200: bound by loaded HBM round trips."""
        return attention_latency(lay, self.cost(lay).hbm_bytes // (4 * lay.cfg.hd))

    def check_operands(self, lay: Layout) -> list[str]:
        c = lay.cfg
        bad = []
        if not 0 <= self.layer < c.layers:
            bad.append(f"layer {self.layer} not in [0, {c.layers})")
        if not 0 <= self.g < c.n_kv:
            bad.append(f"g {self.g} not in [0, {c.n_kv})")
        if not 0 <= self.s < lay.attn_instr_splits:
            bad.append(f"s {self.s} not in [0, {lay.attn_instr_splits})")
        return bad

    def reads(self, lay: Layout) -> list[Region]:
        c = lay.cfg
        q0 = self.layer * c.q_dim + self.g * c.group * c.hd
        kv0 = self.layer * c.kv_dim + self.g * c.hd
        out = [Region("q", q0, q0 + c.group * c.hd)]
        if self.s == lay.tiling.attn_splits - 1:      # only the last split (or the only one) reads the key at pos
            out += [Region("kv_new_k", kv0, kv0 + c.hd), Region("kv_new_v", kv0, kv0 + c.hd)]
        return out

    def writes(self, lay: Layout) -> list[Region]:
        c, ns = lay.cfg, lay.attn_instr_splits
        if lay.attn_merged:         # the group's heads' attention output, merged
            a0 = self.layer * c.q_dim + self.g * c.group * c.hd
            return [Region("attn", a0, a0 + c.group * c.hd)]
        out = []
        for h in range(self.g * c.group, (self.g + 1) * c.group):
            row = (self.layer * c.n_q + h) * ns + self.s
            out.append(Region("part_o", row * c.hd, (row + 1) * c.hd))
            out.append(Region("part_ml", row * 2, row * 2 + 2))
        return out

    def cost(self, lay: Layout, n_keys: int | None = None) -> Cost:
        c = lay.cfg
        n_keys = lay.max_seq if n_keys is None else n_keys
        ns = lay.tiling.attn_splits
        pre = max(0, n_keys - 1)                     # the prefix keys, split as the kernel does
        chunk = cdiv(pre, ns - 1) if pre and ns > 1 else 0
        if ns == 1:
            per = n_keys                             # every key, the one at pos included
        else:
            per = 1 if self.s == ns - 1 else max(0, min(chunk, pre - self.s * chunk))
        return Cost(hbm_bytes=2 * 2 * per * c.hd, l2_bytes=4 * c.group * c.hd * 2,
                    flops=4 * c.group * per * c.hd)

    def run_torch(self, lay: Layout, st) -> None:
        c, ns = lay.cfg, lay.tiling.attn_splits
        if ns == 1:
            start, stop = 0, st.pos + 1
        elif self.s == ns - 1:
            start, stop = st.pos, st.pos + 1
        else:
            chunk = cdiv(st.pos, ns - 1)
            start, stop = self.s * chunk, min((self.s + 1) * chunk, st.pos)
        q = st.buf["q"].view(c.layers, c.n_q, c.hd)[self.layer, self.g * c.group:(self.g + 1) * c.group]
        hs = slice(self.g * c.group, (self.g + 1) * c.group)
        if ns > 1:
            po = st.buf["part_o"].view(c.layers, c.n_q, lay.attn_instr_splits, c.hd)
            pml = st.buf["part_ml"].view(c.layers, c.n_q, lay.attn_instr_splits, 2)
        if start >= stop:                                        # (never with ns 1: the key at pos)
            po[self.layer, hs, self.s] = 0.0
            pml[self.layer, hs, self.s, 0] = float("-inf")
            pml[self.layer, hs, self.s, 1] = 0.0
            return
        k = st.kv[self.layer][0][0, self.g, start:stop].float()
        v = st.kv[self.layer][1][0, self.g, start:stop].float()
        qs = q * (1.4426950408889634 / math.sqrt(c.hd))
        sc = qs @ k.T                                            # [G, T] base-2 scores
        m = sc.max(dim=1).values
        p = torch.exp2(sc - m[:, None])
        if ns == 1:                                              # the merged output (ATTN_REDUCE's, one split)
            st.buf["attn"].view(c.layers, c.n_q, c.hd)[self.layer, hs] = (p @ v) / p.sum(dim=1)[:, None]
            return
        po[self.layer, hs, self.s] = p @ v
        pml[self.layer, hs, self.s, 0] = m
        pml[self.layer, hs, self.s, 1] = p.sum(dim=1)
