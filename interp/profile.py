"""The kernel's profile buffer, read.

A handle built with ``profile=True`` (GPU only: globaltimer is inline PTX) records, per tape slot,
``[wait start, exec start, end, sm]`` in ns (``interp.runtime.profile_records(h)``). :func:`records`
turns that buffer into one tuple per instruction; the summaries, traces and charts of a measured
timeline are views, in :mod:`megatape.views.profile` and :mod:`megatape.views.measured`.
"""
from __future__ import annotations

import torch

from opcodes import BY_OPCODE

from schedule.tape import Tape


def records(tape: Tape, prof: torch.Tensor) -> list[tuple]:
    """[(slot, program index, opcode name, sm, wait_start_ns, exec_start_ns, end_ns)] relative to
    the earliest timestamp of the launch."""
    p = prof.view(-1, 4).tolist()
    t0 = min(r[0] for r in p[: len(tape)])
    out = []
    for slot in range(len(tape)):
        tw, te, tend, sm = p[slot]
        op = BY_OPCODE[int(tape.words[slot, 0])]
        pi = tape.prog_index[slot] if tape.prog_index else slot
        out.append((slot, pi, op.NAME, int(sm), tw - t0, te - t0, tend - t0))
    return out


def instruction_rows(tape: Tape, recs: list[tuple]) -> list[list]:
    """Every instruction's record as a JSON-ready row, for offline critical-path analysis (what the
    benches' ``--profile`` write to ``*records*.json.gz``): ``[slot, opcode name, layer (-1: none),
    sm, wait start, exec start, end, instruction]`` (ns from :func:`records`; the instruction as
    text, e.g. ``qkv layer=40 sec=2 head=1 j=2``, so the file is read without the tape)."""
    rows = []
    for slot, _, name, sm, tw, te, tend in recs:
        ins = BY_OPCODE[int(tape.words[slot, 0])].decode(tape.words[slot, 6:].tolist())
        rows.append([int(slot), name, int(getattr(ins, "layer", -1)), int(sm), int(tw), int(te), int(tend), str(ins)])
    return rows
