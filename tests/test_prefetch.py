"""The L2 prefetch table (``Tiling.pf_cols``, interp/prefetch.py): what the kernel asks the TMA
engine to fetch before an instruction waits must be exactly that instruction's weights.

The prefetch itself is a hint the Triton interpreter cannot run (inline PTX); the GPU test
(tests/test_gpu.py) checks that a kernel with it is bitwise the kernel without. Here the table is
checked against the opcodes on the CPU: every weight element of every layer (and of the LM head)
is named by exactly one slot's descriptors, each slot's bytes are its ``cost().hbm_bytes``, and
``pf_cols`` cuts each row to its first columns.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import decoder_weights
from interp.prefetch import PF_DESCS, PF_WORDS, prefetch_table
from opcodes import PRESETS, Tiling
from schedule import compile_model
from schedule.tape import decode

CASES = [("small-gqa4", {}), ("small-gqa4", {"o_k": 64, "down_k": 128}), ("small-2layer", {})]


def _tensors(w: dict, cfg) -> dict:
    """(layer or None, key) -> tensor, for every weight the GEMV opcodes stream."""
    out = {(l, k): lw[k] for l, lw in enumerate(w["layers"]) for k in ("q", "k", "v", "o", "gate", "up", "down")}
    if cfg.vocab:
        out[(None, "lm_head")] = w["lm_head"]
    return out


def _coverage(table: torch.Tensor, tensors: dict) -> dict:
    """How many descriptors name each element of each tensor."""
    cover = {key: torch.zeros(t.numel(), dtype=torch.int32) for key, t in tensors.items()}
    spans = {key: (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for key, t in tensors.items()}
    for addr, nbytes, rows, stride in table.view(-1, PF_WORDS).tolist():
        for r in range(rows):
            a = addr + r * stride
            hit = [k for k, (lo, hi) in spans.items() if lo <= a and a + nbytes <= hi]
            assert len(hit) == 1, f"descriptor row at {a:#x} ({nbytes} bytes) is in {len(hit)} weight tensors"
            lo = spans[hit[0]][0]
            cover[hit[0]][(a - lo) // 2:(a - lo + nbytes) // 2] += 1
    return cover


@pytest.mark.parametrize("name,over", CASES)
@pytest.mark.parametrize("ahead", [1, 3])
def test_prefetch_names_every_weight_element_once(name, over, ahead):
    cfg = dataclasses.replace(PRESETS[name], vocab=96)
    til = Tiling.for_config(cfg, **over)
    comp = compile_model(cfg, 5, max_seq=64, tiling=til, pool_us=0 if ahead == 1 else 5.0)
    tape, lay = comp.tape, comp.tape.lay
    if ahead != 1:
        assert tape.pool_len > tape.num_sms     # pool slots prefetch pool slots
    w = decoder_weights(cfg, seed=1)
    table = prefetch_table(tape, w, 1 << 20, "cpu", pf_ahead=ahead).view(-1, PF_DESCS, PF_WORDS)
    assert table.shape[0] == len(tape) + tape.num_sms * ahead
    cover = _coverage(table, _tensors(w, cfg))
    bad = {f"{k[1]} of layer {k[0]}": sorted(set(c.tolist())) for k, c in cover.items() if not bool((c == 1).all())}
    assert not bad, f"{name} {over}: elements named other than once (counts seen): {bad}"
    # the plan, queue by queue: the first `ahead` streaming instructions at the start, then the
    # (k + ahead)-th streaming instruction's bytes when the k-th starts, the queue's first pool
    # slot counted last; nothing at other slots; pool slot k prefetches pool slot k + num_sms
    by_slot = {d.slot: d for d in decode(tape)}
    pool = list(tape.pool_range())

    def nbytes(row):
        return int((table[row, :, 1] * table[row, :, 2]).sum())

    def streams(slot):
        return by_slot[slot].ins.cost(lay).hbm_bytes if by_slot[slot].ins.weight_streams(lay) else 0

    for sm in range(tape.num_sms):
        streaming = [s for s in tape.sm_range(sm) if streams(s)]
        targets = streaming + [pool[sm]] if sm < len(pool) and streams(pool[sm]) else streaming
        rows = [len(tape) + sm * ahead + a for a in range(ahead)] + streaming
        for s in tape.sm_range(sm):
            if s not in streaming:
                assert nbytes(s) == 0, f"sm {sm} slot {s} ({by_slot[s].ins}) prefetches"
        for k, t in enumerate(targets):
            assert nbytes(rows[k]) == streams(t), f"sm {sm}: row {rows[k]}: {nbytes(rows[k])} bytes, slot {t} streams"
        for row in rows[len(targets):]:
            assert nbytes(row) == 0, f"sm {sm}: row {row} prefetches past the queue's end"
    for k, p in enumerate(pool):
        want = streams(pool[k + tape.num_sms]) if k + tape.num_sms < len(pool) else 0
        assert nbytes(p) == want, f"pool slot {p} prefetches {nbytes(p)} bytes, not those of pool slot k + SMs"


def test_pf_cols_cuts_each_row():
    cfg = dataclasses.replace(PRESETS["small-gqa4"], vocab=96)
    comp = compile_model(cfg, 3, max_seq=64, pool_us=0)
    w = decoder_weights(cfg, seed=2)
    full = prefetch_table(comp.tape, w, 1 << 20, "cpu").view(-1, PF_WORDS)
    cut = prefetch_table(comp.tape, w, 64, "cpu").view(-1, PF_WORDS)
    on = full[:, 2] > 0
    assert torch.equal(cut[:, 0], full[:, 0]) and torch.equal(cut[:, 2:], full[:, 2:])
    assert torch.equal(cut[on, 1], torch.clamp(full[on, 1], max=128)), "rows not cut to 64 columns (128 bytes)"
    assert int((prefetch_table(comp.tape, w, 0, "cpu") != 0).sum()) == 0, "pf_cols 0 must leave the table empty"


@pytest.mark.parametrize("bad", [-8, 12])
def test_pf_cols_must_be_a_nonnegative_multiple_of_8(bad):
    with pytest.raises(ValueError, match="pf_cols"):
        Tiling(pf_cols=bad)
