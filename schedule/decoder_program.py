"""Lowering of a whole-model decode step: EMBED -> the layers -> LM_HEAD tiles -> ARGMAX (or SAMPLE).

    EMBED(col0) x n_emb --embed--> QKV(0, *)  (the layers, ``schedule.program.lower``)
    RESIDUAL(L-1, *) --out[L-1]--> LM_HEAD(row0) x n_lm --logits--> ARGMAX(n_lm) | SAMPLE(n_lm)

ARGMAX is the greedy next token; with ``sample=True`` SAMPLE draws it instead (temperature, top-k,
top-p and seed from its device parameter buffer, ``opcodes.sample``). Either writes the token the
next launch's EMBED reads.

The layers are lowered by :func:`schedule.program.lower` itself (``input_counter``: layer 0's
QKV tiles wait for the embedding; ``signal_last``: the last layer's output gets a counter for the
LM head), so a change of the layer lowering carries over. Use it as ``compile_model(...,
lowering=lower_decoder)`` or ``build_layer(..., lowering=lower_decoder)``; the program's layout is
a :class:`~opcodes.decoder.DecoderLayout` (the decoder's scratch buffers).
"""
from __future__ import annotations

import torch

from opcodes import Argmax, DecoderLayout, Embed, Layout, LMHead, Sample
from opcodes.base import NO_COUNTER

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
    ``sample``: end in SAMPLE (a token drawn on the device) instead of ARGMAX (greedy)."""
    dl = DecoderLayout.of(lay, lm_rows=lm_rows or getattr(lay, "lm_rows", 0),
                          emb_cols=emb_cols or getattr(lay, "emb_cols", 0))
    c = dl.cfg
    p = Program(dl)
    ce = p.counter("embed")
    for c0 in range(0, c.d, dl.emb_cols):
        p.add(Embed(c0), (), ce)
    lower(dl, prog=p, input_counter=ce, signal_last=True)
    cout = _final_out_counter(p, dl)
    cl = p.counter("logits")
    for r in range(0, c.vocab, dl.lm_rows):
        p.add(LMHead(r), (cout,), cl)
    p.add((Sample if sample else Argmax)(dl.n_lm_tiles), (cl,), NO_COUNTER)
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
    if not isinstance(tape.lay, DecoderLayout):
        raise ValueError("run_decoder_vm: the tape was not lowered by lower_decoder (no DecoderLayout)")
    tok = torch.as_tensor(token).reshape(1)
    state = Sample.state_values(**sampling) if sampling is not None else None
    st = run_tape(tape, weights, kv_cache, tok, pos, seed=seed, return_state=True, state=state)
    return st.buf["logits"].reshape(1, -1).clone(), int(st.next_token)
