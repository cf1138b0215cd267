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


def kernel_span(prof: torch.Tensor, sm_prof: torch.Tensor) -> dict:
    """Where a launch's time goes outside its instructions, in us, from the tape's rows ``prof`` and the
    SMs' rows ``sm_prof`` (``interp.runtime.profile_sm_records``: kernel entry, queue done, exit):
    ``entry_spread`` the first to the last SM's entry; ``to_first`` the first entry to the first
    instruction's wait start; ``instructions`` the first wait start to the last instruction's end;
    ``from_last`` that end to the last SM's exit (the end-of-call bookkeeping among it); ``resident`` the
    first entry to the last exit."""
    p = prof.view(-1, 4).tolist()
    s = sm_prof.view(-1, 4).tolist()
    entry0, entry1 = min(r[0] for r in s), max(r[0] for r in s)
    first, last = min(r[0] for r in p), max(r[2] for r in p)
    exit1 = max(r[2] for r in s)
    us = 1e-3
    return {"entry_spread": (entry1 - entry0) * us, "to_first": (first - entry0) * us,
            "instructions": (last - first) * us, "from_last": (exit1 - last) * us, "resident": (exit1 - entry0) * us}


def format_kernel_span(span: dict, event_us: float | None = None) -> str:
    """One line of :func:`kernel_span`; with the event time of the same build's launches, the part
    outside the kernel's residency (the launch itself)."""
    line = (f"kernel: SMs enter over {span['entry_spread']:.2f} us; first entry to first instruction "
            f"{span['to_first']:.2f} us; instructions {span['instructions']:.1f} us; last instruction's end to "
            f"last exit {span['from_last']:.2f} us; resident {span['resident']:.1f} us")
    if event_us is not None:
        line += f" (events {event_us:.1f} us: {event_us - span['resident']:.1f} us outside)"
    return line
