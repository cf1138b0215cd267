"""Placing L2 prefetches: an SM asks the L2 for its next GATE_UP tile's first weights while it waits.

In the small-model decoder the attention leaves the HBM idle for ~4 us a layer: 8 SMs attend while
the others wait on the attention's counter before their O tile, and O then streams only ~8 MB. With
``Tiling.gu_l2`` = N each SM whose queue runs an O tile and then a GATE_UP tile gets an L2_PREFETCH
of that GATE_UP tile's first N bytes of gate and of up just before the O tile (after its QKV tile,
before the O tile's wait): the bytes come while nothing else streams, and the GATE_UP tile reads
them from the L2 (bench/NOTES.md v133).
"""
from __future__ import annotations

import dataclasses

from opcodes import GateUp, L2Prefetch, OProj

from .assign import Schedule


def with_l2_prefetch(sched: Schedule) -> Schedule:
    """``sched`` with an L2_PREFETCH before each O tile that its SM follows with a GATE_UP tile
    (``Tiling.gu_l2`` bytes of each of the tile's spans; the schedule itself where it is 0). The
    prefetches are added to the program (no waits, no signal, no buffer: the verifier's dataflow is
    unchanged) and take the predicted times of the O tile they precede."""
    prog = sched.prog
    nbytes = prog.lay.tiling.gu_l2
    if not nbytes:
        return sched
    start = list(sched.start) if sched.start is not None else None
    finish = list(sched.finish) if sched.finish is not None else None
    queues = []
    for q in sched.queues:
        out = []
        for k, i in enumerate(q):
            nxt = q[k + 1] if k + 1 < len(q) else None
            if nxt is not None and isinstance(prog.instrs[i], OProj) and isinstance(prog.instrs[nxt], GateUp):
                g = prog.instrs[nxt]
                j = prog.add(L2Prefetch.of_spans(g.layer, g.weight_spans(prog.lay), nbytes))
                out.append(j)
                if start is not None:
                    start.append(start[i])
                    finish.append(start[i])
            out.append(i)
        queues.append(out)
    return dataclasses.replace(sched, queues=queues, start=start, finish=finish)
