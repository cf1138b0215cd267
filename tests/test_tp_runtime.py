"""The tensor-parallel runtime (``interp.tp``) in its CPU loopback: both ranks' kernels (the real
generated megakernel, through the Triton interpreter) run at once in one process, one thread each,
each rank's peer pointers bound to the other rank's CPU tensors. Against the two-rank tape VM
(``schedule.vm.run_tp`` / ``run_tp_decoder``) and the TP reference over consecutive calls (the
receive buffers' parity slots alternate), the ranks bitwise equal to each other; a rank whose peer
never launches stops within its bounded polls with a MegakernelError naming the counter. Nothing
here ran on a GPU."""
from __future__ import annotations

import dataclasses
import time

import pytest
import torch
import triton
import triton.language as tl

from conftest import StepClock, clone_cache, decoder_weights, require_interpreter
from interp import runtime
from interp.runtime import MegakernelError, build_layer
from interp.tp import (INTERPRETER_TP_SPIN_LIMIT, _interpreter_launch_all, build_tp_decoder, build_tp_layers, tokens, tp_decode_step,
                       tp_generate, tp_layer_step, tp_teardown)
from opcodes import PRESETS, Layout, kernel_pointers
from opcodes.reference import make_kv_cache, make_weights, rel_err
from opcodes.tp import shard_kv_cache, shard_weights, tp_model_ref
from schedule import compile_model
from schedule.vm import run_tp, run_tp_decoder

require_interpreter()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = PRESETS["small-2layer"]          # d=128, ffn=320, n_q=4, n_kv=2: per rank 2 query heads, 1 KV head
MAX_SEQ, POS, CALLS = 64, 19, 3
TOL = 1.5e-2          # test_interp_contract's tolerance of the kernel against the reference
VM_TOL = 1e-2         # the kernel against the VM (device functions vs run_torch: bf16 roundings, sum orders)
LOGIT_TOL = 2e-2      # test_decoder's tolerance of logits


