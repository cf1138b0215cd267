"""The tensor-parallel all-reduces signalled through their data (``Tiling.tp_direct``): O and down
tiles (OPROJ_TP / DOWN_TP) write their rows, each word tagged with the call, into both ranks'
``tp_parts``; TP_REDUCE_D waits on those words (``interp.sync.ll_seen``) and sums rank 0's chunks,
rank 1's, then the two: no TP_PUSH, no fence, no counter. In the tape VM and the CPU loopback (both
ranks in this process under the Triton interpreter): bitwise the counter protocol's results; a peer
that never launches is still reported in bounded time; after a failure no word of an earlier call is
taken for one of the next (the buffer is zeroed with the counters); the verifier names a reduce that
does not wait for the words it reads; the default kernels hold none of it."""
from __future__ import annotations

import pytest
import torch

from conftest import clone_cache, require_interpreter
from interp.runtime import MegakernelError
from interp.tp import INTERPRETER_TP_SPIN_LIMIT, build_tp_layers, tp_layer_step, tp_teardown
from opcodes import PRESETS
from opcodes.reference import make_kv_cache, make_weights
from opcodes.tp import TPLayout, shard_config, shard_kv_cache, shard_weights
from opcodes.tp_direct import TPReduceD
from schedule import compile_model
from schedule.tape import Tape, decode
from schedule.verify import TapeError, verify_tp
from schedule.vm import run_tp

require_interpreter()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = PRESETS["small-2layer"]
MAX_SEQ, POS = 64, 19


MODES = {0: {}, 1: {"tp_direct": 1}}      # the counter protocol (TP_PUSH), the data signals


def _tiling(mode: int):
    return TPLayout.default_tiling(shard_config(CFG, 0, 2), **MODES[mode])


def _build(ll: int, kv, **kw):
    w = make_weights(CFG)
    shards = [shard_weights(w, CFG, r, 2) for r in range(2)]
    caches = [shard_kv_cache(kv, CFG, r, 2) for r in range(2)]
    return build_tp_layers(shards, caches, CFG, MAX_SEQ, tiling=_tiling(ll), **kw)


def _x(seed: int) -> torch.Tensor:
    return torch.randn(1, CFG.d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


def test_the_vm_gives_the_same_results_without_tp_push():
    w = make_weights(CFG)
    x = _x(4)
    outs, pushes = [], []
    for mode in (0, 1):
        c = compile_model(CFG, 3, max_seq=MAX_SEQ, tiling=_tiling(mode), tp=2, decoder=False)
        pushes.append(sum(d.ins.NAME == "tp_push" for d in decode(c.tapes[0])))
        outs.append(run_tp(c.tapes, w, make_kv_cache(CFG, MAX_SEQ, POS), x, POS, seed=2, calls=3, return_all=True))
    assert pushes == [CFG.layers * 2, 0]
    for a, b in zip(*outs):
        assert torch.equal(b[0], b[1]) and torch.equal(a[0], b[0])


def test_verifier_names_a_reduce_that_does_not_wait_for_the_words():
    c = compile_model(CFG, 2, max_seq=MAX_SEQ, tiling=_tiling(1), tp=2, decoder=False, pool_us=0.0)
    t0, t1 = c.tapes
    words = t0.words.clone()
    k = next(d.slot for d in decode(t0) if isinstance(d.ins, TPReduceD) and d.ins.stage == 0)
    words[k, 1], words[k, 2] = -1, 0                     # drop its wait on recv_o
    bad = Tape(t0.lay, t0.num_sms, words, t0.offsets.clone(), list(t0.counters), list(t0.prog_index),
               dict(t0.meta), t0.pool_counter)
    with pytest.raises(TapeError, match=r"rank 0 instruction \d+ \(tp_reduce_d, sm \d\): reads rank 0's tp_parts"
                                        r"\[\d+:\d+\] written by rank \d instruction \d+ \(oproj_tp"):
        verify_tp([bad, t1])


def test_only_direct_kernels_hold_the_word_waits():
    from interp.codegen import kernel_source
    from opcodes import kernel_constexprs, kernel_pointers
    srcs = {}
    for mode in (0, 1):
        c = compile_model(CFG, 2, max_seq=MAX_SEQ, tiling=_tiling(mode), tp=2, decoder=False)
        lay, classes = c.tapes[0].lay, c.tapes[0].classes()
        srcs[mode] = kernel_source(kernel_pointers(lay, used=classes), kernel_constexprs(lay, used=classes), classes)
    assert "poll_tp_ll" not in srcs[0] and "ll_ptr" not in srcs[0] and "oproj_tp" not in srcs[0]
    assert "poll_tp_ll" in srcs[1] and "tp_push" not in srcs[1]


def test_data_signals_give_the_counter_protocols_results_bitwise():
    kv = make_kv_cache(CFG, MAX_SEQ, POS)
    outs = []
    for ll in (0, 1):
        h = _build(ll, clone_cache(kv))
        try:
            if ll:
                sig = h.ranks[0].bindings.pointers["peer_sig_ptr"]
                assert int((sig == 2).sum()) == CFG.layers * 2     # recv_o, recv_d: one row block a layer
            x, got = _x(5), []
            for k in range(3):                 # calls 1, 2, 3: receive slots 1, 0, 1
                o = tp_layer_step(h, x, POS + k)
                assert torch.equal(o[0], o[1])
                got.append(o[0])
                x = o[0]
            outs.append(got)
        finally:
            tp_teardown(h)
    for a, b in zip(*outs):
        assert torch.equal(a, b) and not a.isnan().any()


def test_a_dead_peer_is_reported_and_no_stale_word_is_taken():
    kv = make_kv_cache(CFG, MAX_SEQ, POS)
    h = _build(1, clone_cache(kv), spin_limit=400)
    try:
        for k in h.ranks:
            k.spin_limit = INTERPRETER_TP_SPIN_LIMIT
        x = _x(6)
        first = tp_layer_step(h, x, POS)
        tp_layer_step(h, first[0], POS + 1)
        for k in h.ranks:
            k.spin_limit = 400
        # call 3 with rank 1 absent: rank 0's first wait on a push cannot be met (slot 1 holds call 1's
        # words), then everything resets; the call count starts over at 1, whose words slot 1 still
        # held: a second lone call must fail too, not run on call 1's data
        for _ in range(2):
            with pytest.raises(MegakernelError) as ei:
                tp_layer_step(h, x, POS, ranks=(0,))
            assert "recv_" in str(ei.value) and "tp_reduce_d" in str(ei.value)
            assert h.calls == 0
        for k in h.ranks:
            k.spin_limit = INTERPRETER_TP_SPIN_LIMIT
        again = tp_layer_step(h, x, POS)
        assert torch.equal(again[0], again[1]) and torch.equal(again[0], first[0])
    finally:
        tp_teardown(h)


def test_tp_direct_must_be_0_or_1():
    from opcodes import Tiling
    with pytest.raises(ValueError, match="tp_direct must be 0 or 1"):
        Tiling(tp_direct=2)
