"""CPU smoke test of bench/baselines.py with the "tiny" preset.

The compiled baseline is traced by dynamo and AOTAutograd (backend ``aot_eager``: the in-place
cache writes go through functionalization as under inductor, without inductor's C++ compile);
the same test with inductor on CPU (``mode="default"``: CUDA graphs do not exist on CPU) is
marked slow. MEGATAPE_BASELINES_BACKEND names one backend for both.
"""
from __future__ import annotations

import os

import pytest
import torch

from bench import baselines as B
from conftest import clone_cache, perf_counter_ms, rand_x
from opcodes.config import PRESETS
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err

CFG = PRESETS["tiny"]
MAX_SEQ, PREFILL = 64, 40
BACKEND = os.environ.get("MEGATAPE_BASELINES_BACKEND")


def _x(seed):
    return rand_x(CFG.d, seed)


def test_eager_step_matches_model_ref():
    w = make_weights(CFG)
    cache = make_kv_cache(CFG, MAX_SEQ, PREFILL)
    ref_cache = clone_cache(cache)
    step = B.eager_step(w, cache, CFG)
    for i, pos in enumerate(range(PREFILL, PREFILL + 3)):
        x = _x(100 + i)
        out = step(x, pos)
        ref = model_ref(w, ref_cache, CFG, x, pos)
        assert torch.equal(out, ref)
    for (k, v), (rk, rv) in zip(cache, ref_cache):
        assert torch.equal(k, rk) and torch.equal(v, rv)


# inductor's CPU compile takes ~20 s; aot_eager runs the same dynamo graph capture (no recompile for
# pos, the caller's cache tensors as module buffers, written in place through functionalization)
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_matches_reference_and_writes_cache_in_place(backend):
    torch._dynamo.reset()
    # pos must not recompile (config.patch, not monkeypatch: dynamo's config module loses a key that
    # monkeypatch restores, so a second parameter could not set it again)
    with torch._dynamo.config.patch(error_on_recompile=True):
        _check_compiled_step(BACKEND or backend)


def _check_compiled_step(backend):
    w = make_weights(CFG)
    cache = make_kv_cache(CFG, MAX_SEQ, PREFILL)
    ref_cache = clone_cache(cache)
    step = B.compiled_step(w, cache, CFG, MAX_SEQ, mode="default", backend=backend)
    # the module's cache buffers are the caller's tensors
    assert step.module.layers[0].k_cache is cache[0][0]
    assert step.module.layers[0].v_cache is cache[0][1]
    for i, pos in enumerate(range(PREFILL, PREFILL + 3)):
        x = _x(200 + i)
        before = clone_cache(cache)
        out = step(x, pos)
        ref = model_ref(w, ref_cache, CFG, x, pos)
        assert out.shape == ref.shape == (1, CFG.d)
        err = rel_err(out, ref)
        assert err < 1.5e-2, f"pos {pos}: rel err {err}"
        for (k, v), (k0, v0), (rk, rv) in zip(cache, before, ref_cache):
            for t, t0, rt in ((k, k0, rk), (v, v0, rv)):
                # only slot pos changed ...
                other = torch.ones(MAX_SEQ, dtype=torch.bool)
                other[pos] = False
                assert torch.equal(t[:, :, other], t0[:, :, other])
                assert not torch.equal(t[:, :, pos], t0[:, :, pos])
                # ... and it holds what the reference wrote there (bf16 K after RoPE, V)
                assert rel_err(t[:, :, pos], rt[:, :, pos]) < 1.5e-2
        # the returned tensor is a copy, not the compiled graph's output buffer
        assert out.data_ptr() != step(x, pos).data_ptr()


def test_compiled_step_module_uncompiled():
    """The torch.compile baseline's module, run without compiling, matches the reference."""
    w = make_weights(CFG)
    cache = make_kv_cache(CFG, MAX_SEQ, PREFILL)
    ref_cache = clone_cache(cache)
    step = B.compiled_step(w, cache, CFG, MAX_SEQ, do_compile=False)
    for i, pos in enumerate(range(PREFILL, PREFILL + 2)):
        x = _x(400 + i)
        err = rel_err(step(x, pos), model_ref(w, ref_cache, CFG, x, pos))
        assert err < 1.5e-2, f"pos {pos}: rel err {err}"


