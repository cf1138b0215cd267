"""One-pass attention (``Tiling.attn_full``): one ATTN_FULL per KV head attends to the whole cache
``[0, pos]`` and writes the attention output itself, with no ATTN_PARTIAL splits and no ATTN_REDUCE.

It sums in another order than the splits and their merge, so it is compared within rounding: in the
tape VM against the reference and the default tiling, in the real kernel (Triton interpreter)
against the VM and the default kernel; layer 0's K/V cache rows are bitwise the default's (the QKV
tiles are untouched), its VM result is the same under every interleaving, and the verifier names an
ATTN_FULL that does not wait for the key at ``pos``.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, decode_tokens, decoder_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.attn_full import AttnFull
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import TapeError, compile_model
from schedule.program import lower, make_layout
from schedule.tape import decode
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # 2 KV heads of 2 query heads
FULL = dict(attn_full=1)


def _caches_agree(kv, kv_default) -> None:
    """Layer 0's new K/V rows are bitwise the default's (the QKV tiles are untouched); later layers'
    come from a residual stream a rounding apart."""
    for j in (0, 1):
        assert torch.equal(bits(kv[0][j]), bits(kv_default[0][j]))
        for l in range(1, CFG.layers):
            assert rel_err(kv[l][j], kv_default[l][j]) <= 5e-3


def _names(tape) -> list[str]:
    return [d.ins.NAME for d in decode(tape)]


@pytest.mark.parametrize("pos", [0, 1, 37, 63])
def test_one_instruction_per_kv_head_and_within_rounding_in_the_vm(pos):
    w = make_weights(CFG, seed=3)
    x = rand_x(CFG.d, 4)
    c = compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG, **FULL), pool_us=0)
    names = _names(c.tape)
    assert names.count("attn_full") == CFG.layers * CFG.n_kv
    assert "attn_partial" not in names and "attn_reduce" not in names
    outs = []
    for s in (0, 1, 2):                                    # three interleavings: bitwise one result
        kv = make_kv_cache(CFG, 64, pos)
        outs.append((run_tape(c.tape, w, kv, x, pos, seed=s), kv))
    assert all(torch.equal(bits(o), bits(outs[0][0])) for o, _ in outs[1:])
    kv_ref = make_kv_cache(CFG, 64, pos)
    ref = model_ref(w, kv_ref, CFG, x, pos)
    kv_def = make_kv_cache(CFG, 64, pos)
    default = run_tape(compile_model(CFG, 5, max_seq=64, pool_us=0).tape, w, kv_def, x, pos)
    assert rel_err(outs[0][0], ref) <= 1e-2
    assert rel_err(outs[0][0], default) <= 2e-3
    _caches_agree(outs[0][1], kv_def)


@pytest.mark.parametrize("pos", [0, 21, 63])
def test_kernel_within_rounding_of_the_vm_and_the_default(pos):
    w = make_weights(CFG, seed=5)
    x = rand_x(CFG.d, 6)
    kv0 = make_kv_cache(CFG, 64, pos)
    outs = []
    for over in ({}, FULL):
        kv = clone_cache(kv0)
        h = build_layer(w, kv, CFG.to_dict(), 64, tiling=Tiling.for_config(CFG, **over))
        outs.append((layer_step(h, x, pos).clone(), kv))
        teardown(h)
    vm = run_tape(compile_model(CFG, 5, max_seq=64, tiling=Tiling.for_config(CFG, **FULL), pool_us=0).tape,
                  w, clone_cache(kv0), x, pos)
    ref = model_ref(w, clone_cache(kv0), CFG, x, pos)
    err, err_default = rel_err(outs[1][0], ref), rel_err(outs[0][0], ref)
    assert err <= 1.5e-2 and err <= 1.1 * err_default + 1e-3, (err, err_default)
    assert rel_err(outs[1][0], vm) <= 1e-2
    assert rel_err(outs[1][0], outs[0][0]) <= 5e-3        # bf16 outputs a rounding apart: ~1 ulp in places
    _caches_agree(outs[1][1], outs[0][1])


def test_decoder_in_the_kernel_agrees_with_the_default():
    cfg = dataclasses.replace(CFG, vocab=96, name="small-2layer-v96")
    w = decoder_weights(cfg, seed=6)
    (la, ta), (lb, tb) = (decode_tokens(w, cfg, Tiling.for_config(cfg, **over)) for over in ({}, FULL))
    assert ta == tb
    assert rel_err(lb, la) <= 2e-3


def test_verifier_names_an_attn_full_without_the_kv_wait():
    lay = make_layout(CFG, 64, Tiling.for_config(CFG, **FULL))
    prog = lower(lay)
    i = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins, AttnFull))
    kv = [c for c in prog.waits[i] if prog.counters[c].startswith("kv[")]
    assert len(kv) == 1
    prog.waits[i] = tuple(c for c in prog.waits[i] if c not in kv)
    with pytest.raises(TapeError, match="kv_new_k"):
        compile_model(CFG, 4, max_seq=64, tiling=lay.tiling, lowering=lambda _: prog, pool_us=0)


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="attn_full must be 0 or 1"):
        Tiling(attn_full=2)
    with pytest.raises(ValueError, match="attn_full and Tiling.key_in_reduce"):
        Tiling(attn_full=1, key_in_reduce=1)
    # an O K chunk of one query head: a KV head's two query heads would signal two chunks
    with pytest.raises(ValueError, match="o_k = 32 must be a multiple of a KV head's query columns"):
        lower(make_layout(CFG, 64, Tiling.for_config(CFG, attn_full=1, o_k=32, red_rows=64)))
