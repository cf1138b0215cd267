"""TP_PUSH signalling through its data (``Tiling.tp_ll``): each pushed word carries the call number in
its high half, the kernel makes no system-scope fence nor signal for the push, and the peer's wait on
the push's counter checks the words (``interp.sync.ll_seen``). Run in the CPU loopback (both ranks
in this process under the Triton interpreter): the same results, bitwise, as the counter protocol;
a peer that never launches is still reported in bounded time; and after a failure no word of an
earlier call is taken for one of the next (the buffer is zeroed with the counters)."""
from __future__ import annotations

import pytest
import torch

from conftest import clone_cache, require_interpreter
from interp.runtime import MegakernelError
from interp.tp import INTERPRETER_TP_SPIN_LIMIT, build_tp_layers, tp_layer_step, tp_teardown
from opcodes import PRESETS
from opcodes.reference import make_kv_cache, make_weights
from opcodes.tp import TPLayout, shard_config, shard_kv_cache, shard_weights

require_interpreter()
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = PRESETS["small-2layer"]
MAX_SEQ, POS = 64, 19


def _tiling(ll: int):
    return TPLayout.default_tiling(shard_config(CFG, 0, 2), tp_ll=ll)


def _build(ll: int, kv, **kw):
    w = make_weights(CFG)
    shards = [shard_weights(w, CFG, r, 2) for r in range(2)]
    caches = [shard_kv_cache(kv, CFG, r, 2) for r in range(2)]
    return build_tp_layers(shards, caches, CFG, MAX_SEQ, tiling=_tiling(ll), **kw)


def _x(seed: int) -> torch.Tensor:
    return torch.randn(1, CFG.d, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


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
            assert "recv_" in str(ei.value) and "tp_reduce" in str(ei.value)
            assert h.calls == 0
        for k in h.ranks:
            k.spin_limit = INTERPRETER_TP_SPIN_LIMIT
        again = tp_layer_step(h, x, POS)
        assert torch.equal(again[0], again[1]) and torch.equal(again[0], first[0])
    finally:
        tp_teardown(h)


def test_tp_ll_must_be_0_or_1():
    from opcodes import Tiling
    with pytest.raises(ValueError, match="tp_ll must be 0 or 1"):
        Tiling(tp_ll=2)
