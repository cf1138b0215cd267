"""The registry is the only owner of opcode knowledge: an opcode defined here, in the test, runs
through the verifier, the tape VM and the interpreter kernel without any other file changing.

The toy opcode SCALE_COPY copies one row block of a layer's ``x1`` (the residual stream after
attention), multiplied by its own constexpr ``TOY_SCALE`` and by its own table ``toy_gain`` (a
pointer only it declares), into its own scratch buffer ``toy``. A lowering appends its tiles
after each layer's O projection; the kernel for the tape gets its branch, pointers and constexpr
from the class alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import triton
import triton.language as tl

from interp import build_layer, layer_step, teardown
from opcodes import (BY_OPCODE, REGISTRY, Cost, Instruction, Layout, ModelConfig, Region, Tiling, Timing,
                     register, unregister)
from opcodes.base import tile_start
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err
from schedule import compile_model, verify
from schedule.program import lower
from schedule.vm import run_tape

TOY_ROWS = 16


@triton.jit
def scale_copy_device(layer, row0, x1_ptr, toy_ptr, toy_gain_ptr, D: tl.constexpr, TOY_SCALE: tl.constexpr,
                      TOY_ROWS: tl.constexpr):
    rows = row0 + tl.arange(0, TOY_ROWS)
    rm = rows < D
    x = tl.load(x1_ptr + layer * D + rows, mask=rm, other=0.0, cache_modifier=".cg")
    g = tl.load(toy_gain_ptr + rows, mask=rm, other=0.0)
    tl.store(toy_ptr + layer * D + rows, x * TOY_SCALE * g, mask=rm)


@dataclass(frozen=True)
class ScaleCopy(Instruction):
    layer: int
    row0: int

    NAME = "scale_copy"
    STAGE = 4
    ARGS = ("x1_ptr", "toy_ptr", "toy_gain_ptr", "D", "TOY_SCALE", "TOY_ROWS")
    CONSTEXPRS = {"TOY_SCALE": lambda lay: 0.75, "TOY_ROWS": lambda lay: TOY_ROWS}
    SCRATCH = {"toy": "fp32"}
    TABLES = {"toy_gain_ptr": "fp32"}
    TIMING = Timing.FIXED
    device = scale_copy_device

    @classmethod
    def scratch_shapes(cls, lay):
        return {"toy": (lay.cfg.layers, lay.cfg.d)}

    @classmethod
    def tables(cls, lay, device):
        return {"toy_gain_ptr": gain(lay.cfg.d).to(device)}

    def check_operands(self, lay):
        return tile_start("row0", self.row0, TOY_ROWS, lay.cfg.d)

    def reads(self, lay):
        base = self.layer * lay.cfg.d
        return [Region("x1", base + self.row0, base + min(self.row0 + TOY_ROWS, lay.cfg.d))]

    def writes(self, lay):
        base = self.layer * lay.cfg.d
        return [Region("toy", base + self.row0, base + min(self.row0 + TOY_ROWS, lay.cfg.d))]

    def cost(self, lay):
        n = min(TOY_ROWS, lay.cfg.d - self.row0)
        return Cost(hbm_bytes=0, l2_bytes=12 * n, flops=2 * n)

    def run_torch(self, lay, st):
        d = lay.cfg.d
        lo, hi = self.row0, min(self.row0 + TOY_ROWS, d)
        x1 = st.buf["x1"].view(lay.cfg.layers, d)[self.layer, lo:hi]
        st.buf["toy"].view(lay.cfg.layers, d)[self.layer, lo:hi] = x1 * 0.75 * st.tables["toy_gain_ptr"][lo:hi]


def gain(d: int) -> torch.Tensor:
    return torch.linspace(0.5, 1.5, d, dtype=torch.float32)


def lower_with_toy(lay: Layout):
    """The layers, plus SCALE_COPY tiles that wait for each layer's x1 and signal their own counter."""
    p = lower(lay)
    for l in range(lay.cfg.layers):
        cx = p.counters.index(f"x1[{l}]")
        ct = p.counter(f"toy[{l}]")
        for r in range(0, lay.cfg.d, TOY_ROWS):
            p.add(ScaleCopy(l, r), (cx,), ct)
    return p


