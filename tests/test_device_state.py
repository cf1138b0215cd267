"""The call count and the position live on the device (the kernel's control block), so a step is the
same launch every time: through the Triton interpreter on the CPU. (Capturing steps in CUDA graphs
is in tests/test_gpu.py.)

* the kernel advances the call count and the next position itself; ``pos=None`` takes the position
  the device holds (the last call's + 1, or ``set_position``'s);
* a device position outside the cache runs nothing and raises ``MegakernelError``;
* after ``epoch_limit`` calls the kernel zeroes the counters and starts the count over;
* a counter found past its target (a second launch of the handle beside this one, or a count out
  of step) is an error, not a silent wrong answer;
* ``generate``'s blocks of launches at the device's position (what a CUDA-graph replay runs, here
  as plain launches) make the tokens of one launch per position, greedy and sampled (SAMPLE's
  Philox is seeded by the position the kernel took from the device).
(A handle stepped from two threads at once raises: tests/test_interp_errors.py.)
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import clone_cache, decoder_weights, rand_x, require_interpreter
from interp import MegakernelError, decode_step, generate, model_step
from interp import decoder as decoder_mod
from interp import runtime
from interp.codegen import CTL_CALLS, CTL_POS, QOFF_EXTRA
from interp.runtime import set_position
from opcodes import ModelConfig
from opcodes.decoder import decoder_ref
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err

require_interpreter()

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, name="two-layer")
MAX_SEQ = 24
TOL = 1.5e-2
# the decoder tests' model: one layer (the position and the call count the device holds do not depend on
# the layers; the interpreter's time a step does)
DECODER_CFG = dataclasses.replace(CFG, layers=1, vocab=120, name="one-layer-decoder")


def _model(handles, prefill=5):
    w = make_weights(CFG, seed=11)
    kv = make_kv_cache(CFG, MAX_SEQ, prefill, seed=12)
    ref_kv = clone_cache(kv)
    return handles.model(w, kv, CFG.to_dict(), MAX_SEQ), w, kv, ref_kv


def test_the_kernel_advances_the_call_count_and_the_position(handles):
    h, w, kv, ref_kv = _model(handles)
    assert h.ctl.tolist()[:3] == [0, 0, 0]
    for k, pos in enumerate([5, 6, 9, 3]):                    # explicit positions, any order
        x = rand_x(CFG.d, 100 + k)
        out = model_step(h, x, pos)
        assert rel_err(out, model_ref(w, ref_kv, CFG, x, pos)) <= TOL
        assert int(h.ctl[CTL_CALLS]) == k + 1 and int(h.ctl[CTL_POS]) == pos + 1
    # None: the position the device holds, the last call's + 1
    for k in range(3):
        x = rand_x(CFG.d, 200 + k)
        out = model_step(h, x, None)
        assert rel_err(out, model_ref(w, ref_kv, CFG, x, 4 + k)) <= TOL
    assert int(h.ctl[CTL_POS]) == 7
    set_position(h, 12)
    x = rand_x(CFG.d, 300)
    assert rel_err(model_step(h, x, None), model_ref(w, ref_kv, CFG, x, 12)) <= TOL
    for (ka, va), (kb, vb) in zip(kv, ref_kv):               # the same rows written as the reference's
        assert rel_err(ka[:, :, :13], kb[:, :, :13]) <= TOL and rel_err(va[:, :, :13], vb[:, :, :13]) <= TOL
    with pytest.raises(ValueError, match="pos"):
        set_position(h, MAX_SEQ)


def test_a_device_position_outside_the_cache_runs_nothing(handles):
    h, w, kv, ref_kv = _model(handles)
    x = rand_x(CFG.d, 1)
    model_step(h, x, MAX_SEQ - 1)                              # leaves MAX_SEQ on the device
    before = clone_cache(kv)
    with pytest.raises(MegakernelError, match=r"position taken from the device \(24\) is outside"):
        model_step(h, x, None)
    assert all(torch.equal(a, b) for pa, pb in zip(kv, before) for a, b in zip(pa, pb))
    assert h.ctl.tolist()[:3] == [0, 0, 0]                     # reset: the next launch starts clean
    out = model_step(h, x, 7)
    assert rel_err(out, model_ref(w, ref_kv, CFG, x, 7)) <= TOL


def test_the_counters_start_over_after_the_epoch_limit(handles):
    """With a limit of 2 calls, the kernel zeroes the counters every second call; results stay right."""
    h, w, kv, ref_kv = _model(handles)
    limit_word = h.num_sms + 2 + QOFF_EXTRA.index("epoch_limit")     # after the num_sms + 2 offsets
    h.qoff_dev[limit_word] = 2
    seen = []
    for k in range(5):
        x = rand_x(CFG.d, 400 + k)
        out = model_step(h, x, 5 + k)
        assert rel_err(out, model_ref(w, ref_kv, CFG, x, 5 + k)) <= TOL
        seen.append((int(h.ctl[CTL_CALLS]), int(h.counters.abs().sum())))
    assert [c for c, _ in seen] == [1, 0, 1, 0, 1]
    assert [z for c, z in seen if c == 0] == [0, 0]            # zeroed at the wrap


def test_a_counter_past_its_target_is_an_error_not_a_wrong_answer(handles):
    """As if another launch of this handle had run beside this one: its counters are ahead of the
    call count. The kernel refuses; the next launch starts clean."""
    h, w, kv, ref_kv = _model(handles)
    x = rand_x(CFG.d, 2)
    model_step(h, x, 5)
    assert rel_err(model_step(h, x, 5), model_ref(w, ref_kv, CFG, x, 5)) <= TOL
    h.ctl[CTL_CALLS] = 0                                       # the count falls behind the counters
    with pytest.raises(MegakernelError, match="past its target"):
        model_step(h, x, 6)
    out = model_step(h, x, 6)
    assert rel_err(out, model_ref(w, ref_kv, CFG, x, 6)) <= TOL


def test_decode_at_the_device_position(handles):
    """decode_step(pos=None) continues where the last call stopped, like the reference."""
    cfg = DECODER_CFG
    w = decoder_weights(cfg, seed=5)
    kv = make_kv_cache(cfg, MAX_SEQ, 0)
    ref_kv = clone_cache(kv)
    h = handles.decoder(w, kv, cfg.to_dict(), MAX_SEQ, lm_rows=16, emb_cols=16)
    for pos, tok in enumerate([3, 17, 99]):
        lg = decode_step(h, tok, pos if pos == 0 else None)
        assert rel_err(lg, decoder_ref(w, ref_kv, cfg, tok, pos)) <= 2e-2
    # generate after it, from an explicit start: the positions the device then holds are the next ones
    toks = generate(h, [5], 3, start_pos=3)
    assert toks.shape == (3,) and int(h.layer.ctl[CTL_POS]) == 3 + 1 + 2
    set_position(h, 10)                                        # a DecoderHandle is accepted too
    assert int(h.layer.ctl[CTL_POS]) == 10


class _PlainBlock:
    """What ``generate``'s CUDA graph of ``k`` launches replays, as plain launches at the device's
    position (no CUDA graphs on a CPU)."""

    def __init__(self, dh, h, k):
        self.dh, self.h, self.k = dh, h, k

    def replay(self):
        for _ in range(self.k):
            runtime.launch(self.h, self.dh.x0, -1, self.dh.hidden)


# greedy: slow (~10 s); the same greedy blocks (those of one tape after the switch included) run by default
# in test_two_tapes' test_generate_in_blocks_across_the_switch[False]
@pytest.mark.parametrize("sampling", [pytest.param(False, marks=pytest.mark.slow), True])
def test_generate_in_blocks_at_the_device_position(handles, monkeypatch, sampling):
    """generate with graph_block=3 (blocks replayed at the device's position, then the tail one
    launch each) makes the tokens of graph_block=0 (one launch per explicit position)."""
    cfg = DECODER_CFG
    w = decoder_weights(cfg, seed=6)
    kw = dict(temperature=0.9, top_k=40, seed=7) if sampling else {}
    toks = []
    for block in (0, 3):
        kv = make_kv_cache(cfg, MAX_SEQ, 0)
        h = handles.decoder(w, kv, cfg.to_dict(), MAX_SEQ, lm_rows=16, emb_cols=16, sampling=sampling)
        with monkeypatch.context() as m:
            m.setattr(decoder_mod, "_block_graph", _PlainBlock)
            m.setattr(decoder_mod, "_graph_block", lambda h, gb, rl, eos: gb)
            toks.append(generate(h, [3, 17], 8, start_pos=2, graph_block=block, **kw).tolist())
        # the device holds the position after the last one used: 2 + 2 prompt + 8 new - 1
        assert int(h.layer.ctl[CTL_POS]) == 11 and h.layer.last_pos == 10
    assert toks[0] == toks[1], toks
