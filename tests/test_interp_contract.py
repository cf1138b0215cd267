"""The spec's contract of ``build_layer / layer_step / teardown``, through the Triton interpreter.

The real persistent kernel (every opcode's real device
function) runs on CPU tensors with ``TRITON_INTERPRET=1``. For each small config, over
``STEPS`` decode steps starting at a prefill length that is not a multiple of any tile size:

* every step's output is within ``TOL`` relative error of ``opcodes.reference.model_ref``
  running on its own copy of the cache;
* after every step only cache row ``pos`` differs from before the step (bitwise);
* after the run the written rows match the reference's and every other row is bitwise
  untouched; ``weights`` and ``x`` are bitwise unmodified;
* the returned tensor is a fresh ``(1, d)`` bf16/fp32 tensor (a later call does not overwrite an
  earlier output), and repeating a step (same ``x``, same ``pos``) is bitwise repeatable;
* ``teardown`` works (twice) and a step after it raises ValueError without touching the cache.

The interpreter is slow (~0.5 s per step for ``tiny``, ~2 s for ``small-*``): STEPS is 5 (each
prefill is chosen so that the steps still cross a key-block boundary).
"""
from __future__ import annotations

import pytest
import torch

from conftest import bitwise_equal, changed_rows, clone_cache, clone_weights, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import Tiling
from opcodes.config import PRESETS
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err, rope_tables

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

TOL = 1.5e-2
STEPS = 5

# (preset, prefill, max_seq_len, tiling overrides). No prefill is a multiple of any tile size
# (16, 32, 64, ...); 29 -> 33 crosses 32 keys and 45 -> 49 crosses 48 (the attention split size
# cdiv(pos + 1, attn_splits) changes mid-run); 72 is a max_seq_len that is not a power of two.
CASES = [
    pytest.param("tiny", 37, 64, None, id="tiny-gqa4"),
    pytest.param("tiny-gqa8", 29, 72, None, id="tiny-gqa8-ffn224"),
    pytest.param("small-gqa4", 45, 64, None, id="small-gqa4-ffn448"),
    # two layers: slow (~20 s); its multi-layer part is covered by test_decoder's
    # test_build_model_matches_model_ref (the same checks per step on a two-layer model, 3 steps)
    # and its per-handle contract by the one-layer cases here
    pytest.param("small-2layer", 37, 64, None, id="small-2layer", marks=pytest.mark.slow),
    # few wide attention splits of small blocks: several (and partial) key blocks per split
    pytest.param("tiny", 37, 64, dict(attn_splits=2, attn_block=16), id="tiny-splits2-block16"),
]


def _x(cfg, seed):
    return rand_x(cfg.d, 1000 + seed)


@pytest.mark.parametrize("name,prefill,max_seq,tiling", CASES)
def test_contract(name, prefill, max_seq, tiling):
    cfg = PRESETS[name]
    assert prefill + STEPS <= max_seq
    weights = make_weights(cfg, seed=11)
    cache = make_kv_cache(cfg, max_seq, prefill, seed=12)
    weights0 = clone_weights(weights)
    cache0 = clone_cache(cache)
    ref_cache = clone_cache(cache)
    cfg_dict = cfg.to_dict()
    cfg_dict0 = dict(cfg_dict)
    cos_sin = rope_tables(cfg, max_seq)

    kw = {} if tiling is None else {"tiling": Tiling.for_config(cfg, **tiling)}
    h = build_layer(weights, cache, cfg_dict, max_seq, **kw)
    assert cfg_dict == cfg_dict0, "build_layer modified cfg"

    outs, out_copies, errs = [], [], []
    x = pos = None
    for step in range(STEPS):
        pos = prefill + step
        x = _x(cfg, step)
        x0 = x.clone()
        before = clone_cache(cache)
        out = layer_step(h, x, pos)
        ref = model_ref(weights0, ref_cache, cfg, x0, pos, cos_sin)

        assert isinstance(out, torch.Tensor)
        assert tuple(out.shape) == (1, cfg.d), f"step {step}: shape {tuple(out.shape)}"
        assert out.dtype in (torch.bfloat16, torch.float32), f"step {step}: dtype {out.dtype}"
        assert out.device == x.device
        assert torch.isfinite(out.float()).all(), f"step {step} (pos {pos}): non-finite output"
        err = rel_err(out, ref)
        errs.append(err)
        assert err <= TOL, f"step {step} (pos {pos}): rel err {err:.3e} > {TOL} (all so far: {errs})"
        assert bitwise_equal(x, x0), f"step {step}: layer_step modified x"
        # fresh: not x, not any earlier output; earlier outputs are not overwritten by this call
        sp = out.untyped_storage().data_ptr()
        assert sp != x.untyped_storage().data_ptr()
        for j, (o, oc) in enumerate(zip(outs, out_copies)):
            assert sp != o.untyped_storage().data_ptr(), f"step {step} returned the storage of step {j}'s output"
            assert bitwise_equal(o, oc), f"step {step} overwrote the output returned by step {j}"
        outs.append(out)
        out_copies.append(out.clone())
        # only row pos of each K and V changed in this step
        for l in range(cfg.layers):
            for j in range(2):
                rows = changed_rows(cache[l][j], before[l][j])
                assert set(rows) <= {pos}, f"step {step} (pos {pos}) changed kv_cache[{l}][{j}] rows {rows}"

    # repeatability: the same x at the same pos again -> bitwise the same output, same cache
    before = clone_cache(cache)
    again = layer_step(h, x, pos)
    assert bitwise_equal(again, out_copies[-1]), \
        f"repeat of pos {pos}: max |diff| {(again.float() - out_copies[-1].float()).abs().max().item()}"
    for l in range(cfg.layers):
        for j in range(2):
            assert bitwise_equal(cache[l][j], before[l][j]), f"repeat of pos {pos} changed kv_cache[{l}][{j}]"

    # the cache after the run: written rows match the reference's, all other rows untouched
    lo, hi = prefill, prefill + STEPS
    for l in range(cfg.layers):
        for j, kvname in enumerate("kv"):
            got, ref, orig = cache[l][j], ref_cache[l][j], cache0[l][j]
            rows = changed_rows(got, orig)
            assert set(rows) <= set(range(lo, hi)), f"kv_cache[{l}][{j}] ({kvname}): rows {rows} changed"
            assert bitwise_equal(got[:, :, :lo], orig[:, :, :lo])
            assert bitwise_equal(got[:, :, hi:], orig[:, :, hi:])
            for p in range(lo, hi):
                e = rel_err(got[:, :, p], ref[:, :, p])
                assert e <= TOL, f"kv_cache[{l}][{j}] ({kvname}) row {p}: rel err {e:.3e} vs the reference"

    # weights untouched (bitwise)
    for l, (lw, lw0) in enumerate(zip(weights["layers"], weights0["layers"])):
        assert set(lw) == set(lw0)
        for n in lw0:
            assert bitwise_equal(lw[n], lw0[n]), f"weights['layers'][{l}][{n!r}] was modified"
    assert cfg_dict == cfg_dict0, "layer_step modified cfg"

    # teardown: idempotent; a step after it raises ValueError before touching anything
    teardown(h)
    teardown(h)
    before = clone_cache(cache)
    with pytest.raises(ValueError, match="teardown"):
        layer_step(h, _x(cfg, 0), prefill)
    for l in range(cfg.layers):
        for j in range(2):
            assert bitwise_equal(cache[l][j], before[l][j])
    print(f"{name} prefill={prefill} max_seq={max_seq} tiling={tiling}: max rel err {max(errs):.3e}")


