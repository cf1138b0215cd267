"""Lowering of a whole-model decode step: EMBED -> the layers -> LM_HEAD tiles -> ARGMAX (or SAMPLE).

    EMBED(col0) x n_emb --embed--> QKV(0, *)  (the layers, ``schedule.program.lower``)
    RESIDUAL(L-1, *) --out[L-1]--> LM_HEAD(row0) x n_lm --logits--> ARGMAX(n_lm)
                                   or --logits--> SAMPLE_MASS(c0) x n_chunks --smp_mass--> SAMPLE(n_lm)

ARGMAX is the greedy next token; with ``sample=True`` SAMPLE draws it instead (temperature, top-k,
top-p and seed from its device parameter buffer, ``opcodes.sample``). Either writes the token the
next launch's EMBED reads.

The layers are lowered by :func:`schedule.program.lower` itself (``input_counter``: layer 0's
QKV tiles wait for the embedding; ``signal_last``: the last layer's output gets a counter for the
LM head), so a change of the layer lowering carries over. Use it as ``compile_model(...,
lowering=lower_decoder)`` or ``build_layer(..., lowering=lower_decoder)``; the program's layout is
a :class:`~opcodes.decoder.DecoderLayout` (the decoder's scratch buffers).

Tensor parallel (a :class:`opcodes.tp.TPLayout`, one rank of two; ``compile_model(..., tp=2)``): the
program's layout is the rank's :class:`opcodes.tp.TPDecoderLayout`; EMBED is the same on both ranks
(the embedding is replicated), the layers are the TP layers of :func:`schedule.program.lower`, the
LM_HEAD tiles cover the rank's vocabulary slice (``lm_vocab = vocab / 2`` rows), and ARGMAX becomes

    LM_HEAD(row0) x n_lm --logits--> TP_ARGMAX_PUSH(n_lm) --recv_am (the PEER's counter)-->
    TP_ARGMAX(n_lm) (+ logits)      the token of both ranks (``opcodes/tp_argmax.py``)
"""
from __future__ import annotations

import torch

from opcodes import (Argmax, DecoderLayout, Embed, Layout, LMHead, Sample, SampleMass, TPArgmax, TPArgmaxPush,
                     TPDecoderLayout)
from opcodes.base import NO_COUNTER
from opcodes.sample import chunk_size

from .program import Program, lower


def _final_out_counter(p: Program, lay: Layout) -> int:
    """The counter signalled by the writers of the last layer's output row (exactly one)."""
    d, r = lay.cfg.d, lay.xout_row(lay.cfg.layers - 1)
    lo, hi = r * d, (r + 1) * d
    sigs = {p.signal[i] for i, ins in enumerate(p.instrs)
            if any(r.buf == "xout" and r.lo < hi and r.hi > lo for r in ins.writes(lay))}
    if len(sigs) != 1 or NO_COUNTER in sigs:
        raise RuntimeError(f"lower_decoder: the writers of the last layer's output signal counters {sorted(sigs)}; "
                           "expected exactly one (lower(..., signal_last=True))")
    return sigs.pop()


def lower_decoder(lay: Layout, lm_rows: int = 0, emb_cols: int = 0, sample: bool = False) -> Program:
    """The program of one whole-model decode step for ``lay.cfg`` (which needs ``vocab > 0``).
    ``lm_rows`` / ``emb_cols``: LM head rows and embedding columns per tile (0: defaults);
    ``sample``: end in SAMPLE (a token drawn on the device) instead of ARGMAX (greedy).
    A tensor-parallel rank's layout (``tp_size`` 2) gets the rank's program (module docstring)."""
    tp = getattr(lay, "tp_size", 1) > 1
    if tp and sample:
        raise NotImplementedError("tensor-parallel decoder tapes end in the greedy cross-rank argmax; sampling "
                                  "across vocabulary slices is not built")
    tiles = dict(lm_rows=lm_rows or getattr(lay, "lm_rows", 0), emb_cols=emb_cols or getattr(lay, "emb_cols", 0))
    dl = TPDecoderLayout.of(lay, **tiles) if tp else DecoderLayout.of(lay, **tiles)
    c = dl.cfg
    p = Program(dl)
    ce = p.counter("embed")
    for c0 in range(0, c.d, dl.emb_cols):
        p.add(Embed(c0), (), ce)
    lower(dl, prog=p, input_counter=ce, signal_last=True)
    cout = _final_out_counter(p, dl)
    cl = p.counter("logits")
    for r in range(0, dl.lm_vocab, dl.lm_rows):
        p.add(LMHead(r), (cout,), cl)
    if tp:
        crecv = p.counter("recv_am")
        p.add(TPArgmaxPush(dl.n_lm_tiles), (cl,), crecv)       # signals the PEER's recv_am
        p.add(TPArgmax(dl.n_lm_tiles), (cl, crecv), NO_COUNTER)
    elif sample:
        cm = p.counter("smp_mass")
        for c0 in range(0, c.vocab, chunk_size(dl)):
            p.add(SampleMass(c0, dl.n_lm_tiles), (cl,), cm)
        p.add(Sample(dl.n_lm_tiles), (cm,), NO_COUNTER)
    else:
        p.add(Argmax(dl.n_lm_tiles), (cl,), NO_COUNTER)
    return p


def decoder_lowering(lm_rows: int = 0, emb_cols: int = 0, sample: bool = False):
    """A ``lowering=`` function (Layout -> Program) with these tile sizes (``sample``: SAMPLE
    instead of ARGMAX)."""
    def lowering(lay: Layout) -> Program:
        return lower_decoder(lay, lm_rows=lm_rows, emb_cols=emb_cols, sample=sample)
    lowering.__name__ = f"lower_decoder(lm_rows={lm_rows}, emb_cols={emb_cols}" + (", sample=True)" if sample else ")")
    return lowering


def run_decoder_vm(tape, weights: dict, kv_cache: list, token, pos: int, seed: int | None = 0,
                   sampling: dict | None = None):
    """One whole-model decode step of a decoder ``tape`` on the tape VM (``schedule.vm.run_tape``):
    returns (fp32 logits (1, vocab), the next token as an int: greedy, or drawn by SAMPLE with
    ``sampling`` = dict(temperature=, top_k=, top_p=, seed=) for a tape lowered with ``sample=True``)."""
    from .vm import run_tape
    if getattr(tape.lay, "tp_size", 1) > 1:
        raise ValueError("run_decoder_vm: a tensor-parallel rank's tape; run both ranks with "
                         "schedule.vm.run_tp_decoder")
    if not isinstance(tape.lay, DecoderLayout):
        raise ValueError("run_decoder_vm: the tape was not lowered by lower_decoder (no DecoderLayout)")
    tok = torch.as_tensor(token).reshape(1)
    state = Sample.state_values(**sampling) if sampling is not None else None
    st = run_tape(tape, weights, kv_cache, tok, pos, seed=seed, return_state=True, state=state)
    return st.buf["logits"].reshape(1, -1).clone(), int(st.next_token)
