"""Placing L2 prefetches: the SMs a layer's QKV stage leaves idle ask the L2 for weights read after it.

In the small-model decoder a layer's QKV stage is 96 tiles of 128 KB on 132 SMs: each tile streams at
what one SM keeps in flight, so the stage uses about half the HBM for ~6 us, and 36 SMs (8 of them the
attention's) wait for the O stage. With ``Tiling.wo_l2`` each SM of a layer with neither a QKV tile nor
an attention instruction of it gets L2_PREFETCH instructions just before its first instruction of the
layer, waiting as the layer's QKV tiles wait (so they start with QKV, not during the previous layer's
down stragglers): between them those SMs ask for the layer's whole Wo, which O then reads from the L2.
``Tiling.gu_l2`` = N adds the first N bytes of gate and of up of each of the layer's GATE_UP tiles.
Prefetches neither signal nor change a buffer: the verifier's dataflow is unchanged
(bench/NOTES.md v138; v133 placed GATE_UP's on every O SM's path during the attention and lost).
"""
from __future__ import annotations

import dataclasses

from opcodes import AttnPartial, GateUp, L2Prefetch, QKV
from opcodes.l2_prefetch import COPY_BYTES

from .assign import Schedule


def _cut(key: str, numel: int, parts: int) -> list[tuple[str, int, int]]:
    """A layer tensor of ``numel`` bf16 elements as ``parts`` spans of equal whole-copy bytes that cover
    it (the last ones moved back to end at its end: an overlap asks for a few bytes twice)."""
    total = 2 * numel
    nbytes = -(-total // parts // COPY_BYTES) * COPY_BYTES
    out = []
    for k in range(parts):
        start = min(k * nbytes, total - nbytes)
        out.append((key, start // 2, nbytes))
    return out


def with_l2_prefetch(sched: Schedule) -> Schedule:
    """``sched`` with the L2 prefetches of ``Tiling.wo_l2`` / ``Tiling.gu_l2`` (the schedule itself where
    both are 0). They are added to the program and take the predicted start of the instruction they
    precede."""
    prog = sched.prog
    lay = prog.lay
    t = lay.tiling
    if not (t.wo_l2 or t.gu_l2):
        return sched
    c = lay.cfg
    layers: dict[int, dict] = {}
    for sm, q in enumerate(sched.queues):
        for k, i in enumerate(q):
            ins = prog.instrs[i]
            l = getattr(ins, "layer", None)
            if l is None:
                continue
            e = layers.setdefault(l, {"busy": set(), "first": {}, "waits": None, "gu": []})
            if isinstance(ins, (QKV, AttnPartial)):
                e["busy"].add(sm)
            if isinstance(ins, QKV) and e["waits"] is None:
                e["waits"] = prog.waits[i]
            if isinstance(ins, GateUp):
                e["gu"].append(ins)
            e["first"].setdefault(sm, k)
    before: dict[tuple[int, int], list[int]] = {}       # (sm, queue position) -> prefetches
    for l, e in sorted(layers.items()):
        idle = sorted(sm for sm in e["first"] if sm not in e["busy"])
        if not idle or e["waits"] is None:
            continue
        spans = _cut("o", c.d * c.q_dim, 2 * len(idle)) if t.wo_l2 else []
        if t.gu_l2:
            for g in sorted(e["gu"], key=lambda g: g.row0):
                for key, off, n in g.weight_spans(lay):
                    n = min(n, t.gu_l2) // COPY_BYTES * COPY_BYTES
                    if n:
                        spans.append((key, off, n))
        # pairs of spans of one size make an instruction; each idle SM takes its share in turn
        pairs = [spans[k:k + 2] for k in range(0, len(spans) - 1, 2)]
        if len(spans) % 2:
            pairs.append([spans[-1], spans[-1]])
        for k, (a, b) in enumerate(pairs):
            sm = idle[k % len(idle)]
            j = prog.add(L2Prefetch.of_spans(l, [a, b], min(a[2], b[2])), waits=e["waits"])
            before.setdefault((sm, e["first"][sm]), []).append(j)
    start = finish = None
    if sched.start is not None:
        start = list(sched.start) + [0.0] * (len(prog) - len(sched.start))
        finish = list(sched.finish) + [0.0] * (len(prog) - len(sched.finish))
    queues = []
    for sm, q in enumerate(sched.queues):
        out = []
        for k, i in enumerate(q):
            for j in before.get((sm, k), ()):
                out.append(j)
                if start is not None:
                    start[j] = finish[j] = start[i]
            out.append(i)
        queues.append(out)
    return dataclasses.replace(sched, queues=queues, start=start, finish=finish)
