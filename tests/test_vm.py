"""The tape VM (schedule/vm.py) against the eager torch reference (opcodes/reference.py).

Configs: GQA ratios 4, 8, 1, 4, 2 (tiny, tiny-gqa8, tiny-mha, small-gqa4, small-2layer), d and ffn
not powers of two; SM counts 1, 3, 8, 132; cost, round-robin and random schedules; several random
interleavings. Cache of max_seq 64 prefilled with 37 positions (not a multiple of any tile).
"""
from __future__ import annotations

from functools import lru_cache

import pytest
import torch

from conftest import clone_cache
from opcodes import ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import Schedule, compile_model, encode, lower, make_layout, verify
from schedule.tape import decode_slot
from schedule.vm import DeadlockError, run_tape

TOL = 1.5e-2
MAX_SEQ, PREFILL = 64, 37
CONFIGS = ["tiny", "tiny-gqa8", "tiny-mha", "small-gqa4", "small-2layer"]
SMS = [1, 3, 8, 132]
SEEDS = [0, 1, 2]


@lru_cache(maxsize=None)
def tape_for(name: str, sms: int, policy: str = "cost", seed: int = 0, tiling: tuple = ()):
    cfg = ModelConfig.from_name(name)
    til = Tiling.for_config(cfg, **dict(tiling)) if tiling else None
    return compile_model(cfg, sms, max_seq=MAX_SEQ, tiling=til, policy=policy, seed=seed).tape


@lru_cache(maxsize=None)
def inputs(name: str, seed: int = 0):
    """Weights, a prefilled cache, x, and the reference output and cache after one step at PREFILL."""
    cfg = ModelConfig.from_name(name)
    w = make_weights(cfg, seed=seed)
    kv = make_kv_cache(cfg, MAX_SEQ, PREFILL, seed=seed + 1)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(seed + 2)).to(torch.bfloat16)
    kv_ref = clone_cache(kv)
    ref = model_ref(w, kv_ref, cfg, x, PREFILL)
    return cfg, w, kv, x, ref, kv_ref


def check_cache(kv_after, kv_before, kv_ref, pos: int) -> None:
    """Row ``pos`` of every layer's K and V matches the reference; every other row is bitwise untouched."""
    for l, (after, before, ref) in enumerate(zip(kv_after, kv_before, kv_ref)):
        for j in range(2):
            a, b, r = after[j], before[j], ref[j]
            others = torch.ones(a.shape[2], dtype=torch.bool)
            others[pos] = False
            assert torch.equal(a[:, :, others], b[:, :, others]), f"layer {l} {'kv'[j]}: rows other than {pos} changed"
            assert torch.isfinite(a[:, :, pos].float()).all()
            assert rel_err(a[:, :, pos], r[:, :, pos]) <= TOL, f"layer {l} {'kv'[j]} row {pos}"
            assert not torch.equal(a[:, :, pos], b[:, :, pos]), "row pos was not written"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("sms", SMS)
@pytest.mark.parametrize("name", CONFIGS)
def test_vm_matches_reference(name, sms, seed):
    cfg, w, kv0, x, ref, kv_ref = inputs(name)
    kv = clone_cache(kv0)
    out = run_tape(tape_for(name, sms), w, kv, x, PREFILL, seed=seed)
    assert out.shape == (1, cfg.d) and out.dtype == torch.bfloat16
    assert torch.isfinite(out.float()).all()
    err = rel_err(out, ref)
    assert err <= TOL, f"{name} on {sms} SMs, interleaving {seed}: rel err {err:.3e}"
    check_cache(kv, kv0, kv_ref, PREFILL)


@pytest.mark.parametrize("policy", ["round-robin", "random"])
@pytest.mark.parametrize("name", CONFIGS)
def test_vm_other_policies(name, policy):
    cfg, w, kv0, x, ref, kv_ref = inputs(name)
    for sms in (3, 8):
        for seed in SEEDS:
            kv = clone_cache(kv0)
            out = run_tape(tape_for(name, sms, policy, seed), w, kv, x, PREFILL, seed=seed)
            assert rel_err(out, ref) <= TOL
            check_cache(kv, kv0, kv_ref, PREFILL)


@pytest.mark.parametrize("name", CONFIGS)
def test_vm_result_is_schedule_independent(name):
    """Partials are summed in a fixed order, so every schedule and interleaving gives the same bits."""
    cfg, w, kv0, x, ref, kv_ref = inputs(name)
    outs = []
    for sms, policy, seed in [(1, "cost", None), (3, "cost", 0), (8, "round-robin", 1), (132, "random", 2),
                              (5, "random", 3)]:
        outs.append(run_tape(tape_for(name, sms, policy, seed or 0), w, clone_cache(kv0), x, PREFILL, seed=seed))
    for o in outs[1:]:
        assert torch.equal(o, outs[0])


def test_vm_multi_chunk_tiling():
    """Several K chunks and residual blocks (non-power-of-two ffn = 224, d = 96)."""
    name = "tiny-gqa8"
    til = (("down_k", 64), ("red_rows", 32), ("down_rows", 32))
    cfg, w, kv0, x, ref, kv_ref = inputs(name)
    for sms in (3, 132):
        tape = tape_for(name, sms, "cost", 0, til)
        assert tape.lay.n_down_k == 4
        for seed in SEEDS:
            kv = clone_cache(kv0)
            assert rel_err(run_tape(tape, w, kv, x, PREFILL, seed=seed), ref) <= TOL
            check_cache(kv, kv0, kv_ref, PREFILL)


