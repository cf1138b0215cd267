"""Per-opcode streaming widths (``Tiling.o_bk``, ``Tiling.down_bk``): O and down tiles stream their
own number of columns per pipeline stage, so a tile of twice the rows keeps the bytes per stage.
Only the fp32 summation order changes: the kernel stays within rounding of the tape VM."""
from __future__ import annotations

import pytest

from conftest import clone_cache, rand_x, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.base import Layout
from opcodes.down import Down
from opcodes.oproj import OProj
from opcodes.reference import make_kv_cache, make_weights, rel_err
from schedule import compile_model
from schedule.fluid import FluidModel
from schedule.vm import run_tape

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")        # d 128, q_dim 128: bk 128


@pytest.mark.parametrize("over", [{"o_rows": 64, "o_bk": 32}, {"o_rows": 64, "o_bk": 32, "key_in_reduce": 1}])
def test_kernel_with_own_width_matches_the_vm(over):
    w = make_weights(CFG, seed=7)
    x = rand_x(CFG.d, 8)
    kv0 = make_kv_cache(CFG, 64, 21)
    t = Tiling.for_config(CFG, **over)
    kv = clone_cache(kv0)
    h = build_layer(w, kv, CFG.to_dict(), 64, tiling=t)
    y = layer_step(h, x, 21).clone()
    teardown(h)
    kv_ref = clone_cache(kv0)
    ref = run_tape(compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0).tape, w, kv_ref, x, 21)
    assert rel_err(y, ref) <= 1e-2
    for l in range(CFG.layers):
        for j in (0, 1):
            assert rel_err(kv[l][j][:, :, 21], kv_ref[l][j][:, :, 21]) <= 1e-2


def test_widths_reach_the_kernel_and_the_model():
    t = Tiling.for_config(CFG, o_rows=64, o_bk=32)
    lay = Layout(CFG, t, 64)
    assert OProj.CONSTEXPRS["O_BK"](lay) == 32
    base = Layout(CFG, Tiling.for_config(CFG, o_rows=32), 64)      # 32 rows (d <= 2048 defaults to 16)
    assert OProj.CONSTEXPRS["O_BK"](base) == base.tiling.bk
    # the H200 model's per-SM cap follows rows x width: 64 x 32 is half the bytes of 32 x 128 per stage
    m, m0 = FluidModel.h200(lay), FluidModel.h200(base)
    assert m.cap[OProj] < m0.cap[OProj]
    assert m.cap[OProj] == pytest.approx(FluidModel.sm_cap(64 * 32 * 2 * (t.stages - 1)))


def test_bad_widths_are_named():
    with pytest.raises(ValueError, match="o_bk must be a power of two"):
        Tiling(o_bk=96)
    with pytest.raises(ValueError, match="down_bk must be 0"):
        Tiling(down_bk=8)


@pytest.mark.parametrize("over", [{"down_rows": 64, "down_bk": 32}])
def test_down_width_matches_the_vm(over):
    w = make_weights(CFG, seed=9)
    x = rand_x(CFG.d, 10)
    kv0 = make_kv_cache(CFG, 64, 13)
    t = Tiling.for_config(CFG, **over)
    h = build_layer(w, clone_cache(kv0), CFG.to_dict(), 64, tiling=t)
    y = layer_step(h, x, 13).clone()
    teardown(h)
    ref = run_tape(compile_model(CFG, 5, max_seq=64, tiling=t, pool_us=0).tape, w, clone_cache(kv0), x, 13)
    assert rel_err(y, ref) <= 1e-2
    lay = Layout(CFG, t, 64)
    assert Down.stream_width(lay) == 32 != Layout(CFG, Tiling.for_config(CFG), 64).tiling.bk