def test_only_one_torch_compile_attention():
    """One torch.compile baseline (SDPA with enable_gqa), no attention variants to pick from."""
    import inspect
    assert "attn" not in inspect.signature(B.compiled_step).parameters


def test_cublas_gemv_graph_runs():
    w = make_weights(CFG)
    f = B.cublas_gemv_graph(w, CFG)
    out = f(None, 0)
    assert out.shape == (CFG.d,) and torch.isfinite(out.float()).all()
    f2 = B.cublas_gemv_graph(w, CFG, use_mv=False)
    assert torch.allclose(f2().float(), out.float(), rtol=2e-2, atol=2e-2)


def test_time_step_and_count_kernels_and_bandwidth():
    w = make_weights(CFG)
    cache = make_kv_cache(CFG, MAX_SEQ, PREFILL)
    step = B.eager_step(w, cache, CFG)
    args = [(_x(300 + i), PREFILL + i) for i in range(4)]
    with perf_counter_ms() as clock:          # 1 ms a read
        r = B.time_step(step, args, warmup=1)
        # CPU: each call between two reads of the clock, in both passes: 1 ms = 1000 us each
        assert clock.reads == 2 * 2 * len(args)
        assert r["us_event"] == pytest.approx(1000.0) and r["us_wall"] == pytest.approx(1000.0)
        assert len(r["all_event"]) == len(r["all_wall"]) == 4
        assert r["all_event"] == pytest.approx([1000.0] * 4) and r["all_wall"] == pytest.approx([1000.0] * 4)
        # the copy's bytes read and written over the median copy's 1 ms
        bw = B.stream_copy_bandwidth("cpu", nbytes=1 << 20, iters=3)
        assert bw == pytest.approx(2 * (1 << 20) / 1e-3)
    if not torch.cuda.is_available():
        assert B.count_kernels(step, args[0]) == (0, 1.0)


def test_bench_table():
    rows = [dict(name="floor", us_event=413.0, tokens_s=2420.0, x_floor=1.0),
            dict(name="eager torch", us_event=1080.4, us_wall=1100.2, tokens_s=926.0, x_floor=2.61,
                 kernels=54, dominant=0.2512)]
    t = B.bench_table(rows)
    lines = t.splitlines()
    assert len(lines) == 4
    assert len({len(l) for l in lines}) == 1          # aligned
    assert "eager torch" in lines[3] and "54" in lines[3] and "0.251" in lines[3]
    assert " - " in lines[2]


def test_hf_generate_baseline_times_new_tokens(monkeypatch):
    """transformers' generate with a static cache on a random model of a preset's shape (no
    compile on the CPU), the requested number of tokens made (hf_generate_us checks it), timed on a
    stand-in clock that advances 1 ms a forward of the model: exactly 1000 us a new token (the
    difference of 2n and n new tokens over n; on the wall clock a busy host can make it anything,
    even not positive, which the next test covers)."""
    pytest.importorskip("transformers")
    import dataclasses

    import interp.hf
    forwards = [0]
    make = interp.hf.random_llama_on

    def counted(*a, **kw):
        model = make(*a, **kw)
        fwd = model.forward

        def forward(*fa, **fk):
            forwards[0] += 1
            return fwd(*fa, **fk)
        model.forward = forward
        return model
    monkeypatch.setattr(interp.hf, "random_llama_on", counted)
    monkeypatch.setattr(B.time, "perf_counter", lambda: forwards[0] * 1e-3)
    cfg = dataclasses.replace(PRESETS["small-2layer"], vocab=96)
    us = B.hf_generate_us(cfg, "cpu", pos=8, n_new=8, compile=False)
    assert forwards[0] > 0 and us == pytest.approx(1000.0, rel=1e-9), (forwards[0], us)


def test_hf_generate_baseline_refuses_a_difference_it_cannot_resolve(monkeypatch):
    """Where 2n new tokens time no slower than n (a clock that does not move, as a very busy host can
    look), the baseline raises instead of reporting 0 us a token."""
    pytest.importorskip("transformers")
    import dataclasses
    monkeypatch.setattr(B.time, "perf_counter", lambda: 1.0)
    cfg = dataclasses.replace(PRESETS["small-2layer"], vocab=96)
    with pytest.raises(RuntimeError, match="too busy to time 4 tokens"):
        B.hf_generate_us(cfg, "cpu", pos=8, n_new=4, compile=False, reps=2)
