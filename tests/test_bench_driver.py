"""The GPU benchmark's correctness protocol and timing helpers, run on the CPU through the Triton
interpreter (the numbers are meaningless here; the code paths and the checks are not)."""
from __future__ import annotations

import pytest
import torch

from bench.driver import _events_median, check_megatape, count_kernels, parse_variant
from conftest import clone_cache, perf_counter_ms, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import PRESETS, Tiling
from opcodes.reference import make_kv_cache, make_weights

require_interpreter()


def test_check_and_time_a_small_layer():
    cfg = PRESETS["tiny"]
    w = make_weights(cfg)
    kv = make_kv_cache(cfg, 64, 37)
    kv_before = clone_cache(kv)
    xs = [torch.randn(1, cfg.d).to(torch.bfloat16) for _ in range(3)]
    h = build_layer(w, kv, cfg.to_dict(), 64)
    rep: dict = {}
    check_megatape(cfg, h, w, kv, kv_before, xs, 37, rep, fp32_ref=True)
    assert rep["correct"] and rep["kv_untouched_bitwise"] and len(rep["rel_err_all"]) == 3
    assert rep["rel_err_max"] <= 1.5e-2 and rep["rel_err_vs_fp32_max"] <= 1.5e-2
    # timed on a stand-in clock (1 ms a read): each step between two reads
    with perf_counter_ms() as clock:
        ev, wall, allev = _events_median(layer_step, [(h, xs[i], 37 + i) for i in range(3)], warmup=1)
    assert clock.reads == 2 * 2 * 3
    assert ev == pytest.approx(1000.0) and wall == pytest.approx(1000.0) and allev == pytest.approx([1000.0] * 3)
    assert count_kernels(layer_step, (h, xs[0], 37)) == (0, 1.0, [])      # no CUDA: nothing counted
    teardown(h)


def test_check_flags_a_corrupted_cache_row(monkeypatch):
    """The protocol can fail: a step that also writes a cache row it should not -> not correct."""
    import interp
    cfg = PRESETS["tiny"]
    w = make_weights(cfg)
    kv = make_kv_cache(cfg, 64, 37)
    kv_before = clone_cache(kv)
    real = interp.layer_step

    def corrupting_step(h, x, pos):
        out = real(h, x, pos)
        kv[0][0][0, 0, 5, 0] += 1.0            # a prefix row the step must not touch
        return out

    monkeypatch.setattr(interp, "layer_step", corrupting_step)
    h = build_layer(w, kv, cfg.to_dict(), 64)
    rep: dict = {}
    check_megatape(cfg, h, w, kv, kv_before, [torch.randn(1, cfg.d).to(torch.bfloat16)], 37, rep)
    assert not rep["kv_untouched_bitwise"] and not rep["correct"]
    teardown(h)


def test_parse_variant():
    t, b = parse_variant(PRESETS["llama70b-layer"], "bk=1024, coop=0 ,stages=2")
    assert (t.bk, t.stages, b) == (1024, 2, {"cooperative": False})
    one_b = PRESETS["llama3.2-1b"]
    # build options alone: a concrete default tiling, or None where the build is to keep its own choice
    t, b = parse_variant(one_b, "lm_rows=512,pool=0", max_seq=256)
    assert t == Tiling.for_config(one_b, max_seq=256) and b == {"lm_rows": 512, "pool_us": 0.0}
    assert parse_variant(one_b, "lm_rows=512", max_seq=256, none_if_default=True) == (None, {"lm_rows": 512})
    assert parse_variant(one_b, "", none_if_default=True) == (None, {})
    t, _ = parse_variant(one_b, "lm_rows=512,stages=4", max_seq=256, none_if_default=True)
    assert t.stages == 4
    with pytest.raises(ValueError, match="lm_rows takes a number"):
        parse_variant(one_b, "lm_rows=big")


def test_decoder_bench_accuracy_criterion():
    """bench/decoder_bench.check_steps: the kernel's decode steps (the interpreter) against the bf16
    and the all-fp32 references. A step that is the fp32 reference itself meets the criterion and
    agrees everywhere; one that adds noise of the bf16 reference's size, several times over, fails it."""
    import dataclasses

    from bench.decoder_bench import ACC_RATIO, check_steps
    from conftest import decoder_weights
    from interp import build_decoder, decode_step
    from opcodes.decoder import decoder_ref_fp32
    cfg = dataclasses.replace(PRESETS["small-2layer"], vocab=96)
    w = decoder_weights(cfg, seed=3)
    kv = make_kv_cache(cfg, 16, 4, seed=2)
    toks = torch.tensor([5, 17, 3])
    h = build_decoder(w, clone_cache(kv), cfg.to_dict(), 16)
    try:
        acc = check_steps(lambda tk, p: decode_step(h, tk.to(torch.int32), p), w, clone_cache(kv), cfg, toks, 4)
    finally:
        teardown(h)
    assert acc["steps"] == 3 and len(acc["errs"]) == 3 and acc["criterion"].startswith(f"vs fp32 <= {ACC_RATIO}")
    assert acc["rel_err_vs_fp32_max"] < 2e-2 and acc["bf16_ref_vs_fp32_max"] > 0
    assert acc["criterion_met"] and acc["greedy_agree_decisive"] == acc["decisive_steps"] > 0    # the kernel
    kv32 = [tuple(t.float() for t in p) for p in kv]
    exact = check_steps(lambda tk, p: decoder_ref_fp32(w, kv32, cfg, int(tk[0]), p), w, clone_cache(kv), cfg, toks, 4)
    assert exact["criterion_met"] and exact["rel_err_vs_fp32_max"] == 0.0
    assert exact["greedy_agree_all"] == 3 and exact["greedy_agree_decisive"] == exact["decisive_steps"]
    kv32 = [tuple(t.float() for t in p) for p in kv]
    g = torch.Generator().manual_seed(0)

    def noisy(tk, p):
        lg = decoder_ref_fp32(w, kv32, cfg, int(tk[0]), p)
        return lg + 0.2 * lg.abs().max() * torch.randn(lg.shape, generator=g)

    assert not check_steps(noisy, w, clone_cache(kv), cfg, toks, 4)["criterion_met"]