def test_vm_consecutive_steps():
    """Three decode steps on the same cache, as a caller would run them."""
    name = "small-2layer"
    cfg, w, kv0, _, _, _ = inputs(name)
    kv, kv_ref = clone_cache(kv0), clone_cache(kv0)
    tape = tape_for(name, 8)
    g = torch.Generator().manual_seed(11)
    for pos in range(PREFILL, PREFILL + 3):
        x = torch.randn(1, cfg.d, generator=g).to(torch.bfloat16)
        before = clone_cache(kv)
        out = run_tape(tape, w, kv, x, pos, seed=pos)
        ref = model_ref(w, kv_ref, cfg, x, pos)
        assert rel_err(out, ref) <= TOL
        check_cache(kv, before, kv_ref, pos)


@pytest.mark.parametrize("pos", [0, 1, MAX_SEQ - 1])
def test_vm_edge_positions(pos):
    """pos 0 (one key: most attention splits empty) and the last row of the cache."""
    name = "tiny-gqa8"
    cfg, w, kv0, x, _, _ = inputs(name)
    kv, kv_ref = clone_cache(kv0), clone_cache(kv0)
    out = run_tape(tape_for(name, 3), w, kv, x, pos, seed=pos)
    ref = model_ref(w, kv_ref, cfg, x, pos)
    assert torch.isfinite(out.float()).all()
    assert rel_err(out, ref) <= TOL
    check_cache(kv, kv0, kv_ref, pos)


def test_vm_rejects_bad_pos():
    cfg, w, kv0, x, _, _ = inputs("tiny")
    for pos in (-1, MAX_SEQ):
        with pytest.raises(ValueError, match="pos"):
            run_tape(tape_for("tiny", 1), w, clone_cache(kv0), x, pos)


# ---- what the VM catches -------------------------------------------------------------------------
def test_vm_deadlock_raises():
    """SM 1 runs an attention merge before the QKV tiles; SM 0's attention waits for them (the split
    attention: the default merges it in the partials at this cache size)."""
    name = "tiny"
    cfg, w, kv0, x, _, _ = inputs(name)
    prog = lower(make_layout(cfg, MAX_SEQ, Tiling.for_config(cfg)))
    red = next(i for i, ins in enumerate(prog.instrs) if ins.NAME == "attn_reduce")
    sm1 = [red] + [i for i, ins in enumerate(prog.instrs) if ins.NAME == "qkv"]
    sm0 = [i for i in range(len(prog)) if i not in set(sm1)]
    tape = encode(Schedule(prog, 2, [sm0, sm1], "cycle"))
    for seed in (None, 0, 1):
        with pytest.raises(DeadlockError, match="attn_reduce"):
            run_tape(tape, w, clone_cache(kv0), x, PREFILL, seed=seed)


def test_vm_deadlock_same_sm():
    name = "tiny"
    cfg, w, kv0, x, _, _ = inputs(name)
    prog = lower(make_layout(cfg, MAX_SEQ))
    order = list(range(len(prog)))
    cons = next(i for i in order if prog.instrs[i].NAME == "attn_partial")
    order.remove(cons)
    order.insert(0, cons)                       # ahead of every QKV tile
    tape = encode(Schedule(prog, 1, [order], "bad"))
    with pytest.raises(DeadlockError, match="attn_partial"):
        run_tape(tape, w, clone_cache(kv0), x, PREFILL)


def test_vm_exposes_a_missing_wait():
    """O-projection tiles that do not wait for the attention output read uninitialised (NaN)
    scratch in some interleavings: the VM must not hide that race."""
    name = "tiny-gqa8"
    cfg, w, kv0, x, ref, _ = inputs(name)
    prog = lower(make_layout(cfg, MAX_SEQ))
    oproj = [i for i, ins in enumerate(prog.instrs) if ins.NAME == "oproj"]
    rest = [i for i in range(len(prog)) if i not in set(oproj)]
    tape = encode(Schedule(prog, 2, [rest, oproj], "racy"))
    verify(tape, prog)
    for k in tape.sm_range(1):
        assert decode_slot(tape, k).ins.NAME == "oproj"
        tape.words[k, 1], tape.words[k, 2] = -1, 0           # drop the wait on attn[0]
    with pytest.raises(ValueError, match="does not wait for"):
        verify(tape, prog)
    bad = 0
    for seed in range(8):
        out = run_tape(tape, w, clone_cache(kv0), x, PREFILL, seed=seed)
        if not torch.isfinite(out.float()).all() or rel_err(out, ref) > TOL:
            bad += 1
    assert bad > 0, "no interleaving exposed the missing wait"
    # run in queue order (SM 0 first), the same tape happens to be right: races are schedule-dependent
    assert rel_err(run_tape(tape, w, clone_cache(kv0), x, PREFILL, seed=None), ref) <= TOL


@pytest.mark.parametrize("name", CONFIGS)
def test_vm_pool_matches_reference(name):
    """Pools (the plan's last third, or everything) taken by ticket in random interleavings."""
    cfg, w, kv, x, ref, kv_ref = inputs(name)
    for sms in (1, 3, 8, 132):
        base = compile_model(cfg, sms, max_seq=MAX_SEQ)
        for pool_us in (base.sched.makespan * 1e6 / 3, 1e9):
            tape = compile_model(cfg, sms, max_seq=MAX_SEQ, pool_us=pool_us).tape
            assert tape.pool_len > 0
            for seed in (0, 1, None):
                kv_run = clone_cache(kv)
                out = run_tape(tape, w, kv_run, x, PREFILL, seed=seed)
                assert rel_err(out, ref) <= TOL, (sms, pool_us, seed)
                check_cache(kv_run, kv, kv_ref, PREFILL)