def _x(seed: int = 3) -> torch.Tensor:
    return torch.randn(1, CFG.d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def _shards(cfg, w, kv):
    return [shard_weights(w, cfg, r, 2) for r in range(2)], [shard_kv_cache(kv, cfg, r, 2) for r in range(2)]


# ---- the interpreter runs two launches at once ------------------------------------------------------
@triton.jit
def _k_wait(flag_ptr, out_ptr, spin_limit):
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (seen < 1) & (n < spin_limit):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
        n += 1
    tl.store(out_ptr, n)
    tl.store(out_ptr + 1, seen)


@triton.jit
def _k_set(flag_ptr, out_ptr, work):
    acc = 0
    for k in range(work):
        acc += tl.load(out_ptr + 2)
    tl.atomic_add(flag_ptr, 1, sem="release", scope="gpu")
    for k in range(work):            # still running after the waiter has finished
        acc += tl.load(out_ptr + 2)
    tl.store(out_ptr + 3, acc + 7)


def test_interpreter_runs_two_launches_at_once():
    """One kernel spins on a flag another sets, each in its own thread: the waiter ends first, while
    the setter still runs (the interpreter's own per-launch patching of triton.language would unpatch
    the setter there); afterwards triton.language is restored."""
    flag = torch.zeros(4, dtype=torch.int32)
    out = torch.zeros(4, dtype=torch.int32)
    _interpreter_launch_all([(_k_wait, (flag, out, 1 << 20), {}), (_k_set, (flag, out, 200), {})])
    assert flag[0] == 1 and out[1] == 1 and out[3] == 7 and 0 <= out[0] < (1 << 20)
    assert tl.core.is_builtin(tl.load) and tl.core.is_builtin(tl.atomic_add)
    flag.zero_()
    _k_wait[(1,)](flag, out, 3)                 # a plain launch afterwards: gives up after 3 polls
    assert out[0] == 3 and out[1] == 0


# ---- declarations --------------------------------------------------------------------------------
def test_peer_pointers_only_in_tp_kernels():
    single = compile_model(CFG, 1, max_seq=MAX_SEQ, decoder=False, sequential=True).tape
    tp = compile_model(CFG, 1, max_seq=MAX_SEQ, decoder=False, sequential=True, tp=2).tapes[0]
    assert not any("peer" in p for p in kernel_pointers(single.lay, single.classes()))
    assert not any("peer" in p for p in kernel_pointers(Layout(CFG, tp.lay.tiling, MAX_SEQ)))
    assert {"peer_cnt_ptr", "peer_sig_ptr", "peer_recv_ptr"} <= set(kernel_pointers(tp.lay, tp.classes()))
    assert runtime.peer_pointers(tp.classes()) == ["peer_cnt_ptr", "peer_recv_ptr"]
    w = make_weights(CFG)
    with pytest.raises(ValueError, match="tensor-parallel"):      # one rank alone cannot be built
        build_layer(w, make_kv_cache(CFG, MAX_SEQ, POS), CFG, MAX_SEQ, tape=tp)


# ---- the layers --------------------------------------------------------------------------------------
def test_tp_layers_match_the_vm_and_the_reference():
    w = make_weights(CFG)
    kv = make_kv_cache(CFG, MAX_SEQ, POS)
    kv_vm, kv_ref = clone_cache(kv), clone_cache(kv)
    shards, caches = _shards(CFG, w, kv)
    h = build_tp_layers(shards, caches, CFG, MAX_SEQ)
    try:
        assert h.loopback and [k.num_sms for k in h.ranks] == [1, 1]
        x = _x()
        vm = run_tp(h.tapes, w, kv_vm, x, POS, calls=CALLS, return_all=True)
        ref_shards, ref_caches = _shards(CFG, w, kv_ref)
        xin, xref = x, x
        for k in range(CALLS):         # calls 1, 2, 3: receive slots 1, 0, 1
            outs = tp_layer_step(h, xin, POS + k)
            assert torch.equal(outs[0], outs[1]), f"call {k}: the ranks' outputs differ"
            assert torch.equal(vm[k][0], vm[k][1])
            e = rel_err(outs[0], vm[k][0])
            assert e <= VM_TOL, f"call {k}: rel err {e:.3e} against run_tp"
            xref = tp_model_ref(ref_shards, ref_caches, CFG, xref, POS + k)
            e = rel_err(outs[0], xref)
            assert e <= TOL, f"call {k}: rel err {e:.3e} against the TP reference"
            xin = outs[0]               # the next call's input: as the VM feeds it (its own output)
            assert h.calls == k + 1
        for r in range(2):              # each rank wrote its KV heads' rows, as the VM did
            a = r * CFG.n_kv // 2
            for l in range(CFG.layers):
                for j in range(2):
                    got = caches[r][l][j][:, :, POS:POS + CALLS]
                    want = kv_vm[l][j][:, a:a + CFG.n_kv // 2, POS:POS + CALLS]
                    assert rel_err(got, want) <= TOL
                    assert torch.equal(caches[r][l][j][:, :, :POS], shard_kv_cache(kv, CFG, r, 2)[l][j][:, :, :POS])
    finally:
        tp_teardown(h)


def test_a_rank_whose_peer_never_launches_times_out():
    w = make_weights(CFG)
    kv = make_kv_cache(CFG, MAX_SEQ, POS)
    shards, caches = _shards(CFG, w, kv)
    h = build_tp_layers(shards, caches, CFG, MAX_SEQ, spin_limit=500)
    x = _x()
    with pytest.raises(MegakernelError) as ei:
        tp_layer_step(h, x, POS, ranks=(0,))          # rank 1 never launches
    msg = str(ei.value)
    assert "rank 0" in msg and "gave up waiting after 500 polls" in msg and "recv_" in msg and "tp_reduce" in msg
    assert ei.value.stuck and all(s[0] == 0 for s in ei.value.stuck)
    assert h.calls == 0 and all(int(k.counters.abs().sum()) == 0 for k in h.ranks)    # both ranks reset
    # the same handle steps again (both ranks, from a clean start), and so does a new build; 500 polls
    # are too few for a wait on a peer that is working (it shares the interpreter): the default again
    for k in h.ranks:
        k.spin_limit = INTERPRETER_TP_SPIN_LIMIT
    out = tp_layer_step(h, x, POS)
    tp_teardown(h)
    assert torch.equal(out[0], out[1])
    ref = tp_model_ref(*_shards(CFG, w, make_kv_cache(CFG, MAX_SEQ, POS)), CFG, x, POS)
    assert rel_err(out[0], ref) <= TOL
    shards, caches = _shards(CFG, w, make_kv_cache(CFG, MAX_SEQ, POS))
    h2 = build_tp_layers(shards, caches, CFG, MAX_SEQ)
    try:
        out2 = tp_layer_step(h2, x, POS)
        assert torch.equal(out2[0], out2[1]) and torch.equal(out2[0], out[0])
    finally:
        tp_teardown(h2)


# ---- the whole model -------------------------------------------------------------------------------
def test_tp_decoder_matches_the_vm():
    cfg = dataclasses.replace(CFG, vocab=200, name="small-2layer-v200")
    w = decoder_weights(cfg)
    kv = make_kv_cache(cfg, MAX_SEQ, POS)
    kv_vm = clone_cache(kv)
    shards, caches = _shards(cfg, w, kv)
    h = build_tp_decoder(shards, caches, cfg, MAX_SEQ)
    try:
        tok = 17
        vm = run_tp_decoder(h.tapes, w, kv_vm, tok, POS, calls=CALLS, return_all=True)
        lg = tp_decode_step(h, tok, POS)              # call 1: the host's token
        assert lg.shape == (1, cfg.vocab) and lg.dtype == torch.float32
        assert rel_err(lg, torch.cat(vm[0][0], -1)) <= LOGIT_TOL
        assert tokens(h) == [vm[0][1]] * 2
        # calls 2, 3: each rank's EMBED reads the token its own TP_ARGMAX left (tp_generate after the prompt)
        new = tp_generate(h, [vm[0][1]], CALLS - 1, start_pos=POS + 1)
        assert new == [vm[1][1], vm[2][1]]
        got = torch.cat([t.clone() for t in h.logits], -1)
        assert rel_err(got, torch.cat(vm[2][0], -1)) <= LOGIT_TOL
        assert torch.equal(h.hidden[0], h.hidden[1])            # the final residual, bitwise on both ranks
        assert [int(t[POS + 2]) for t in h.toks] == [vm[2][1]] * 2
    finally:
        tp_teardown(h)


# ---- the time bound --------------------------------------------------------------------------------
def test_waits_are_bounded_in_time_under_the_interpreter(monkeypatch):
    """Every wait of a TP kernel is bounded in time as well as in polls (interp.sync.clock_ns: the host's
    clock under the interpreter, the globaltimer on a GPU): with a poll bound it cannot reach, a rank whose
    peer never launches stops after ``wait_s`` of its clock (a stand-in clock here, 10 ms a read: the
    wait gives up once the clock it read has passed the bound, not before); the error names the time
    bound, the rank and the counter; then, with the bound back and the host's clock, both ranks step
    correctly."""
    import interp.sync
    from interp.codegen import FAIL_TIME
    from interp.tp import INTERPRETER_TP_WAIT_S, set_wait
    w = make_weights(CFG)
    shards, caches = _shards(CFG, w, make_kv_cache(CFG, MAX_SEQ, POS))
    h = build_tp_layers(shards, caches, CFG, MAX_SEQ, spin_limit=1 << 30, wait_s=1.5)
    try:
        assert [k.wait_ns for k in h.ranks] == [1_500_000_000] * 2
        assert [int(k.buffers["tp_wait_ptr"][0]) for k in h.ranks] == [1_500_000_000] * 2
        x = _x()
        clock = StepClock(10_000_000, start=10**12)
        with monkeypatch.context() as m:
            m.setattr(interp.sync, "_host_clock_ns", clock)
            with pytest.raises(MegakernelError) as ei:
                tp_layer_step(h, x, POS, ranks=(0,))          # rank 1 never launches
        # the stuck wait read the clock until it passed its deadline: 1.5 s of the clock, 150 reads
        # (one wait), and not much more (it stopped there, not at the poll bound)
        assert 1_500_000_000 <= clock.now - clock.start <= 100 * 1_500_000_000, clock.reads
        msg = str(ei.value)
        assert "rank 0" in msg and "gave up waiting after 1.5 s (the time bound)" in msg, msg
        assert "recv_" in msg and "polls" not in msg
        assert ei.value.stuck and all(s[0] == 0 and s[-1] == FAIL_TIME for s in ei.value.stuck)
        assert h.calls == 0 and all(int(k.counters.abs().sum()) == 0 for k in h.ranks)
        set_wait(h, INTERPRETER_TP_WAIT_S)              # a working peer shares the interpreter: seconds per stage
        assert [k.wait_ns for k in h.ranks] == [int(INTERPRETER_TP_WAIT_S * 1e9)] * 2
        out = tp_layer_step(h, x, POS)
        assert torch.equal(out[0], out[1])
        ref = tp_model_ref(*_shards(CFG, w, make_kv_cache(CFG, MAX_SEQ, POS)), CFG, x, POS)
        assert rel_err(out[0], ref) <= TOL
    finally:
        tp_teardown(h)


def test_wait_bound_arguments():
    from interp.tp import set_wait
    w = make_weights(CFG)
    shards, caches = _shards(CFG, w, make_kv_cache(CFG, MAX_SEQ, POS))
    for bad in (0, -1.0, True, "5", 1e9):
        with pytest.raises(ValueError, match="wait_s"):
            build_tp_layers(shards, caches, CFG, MAX_SEQ, wait_s=bad)
    h = build_tp_layers(shards, caches, CFG, MAX_SEQ)
    try:
        with pytest.raises(ValueError, match="wait_s"):
            set_wait(h, 0)
        with pytest.raises(ValueError, match="host_group"):
            build_tp_layers(shards, caches, CFG, MAX_SEQ, host_group=object())
    finally:
        tp_teardown(h)


def test_profile_needs_one_rank_per_process():
    from interp.tp import build_tp_decoder
    cfg = dataclasses.replace(CFG, vocab=200, name="small-2layer-v200")
    with pytest.raises(ValueError, match="profile"):        # both ranks in one process: the CPU loopback
        build_tp_decoder([{}, {}], [[], []], cfg, MAX_SEQ, profile=True)


def test_only_tp_kernels_read_the_clock():
    """The time bound is in the tensor-parallel kernels only: the single-GPU kernel's source is unchanged
    (no clock, no tp_wait_ptr), the TP kernel reads the clock only after a failed first poll."""
    from interp.codegen import kernel_source
    from opcodes import kernel_constexprs
    single = compile_model(CFG, 1, max_seq=MAX_SEQ, decoder=False, sequential=True).tape
    tp = compile_model(CFG, 1, max_seq=MAX_SEQ, decoder=False, sequential=True, tp=2).tapes[0]
    srcs = {}
    for name, t in (("single", single), ("tp", tp)):
        cx = kernel_constexprs(t.lay, interp=False, used=t.classes())
        srcs[name] = kernel_source(kernel_pointers(t.lay, t.classes()), list(cx), t.classes())
    assert "clock_ns" not in srcs["single"] and "tp_wait_ptr" not in srcs["single"]
    s = srcs["tp"]
    assert "tp_wait_ptr" in s and "clock_ns(INTERP)" in s
    # per wait: the clock is read inside `if seen < wt:` (after the first poll), bounded by the loaded limit
    assert s.count("t1 = clock_ns(INTERP)") == 2 * s.count("deadline = t1 + tl.load(tp_wait_ptr)") >= 2
    assert "while (seen < wt) & (n < spin_limit) & (t1 < deadline):" in s


def test_the_clock_probe_under_the_interpreter(monkeypatch):
    """interp.sync.clock_probe (the bench checks the GPU's globaltimer with it before the TP stages):
    under the interpreter the wait clock is the host's monotonic clock (read between two reads of
    time.monotonic_ns), and the probe reports how far the clock its kernel reads advanced (a stand-in
    clock here, 0.3 s a read: exactly 0.3 s between its two launches)."""
    import interp.sync
    from interp.sync import clock_probe
    a = time.monotonic_ns()
    c = interp.sync._host_clock_ns()
    b = time.monotonic_ns()
    assert a <= c <= b, (a, c, b)
    clock = StepClock(300_000_000, start=10**12)
    monkeypatch.setattr(interp.sync, "_host_clock_ns", clock)
    k, _ = clock_probe(torch.device("cpu"), 0.01)
    assert clock.reads == 2 and k == 0.3, (clock.reads, k)
