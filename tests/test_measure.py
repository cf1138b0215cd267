"""megatape.measure: what ``megatape run`` measures on a GPU, run on the CPU through the Triton
interpreter (the timings mean nothing here; the code paths, the report and the check do)."""
from __future__ import annotations

import pytest

from conftest import require_interpreter
from megatape import measure
from opcodes import PRESETS

require_interpreter()


def test_cache_rows():
    assert measure.cache_rows(4096, 32) == 4224                 # the 70B layer's run
    assert measure.cache_rows(1024, 32) == 1152
    assert measure.cache_rows(0, 64) == 128 and measure.cache_rows(0, 65) == 256


def test_measure_layer_on_the_cpu():
    cfg = PRESETS["tiny"]
    r = measure.measure_layer(cfg, prefill=37, steps=2, max_seq=64, device="cpu", copy_bytes=1 << 20)
    assert r["correct"] and r["kv_untouched_bitwise"] and len(r["rel_err_all"]) == 2
    assert r["rel_err_max"] <= measure.TOL and r["kv_rows_rel_err"] <= measure.TOL
    assert r["bytes_per_step"] == cfg.spec_bytes_per_step(37, 2) and r["stream_copy_Bps"] > 0
    assert r["floor_us"] == pytest.approx(r["bytes_per_step"] / r["stream_copy_Bps"] * 1e6)
    assert r["us_event"] > 0 and r["us_wall"] > 0 and r["x_floor"] == pytest.approx(r["us_event"] / r["floor_us"])
    assert r["instructions"] > 0 and r["num_sms"] >= 1 and (r["device"], r["max_seq"]) == ("cpu", 64)


def test_measure_layer_reports_a_wrong_step(monkeypatch):
    """The check can fail: a step whose output is off -> correct is False."""
    import interp
    real = interp.layer_step
    monkeypatch.setattr(interp, "layer_step", lambda h, x, pos: real(h, x, pos) * 1.1)
    r = measure.measure_layer(PRESETS["tiny"], prefill=37, steps=1, max_seq=64, device="cpu", copy_bytes=1 << 20)
    assert not r["correct"] and r["rel_err_max"] > measure.TOL


def test_measure_layer_refuses_positions_past_the_cache():
    with pytest.raises(ValueError, match="do not fit a cache of 64 rows"):
        measure.measure_layer(PRESETS["tiny"], prefill=60, steps=8, max_seq=64, device="cpu")


def test_stream_copy_and_time_step_on_the_cpu():
    assert measure.stream_copy_bandwidth("cpu", nbytes=1 << 20, iters=3) > 0
    calls = []
    r = measure.time_step(lambda x: calls.append(x), [(1,), (2,)], warmup=1, device="cpu")
    assert calls == [1, 1, 2, 1, 2] and len(r["all_event"]) == len(r["all_wall"]) == 2
    with pytest.raises(ValueError, match="at least one"):
        measure.time_step(lambda: None, [])
