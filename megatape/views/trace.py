"""Timelines of a tape as Chrome / Perfetto traces (Trace Event Format), planned or measured.

A timeline is a list of *records*, one per instruction::

    (program_index, sm, start_s, end_s, wait_start_s or None)

``start_s`` / ``end_s`` bound the instruction's execution (seconds from any origin);
``wait_start_s``, when given, is when its SM began waiting on the instruction's counters (so the
wait lasted ``start_s - wait_start_s``). :func:`planned_records` derives them from a simulated
:class:`~schedule.assign.Schedule` (the wait is the idle gap before an instruction whose counters
were not complete when its SM became free); a profiling run of the kernel produces the same
records from GPU timestamps, so every view here works for the plan and for a measurement alike.

:func:`to_trace_events` writes one track per SM (``pid`` 0, ``tid`` = SM, named ``"SM 17"``),
one complete (``ph: "X"``) slice per instruction, named by its opcode, with its operands, the
counters it waited on (and their targets), the counter it signalled and its program index in
``args``; waits become ``"wait"`` slices of their own, and the critical path is drawn as flow
arrows. Times are microseconds, as the format wants.
"""
from __future__ import annotations

import json
import math
from typing import Iterable, NamedTuple, Sequence

from opcodes.base import NO_COUNTER

from schedule.assign import Schedule
from schedule.program import Program


class Record(NamedTuple):
    index: int                       # program index
    sm: int
    start: float                     # seconds
    end: float                       # seconds
    wait_start: float | None = None  # seconds; None: did not wait (or not measured)


def planned_records(sched: Schedule, eps: float = 1e-12) -> list[Record]:
    """Records of a simulated schedule (``sched.start`` / ``sched.finish`` must be set). An
    instruction that starts later than its SM became free waited on its counters since then."""
    if sched.start is None or sched.finish is None:
        raise ValueError("schedule has no predicted times: run schedule.simulate(sched, model) first")
    out: list[Record] = []
    for sm, q in enumerate(sched.per_sm()):           # pool instructions where the simulation put them
        q.sort(key=lambda i: (sched.start[i], sched.finish[i]))
        free = 0.0
        for i in q:
            s, f = sched.start[i], sched.finish[i]
            out.append(Record(i, sm, s, f, free if s - free > eps else None))
            free = f
    return out


def critical_path(records: Sequence, prog: Program, eps: float = 1e-9) -> list[int]:
    """The chain of instructions that bounded the end time, first to last (program indices).

    Walks back from the instruction that ended last: at each step the predecessor is whichever
    constraint released the instruction last, the previous instruction on its SM or the last
    producer of a counter it waited on (ties go to the counter, which is what held it back)."""
    recs = [Record(*r) for r in records]
    if not recs:
        return []
    by_index = {r.index: r for r in recs}
    prev_on_sm: dict[int, Record | None] = {}
    per_sm: dict[int, list[Record]] = {}
    for r in recs:
        per_sm.setdefault(r.sm, []).append(r)
    for rs in per_sm.values():
        rs.sort(key=lambda r: (r.start, r.end))
        for a, b in zip([None] + rs[:-1], rs):
            prev_on_sm[b.index] = a
    producers = prog.producers()
    last_producer: dict[int, Record] = {}
    for c, ps in enumerate(producers):
        done = [by_index[p] for p in ps if p in by_index]
        if done:
            last_producer[c] = max(done, key=lambda r: r.end)
    cur = max(recs, key=lambda r: r.end)
    path = [cur.index]
    seen = {cur.index}
    while True:
        cands = []
        for c in prog.waits[cur.index]:
            if c in last_producer:
                cands.append((last_producer[c].end, 1, last_producer[c]))
        p = prev_on_sm.get(cur.index)
        if p is not None:
            cands.append((p.end, 0, p))
        cands = [x for x in cands if x[0] <= cur.start + eps and x[2].index not in seen]
        if not cands:
            break
        cur = max(cands, key=lambda x: (x[0], x[1]))[2]
        path.append(cur.index)
        seen.add(cur.index)
    return path[::-1]


def _us(t: float) -> float:
    return round(t * 1e6, 4)


def _span(a: float, b: float, origin: float) -> tuple[float, float]:
    """(ts, dur) in µs of [a, b], rounded so that back-to-back spans stay back to back."""
    ts, te = _us(a - origin), _us(b - origin)
    return ts, max(0.0, round(te - ts, 4))


def instruction_args(prog: Program, i: int, targets: Sequence[int] | None = None) -> dict:
    """The ``args`` of instruction ``i``'s slice: opcode, program index, operands, waits, signal."""
    ins = prog.instrs[i]
    targets = prog.targets() if targets is None else targets
    sig = prog.signal[i]
    return {
        "index": i,
        "opcode": ins.NAME,
        "stage": ins.STAGE,
        "operands": dict(zip(ins.operand_names(), ins.operands())),
        "waits": [{"counter": prog.counters[c], "id": c, "target": targets[c]} for c in prog.waits[i]],
        "signal": prog.counters[sig] if sig != NO_COUNTER else None,
    }