# tiny: a partial pool and an all-pool tape over three calls (the tickets of consecutive calls);
# small-2layer (a pool spanning two layers; 4x the interpreter time per call): the all-pool tape, one call
# (two with --runslow)
@pytest.mark.parametrize("name,pools,steps,slow_steps", [("tiny", (20.0, 1e9), 3, 3), ("small-2layer", (1e9,), 1, 2)])
def test_pool_kernel_is_bitwise_the_queued_kernel(runslow, name, pools, steps, slow_steps):
    """The same kernel with the plan's tail (or all of it) in a pool taken by ticket: outputs and
    caches bitwise those of the queued tape, and the ticket counter advances by exactly
    (pool length + SMs) per call, so the next call's tickets start at the pool's first slot."""
    cfg, prefill, max_seq = PRESETS[name], 37, 64
    steps = slow_steps if runslow else steps
    weights = make_weights(cfg, seed=5)
    runs = {}
    for pool_us in (0.0,) + pools:
        cache = make_kv_cache(cfg, max_seq, prefill, seed=6)
        # the split attention: at 64 positions the default merges it, and a 20 us tail is then the whole plan
        h = build_layer(weights, cache, cfg.to_dict(), max_seq, pool_us=pool_us, tiling=Tiling.for_config(cfg))
        outs = [layer_step(h, _x(cfg, s), prefill + s) for s in range(steps)]
        if pool_us:
            assert h.tape.pool_len > 0 and (pool_us < 1e9) == (h.tape.pool_len < len(h.tape))
            assert int(h.counters[h.tape.pool_counter]) == steps * h.tape.tickets_per_call()
        else:
            assert h.tape.pool_len == 0
        runs[pool_us] = (outs, cache)
        teardown(h)
    outs0, cache0 = runs[0.0]
    for pool_us, (outs, cache) in runs.items():
        assert all(bitwise_equal(a, b) for a, b in zip(outs, outs0)), pool_us
        assert all(bitwise_equal(a, b) for pa, pb in zip(cache, cache0) for a, b in zip(pa, pb)), pool_us




def test_elided_waits_kernel_is_bitwise_the_default_kernel():
    """The real kernel on a tape without the repeated waits (compile_model(elide_waits=True)):
    the same outputs and KV rows, bit for bit."""
    cfg = PRESETS["small-2layer"]
    w = make_weights(cfg)
    outs = []
    for elide in (False, True):
        kv = make_kv_cache(cfg, 64, 41)
        # the split attention (the merged default at 64 positions leaves this tape no repeated wait)
        h = build_layer(w, kv, cfg.to_dict(), 64, elide_waits=elide, tiling=Tiling.for_config(cfg))
        assert (h.tape.repeated_waits()[1] == 0) == elide
        x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        outs.append((layer_step(h, x, 41), kv))
        teardown(h)
    (a, kva), (b, kvb) = outs
    assert torch.equal(a, b)
    assert all(torch.equal(p, q) for pa, pb in zip(kva, kvb) for p, q in zip(pa, pb))