@pytest.fixture
def toy_opcode():
    register(ScaleCopy)
    try:
        yield ScaleCopy
    finally:
        unregister(ScaleCopy)


CFG = ModelConfig(layers=2, d=80, ffn=96, n_q=4, n_kv=2, hd=16, theta=10000.0, name="toy-host")
MAX_SEQ, POS = 32, 19


def test_a_test_defined_opcode_runs_through_verifier_vm_and_kernel(toy_opcode):
    assert REGISTRY["scale_copy"] is ScaleCopy and BY_OPCODE[ScaleCopy.OPCODE] is ScaleCopy
    tape = compile_model(CFG, 3, max_seq=MAX_SEQ, lowering=lower_with_toy).tape      # for the VM
    assert ScaleCopy in tape.classes() and tape.buffers()["toy"] == ((2, 80), "fp32")
    verify(tape)
    weights = make_weights(CFG)
    x = (torch.randn(1, CFG.d, generator=torch.Generator().manual_seed(7))).to(torch.bfloat16)
    ref = model_ref(weights, make_kv_cache(CFG, MAX_SEQ, POS), CFG, x, POS)
    # the tape VM: the layers still match the reference, and toy = 0.75 * gain * x1
    st = run_tape(tape, weights, make_kv_cache(CFG, MAX_SEQ, POS), x, POS, seed=3, return_state=True)
    assert rel_err(st.output(), ref) <= 1.5e-2
    want = st.buf["x1"].view(2, 80) * 0.75 * gain(80)
    assert torch.equal(st.buf["toy"].view(2, 80), want)
    # the interpreter kernel: its branch, pointer, constexpr and table come from the class alone
    kv = make_kv_cache(CFG, MAX_SEQ, POS)
    # one SM: the Triton interpreter runs the programs one after another
    h = build_layer(weights, kv, CFG.to_dict(), MAX_SEQ, tape=compile_model(
        CFG, 1, max_seq=MAX_SEQ, lowering=lower_with_toy, sequential=True).tape)
    try:
        out = layer_step(h, x, POS)
        assert rel_err(out, ref) <= 1.5e-2
        x1 = h.scratch["x1"].view(2, 80)
        assert torch.equal(h.scratch["toy"].view(2, 80), x1 * 0.75 * gain(80))
        assert rel_err(h.scratch["toy"].view(2, 80), want) <= 1.5e-2     # kernel and VM round alike
        assert "toy_gain_ptr" in h.buffers
    finally:
        teardown(h)


def test_the_verifier_sees_a_toy_tile_missing(toy_opcode):
    """The toy's scratch buffer is checked like any other: drop one tile and the verifier names it."""
    from schedule.verify import TapeError

    def lowering(lay):
        p = lower_with_toy(lay)
        k = max(i for i, ins in enumerate(p.instrs) if isinstance(ins, ScaleCopy))
        del p.instrs[k], p.waits[k], p.signal[k]
        return p

    with pytest.raises(TapeError, match=r"toy\[\d+:\d+\] is never written"):
        compile_model(CFG, 3, max_seq=MAX_SEQ, lowering=lowering)


def test_registration_is_checked():
    class NoDevice(Instruction):
        NAME = "no_device"

    with pytest.raises(TypeError, match="no device function"):
        register(dataclass(frozen=True)(NoDevice))

    @dataclass(frozen=True)
    class BadTiming(Instruction):
        NAME = "bad_timing"
        TIMING = "sometimes"
        device = scale_copy_device

    with pytest.raises(TypeError, match="TIMING"):
        register(BadTiming)
    with pytest.raises(ValueError, match="not the last registered"):
        unregister(REGISTRY["qkv"])


def test_an_undeclared_pointer_is_named():
    """A device function that takes a pointer nobody declares fails at kernel generation, naming it."""
    from opcodes import kernel_pointers
    lay = Layout(CFG, Tiling.for_config(CFG), MAX_SEQ)

    @dataclass(frozen=True)
    class Stray(Instruction):
        row0: int
        NAME = "stray"
        ARGS = ("nowhere_ptr",)
        device = scale_copy_device

    register(Stray)
    try:
        with pytest.raises(TypeError, match="nowhere_ptr"):
            kernel_pointers(lay)
    finally:
        unregister(Stray)
