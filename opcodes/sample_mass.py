"""SAMPLE_MASS: one chunk's sum of SAMPLE's integer weights (and, with a top-k or top-p threshold,
its largest logits), so the weighing pass runs on every SM.

    m           = the largest logit (the LM_HEAD tiles' partials, as SAMPLE reads them)
    smp_mass[c] = sum of w(l_i) over i in [c0, c0 + SMP_CHUNK) with l_i >= "none"     (int64, exact)
                  0 where the chunk's block is one SAMPLE skips (its partials' maximum below "none")
    candidates  = the chunk's SMP_CANDS largest logits, descending (fp32 bits), and their weights;
                  -inf / 0 where the block is skipped, +inf where the chunk holds a NaN or a logit
                  above its block's partials' maximum (SAMPLE then searches the whole vocabulary)

with ``w`` SAMPLE's exact integer weights for the temperature in ``smp`` (``opcodes/sample.py``; the
layout of ``smp_mass``: ``mass_words``). A sampling decoder tape has one instruction per chunk after
the LM head (``cdiv(vocab, SMP_CHUNK)``: 126 for a 128k vocabulary, one an SM), all signalling one
counter that SAMPLE waits on; SAMPLE then needs no pass of its own over the vocabulary where no
threshold applies, and none where the candidates decide the thresholds (its docstring). Each reads
``4 * SMP_CHUNK`` bytes of logits and the ``8 * nparts`` of the partials from L2 (the chunk twice
with a threshold: the candidates' extraction reads it again).

Registered after the tensor-parallel opcodes, so the opcode numbers of the kernels measured
before it are unchanged; like SAMPLE it is only in the kernels of sampling tapes.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, Timing, register
from .sample import (SMP_MAX_SUB, SMP_NONE, SMP_TABLE, Sample, _smp_block_maxima, _smp_chunk_cands,
                     _smp_chunk_mass, _smp_pick, _smp_thresholded, chunk_cands_torch, chunk_mass_torch, chunk_size,
                     f32_words, mass_words, n_cands, n_chunks, wants_cands)


@triton.jit
def sample_mass_device(c0, nparts, logits_ptr, amax_ptr, smp_ptr, smp_mass_ptr, VOCAB: tl.constexpr,
                       LM_ROWS: tl.constexpr, SMP_BLOCK: tl.constexpr, SMP_CHUNK: tl.constexpr,
                       SMP_CANDS: tl.constexpr):
    SUB: tl.constexpr = SMP_MAX_SUB if SMP_CHUNK > SMP_MAX_SUB else SMP_CHUNK
    scale = tl.load(smp_ptr + SMP_TABLE).to(tl.int32).to(tl.float32, bitcast=True)
    top_k = tl.load(smp_ptr + SMP_TABLE + 2).to(tl.int32)
    top_pq = tl.load(smp_ptr + SMP_TABLE + 4)
    bmv = _smp_block_maxima(nparts, amax_ptr, VOCAB, LM_ROWS, SMP_BLOCK)
    m = tl.max(bmv, axis=0)
    # the chunk is read whatever its block's maximum, so its loads need not wait for the partials'
    mass = _smp_chunk_mass(c0, m, scale, logits_ptr, smp_ptr, VOCAB, SMP_CHUNK, SUB)
    bm = _smp_pick(bmv, c0 // SMP_BLOCK)
    c = c0 // SMP_CHUNK
    tl.store(smp_mass_ptr + c, tl.where(bm >= SMP_NONE, mass, 0))
    if _smp_thresholded(top_k, top_pq, VOCAB):      # SAMPLE's candidate path
        top, w = _smp_chunk_cands(c0, bm, m, scale, logits_ptr, smp_ptr, VOCAB, SMP_CHUNK, SUB, SMP_CANDS)
        NCH: tl.constexpr = (VOCAB + SMP_CHUNK - 1) // SMP_CHUNK
        k = NCH + c * SMP_CANDS + tl.arange(0, SMP_CANDS)
        tl.store(smp_mass_ptr + k, top.to(tl.int32, bitcast=True).to(tl.int64))
        tl.store(smp_mass_ptr + NCH * SMP_CANDS + k, w)


@register
@dataclass(frozen=True)
class SampleMass(Instruction):
    c0: int          # the chunk's first logit (a multiple of SMP_CHUNK)
    nparts: int      # LM_HEAD partials (= DecoderLayout.n_lm_tiles), as SAMPLE's

    NAME = "sample_mass"
    STAGE = 8
    ARGS = ("logits_ptr", "amax_ptr", "smp_ptr", "smp_mass_ptr", "VOCAB", "LM_ROWS", "SMP_BLOCK", "SMP_CHUNK",
            "SMP_CANDS")
    TIMING = Timing.FIXED
    IN_EVERY_KERNEL = False
    WHOLE_MODEL = True
    device = sample_mass_device
    # a chunk's int64 weight sum and its candidates; SAMPLE's path (opcodes.sample.mass_words)
    SCRATCH = {"smp_mass": "i64"}

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"smp_mass": (mass_words(lay),)}

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
        c, nch, k = self.c0 // chunk_size(lay), n_chunks(lay), n_cands(lay)
        return [Region("smp_mass", c, c + 1), Region("smp_mass", nch + c * k, nch + (c + 1) * k),
                Region("smp_mass", nch * (1 + k) + c * k, nch * (1 + k) + (c + 1) * k)]

    def cost(self, lay: Layout) -> Cost:
        ch = chunk_size(lay)
        return Cost(hbm_bytes=0, l2_bytes=4 * ch + 8 * self.nparts + 8 * (1 + n_cands(lay)), flops=40 * ch)

    def run_torch(self, lay: Layout, st) -> None:
        params = getattr(st, "state", None) or {}
        if "smp" not in params:
            raise ValueError("sample_mass: the VM needs the sampling parameters: run_tape(..., state="
                             "Sample.state_values(temperature, top_k, top_p, seed))")
        ch, nch, k = chunk_size(lay), n_chunks(lay), n_cands(lay)
        c = self.c0 // ch
        args = (st.buf["logits"], st.buf["amax"], self.nparts, lay.lm_rows, Sample.CONSTEXPRS["SMP_BLOCK"](lay), ch)
        st.buf["smp_mass"][c] = chunk_mass_torch(*args, params["smp"], self.c0)
        if wants_cands(params["smp"], lay.cfg.vocab):
            v, w = chunk_cands_torch(*args, k, params["smp"], self.c0)
            st.buf["smp_mass"][nch + c * k:nch + (c + 1) * k] = f32_words(v)
            st.buf["smp_mass"][nch * (1 + k) + c * k:nch * (1 + k) + (c + 1) * k] = w
