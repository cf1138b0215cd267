"""SAMPLE_MASS: one chunk's sum of SAMPLE's integer weights, so the weighing pass runs on every SM.

    m           = the largest logit (the LM_HEAD tiles' partials, as SAMPLE reads them)
    smp_mass[c] = sum of w(l_i) over i in [c0, c0 + SMP_CHUNK) with l_i >= "none"     (int64, exact)
                  0 where the chunk's block is one SAMPLE skips (its partials' maximum below "none")

with ``w`` SAMPLE's exact integer weights for the temperature in ``smp`` (``opcodes/sample.py``).
A sampling decoder tape has one instruction per chunk after the LM head (``cdiv(vocab, SMP_CHUNK)``:
126 for a 128k vocabulary, one an SM), all signalling one counter that SAMPLE waits on; SAMPLE
then needs no pass of its own over the vocabulary where no top-k threshold applies (its docstring).
Each reads ``4 * SMP_CHUNK`` bytes of logits and the ``8 * nparts`` of the partials from L2.

Registered after the tensor-parallel opcodes, so the opcode numbers of the kernels measured
before it are unchanged; like SAMPLE it is only in the kernels of sampling tapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, register
from .sample import (SMP_MAX_SUB, SMP_NONE, SMP_TABLE, Sample, _smp_block_maxima, _smp_chunk_mass, _smp_pick,
                     chunk_mass_torch, chunk_size, n_chunks)


@triton.jit
def sample_mass_device(c0, nparts, logits_ptr, amax_ptr, smp_ptr, smp_mass_ptr, VOCAB: tl.constexpr,
                       LM_ROWS: tl.constexpr, SMP_BLOCK: tl.constexpr, SMP_CHUNK: tl.constexpr):
    SUB: tl.constexpr = SMP_MAX_SUB if SMP_CHUNK > SMP_MAX_SUB else SMP_CHUNK
    scale = tl.load(smp_ptr + SMP_TABLE).to(tl.int32).to(tl.float32, bitcast=True)
    bmv = _smp_block_maxima(nparts, amax_ptr, VOCAB, LM_ROWS, SMP_BLOCK)
    m = tl.max(bmv, axis=0)
    # the chunk is read whatever its block's maximum, so its loads need not wait for the partials'
    mass = _smp_chunk_mass(c0, m, scale, logits_ptr, smp_ptr, VOCAB, SMP_CHUNK, SUB)
    keep = _smp_pick(bmv, c0 // SMP_BLOCK) >= SMP_NONE
    tl.store(smp_mass_ptr + c0 // SMP_CHUNK, tl.where(keep, mass, 0))


@register
@dataclass(frozen=True)
class SampleMass(Instruction):
    c0: int          # the chunk's first logit (a multiple of SMP_CHUNK)
    nparts: int      # LM_HEAD partials (= DecoderLayout.n_lm_tiles), as SAMPLE's

    NAME = "sample_mass"
    STAGE = 8
    ARGS = ("logits_ptr", "amax_ptr", "smp_ptr", "smp_mass_ptr", "VOCAB", "LM_ROWS", "SMP_BLOCK", "SMP_CHUNK")
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    WHOLE_MODEL = True
    device = sample_mass_device
    # one int64 weight sum a chunk
    SCRATCH = {"smp_mass": "i64"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"smp_mass": (n_chunks(lay),)}

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return ["sample_mass needs a DecoderLayout (opcodes.decoder)"]
        ch, v = chunk_size(lay), lay.cfg.vocab
        out = []
        if self.c0 % ch or not 0 <= self.c0 < v:
            out.append(f"c0 {self.c0} is not a chunk start (a multiple of SMP_CHUNK {ch} in [0, {v}))")
        if self.nparts != lay.n_lm_tiles:
            out.append(f"nparts {self.nparts} is not the number of LM head tiles ({lay.n_lm_tiles})")
        return out

    def reads(self, lay: Layout) -> list[Region]:
        ch = chunk_size(lay)
        return [Region("logits", self.c0, min(self.c0 + ch, lay.cfg.vocab)), Region("amax", 0, 2 * self.nparts)]

    def writes(self, lay: Layout) -> list[Region]:
        c = self.c0 // chunk_size(lay)
        return [Region("smp_mass", c, c + 1)]

    def cost(self, lay: Layout) -> Cost:
        ch = chunk_size(lay)
        return Cost(hbm_bytes=0, l2_bytes=4 * ch + 8 * self.nparts + 8, flops=30 * ch)

    def run_torch(self, lay: Layout, st) -> None:
        params = getattr(st, "state", None) or {}
        if "smp" not in params:
            raise ValueError("sample_mass: the VM needs the sampling parameters: run_tape(..., state="
                             "Sample.state_values(temperature, top_k, top_p, seed))")
        ch = chunk_size(lay)
        st.buf["smp_mass"][self.c0 // ch] = chunk_mass_torch(
            st.buf["logits"], st.buf["amax"], self.nparts, lay.lm_rows, Sample.CONSTEXPRS["SMP_BLOCK"](lay), ch,
            params["smp"], self.c0)