def to_trace_events(records: Iterable, prog: Program, *, pid: int = 0, process_name: str = "megatape",
                    num_sms: int | None = None, critical: Sequence[int] | None = None,
                    origin: float | None = None, metadata: dict | None = None) -> dict:
    """A Trace Event Format object ``{"traceEvents": [...], "displayTimeUnit": "ns", ...}``.

    ``records``: ``(program_index, sm, start_s, end_s, wait_start_s or None)`` per instruction.
    ``num_sms``: name this many SM tracks even if some ran nothing (default: the SMs in records).
    ``critical``: program indices of a chain to draw as flow arrows and flag in ``args``
    (default: :func:`critical_path`; pass ``()`` for none). ``origin``: the time (s) shown as 0
    (default: the earliest time in ``records``). ``metadata`` goes under ``otherData``."""
    recs = [Record(*r) for r in records]
    if origin is None:
        origin = min((min(r.start, r.wait_start if r.wait_start is not None else r.start) for r in recs),
                     default=0.0)
    targets = prog.targets()
    if critical is None:
        critical = critical_path(recs, prog)
    crit = set(critical)
    sms = sorted({r.sm for r in recs} | (set(range(num_sms)) if num_sms else set()))
    ev: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": process_name}}]
    for s in sms:
        ev.append({"ph": "M", "pid": pid, "tid": s, "name": "thread_name", "args": {"name": f"SM {s}"}})
        ev.append({"ph": "M", "pid": pid, "tid": s, "name": "thread_sort_index", "args": {"sort_index": s}})
    for r in sorted(recs, key=lambda r: (r.sm, r.start)):
        ins = prog.instrs[r.index]
        if r.wait_start is not None and r.start > r.wait_start:
            ts, dur = _span(r.wait_start, r.start, origin)
            ev.append({"ph": "X", "pid": pid, "tid": r.sm, "cat": "wait", "name": "wait", "ts": ts, "dur": dur,
                       "args": {"index": r.index, "for": [prog.counters[c] for c in prog.waits[r.index]]}})
        args = instruction_args(prog, r.index, targets)
        args["sm"] = r.sm
        if r.wait_start is not None:
            args["wait_us"] = _us(r.start - r.wait_start)
        if r.index in crit:
            args["critical"] = True
        ts, dur = _span(r.start, r.end, origin)
        ev.append({"ph": "X", "pid": pid, "tid": r.sm, "cat": "instr", "name": ins.NAME, "ts": ts, "dur": dur,
                   "args": args})
    by_index = {r.index: r for r in recs}
    chain = [i for i in critical if i in by_index]
    for k, (a, b) in enumerate(zip(chain, chain[1:])):
        ra, rb = by_index[a], by_index[b]
        ev.append({"ph": "s", "pid": pid, "tid": ra.sm, "cat": "critical", "name": "critical path", "id": k,
                   "ts": _us((ra.start + ra.end) / 2 - origin)})
        ev.append({"ph": "f", "bp": "e", "pid": pid, "tid": rb.sm, "cat": "critical", "name": "critical path",
                   "id": k, "ts": _us((rb.start + rb.end) / 2 - origin)})
    out = {"traceEvents": ev, "displayTimeUnit": "ns"}
    if metadata:
        out["otherData"] = metadata
    return out


def write_trace(path, trace: dict) -> None:
    with open(path, "w") as f:
        json.dump(trace, f, separators=(",", ":"), allow_nan=False)


def summary(records: Sequence, prog: Program) -> dict:
    """Makespan, busy and wait time per SM, time per opcode (seconds) of a timeline."""
    recs = [Record(*r) for r in records]
    if not recs:
        return {"makespan": 0.0, "busy": {}, "wait": {}, "per_opcode": {}}
    t0 = min(r.start if r.wait_start is None else min(r.start, r.wait_start) for r in recs)
    t1 = max(r.end for r in recs)
    busy: dict[int, float] = {}
    wait: dict[int, float] = {}
    per_op: dict[str, float] = {}
    for r in recs:
        busy[r.sm] = busy.get(r.sm, 0.0) + (r.end - r.start)
        if r.wait_start is not None:
            wait[r.sm] = wait.get(r.sm, 0.0) + max(0.0, r.start - r.wait_start)
        name = prog.instrs[r.index].NAME
        per_op[name] = per_op.get(name, 0.0) + (r.end - r.start)
    return {"makespan": t1 - t0, "busy": busy, "wait": wait, "per_opcode": per_op,
            "utilisation": sum(busy.values()) / (len(busy) * (t1 - t0)) if t1 > t0 else math.nan}
