"""Views of a MEASURED timeline (a profiling launch of the kernel), beside the plan.

``interp.profile.records`` (the kernel's profile buffer, read) gives per tape slot ``(slot, program index, opcode, sm, wait_start_ns,
exec_start_ns, end_ns)``; :func:`write_views` turns that into the same views as the plan: a Perfetto
trace, a per-SM Gantt chart, and a summary of planned against measured time per opcode, with the
critical path as it actually ran.
"""
from __future__ import annotations

import json
import pathlib
from collections import defaultdict

from schedule.assign import Schedule
from schedule.program import Program

from . import trace as T


def to_records(raw) -> list[tuple]:
    """(slot, pi, name, sm, tw, te, tend) in ns -> trace records (pi, sm, start_s, end_s, wait_s)."""
    return [(int(pi), int(sm), te * 1e-9, tend * 1e-9, tw * 1e-9) for (_, pi, _, sm, tw, te, tend) in raw]


def compare(records, prog: Program, sched: Schedule) -> str:
    """Markdown: per opcode, planned vs measured busy time, and the measured critical path."""
    meas = defaultdict(float)
    plan = defaultdict(float)
    n = defaultdict(int)
    for pi, sm, s, e, w in records:
        name = prog.instrs[pi].NAME
        meas[name] += e - s
        n[name] += 1
        plan[name] += sched.finish[pi] - sched.start[pi]
    crit = T.critical_path(records, prog)
    counts = defaultdict(int)
    for pi in crit:
        counts[prog.instrs[pi].NAME] += 1
    t_meas = max(e for _, _, _, e, _ in records) - min(min(s, w if w is not None else s) for _, _, s, _, w in records)
    lines = [f"planned makespan {sched.makespan * 1e6:.1f} us, measured {t_meas * 1e6:.1f} us "
             f"(measured / planned = {t_meas / sched.makespan:.3f})", "",
             "| opcode | n | planned busy SM-us | measured busy SM-us | measured / planned | on critical path |",
             "|---|---|---|---|---|---|"]
    for name in sorted(meas, key=lambda k: -meas[k]):
        lines.append(f"| {name} | {n[name]} | {plan[name] * 1e6:.0f} | {meas[name] * 1e6:.0f} | "
                     f"{meas[name] / plan[name] if plan[name] else float('nan'):.2f} | {counts.get(name, 0)} |")
    lines.append("")
    lines.append("measured critical path: " + " -> ".join(
        f"{k}x{v}" for k, v in _runs([prog.instrs[pi].NAME for pi in crit])))
    return "\n".join(lines)


def _runs(names):
    out = []
    for nm in names:
        if out and out[-1][0] == nm:
            out[-1][1] += 1
        else:
            out.append([nm, 1])
    return [(a, b) for a, b in out]


def write_views(raw, prog: Program, sched: Schedule, out_dir, num_sms: int, tag: str = "measured") -> list:
    """Write ``<tag>_trace.json``, ``<tag>_gantt.png`` and ``<tag>_vs_plan.md`` into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    recs = to_records(raw)
    crit = T.critical_path(recs, prog)
    tr = T.to_trace_events(recs, prog, num_sms=num_sms, critical=crit, process_name=f"megatape ({tag})")
    T.write_trace(out / f"{tag}_trace.json", tr)
    files = [out / f"{tag}_trace.json"]
    try:
        from .viz import gantt
        gantt(recs, prog, num_sms, out / f"{tag}_gantt.png", f"{tag} timeline, {len(recs)} instructions",
              critical=crit)
        files.append(out / f"{tag}_gantt.png")
    except ImportError:            # matplotlib missing: the trace and the table still get written
        pass
    (out / f"{tag}_vs_plan.md").write_text(compare(recs, prog, sched) + "\n")
    files.append(out / f"{tag}_vs_plan.md")
    return files


def main_from_files(records_json, tiling: dict, preset: str, num_sms: int, out_dir, max_seq: int = 4224):
    """Rebuild the plan for a saved profile (CPU) and write the views."""
    from opcodes import ModelConfig, Tiling

    from schedule.compile import compile_model
    cfg = ModelConfig.from_name(preset)
    comp = compile_model(cfg, num_sms, max_seq=max_seq, tiling=Tiling(**tiling))
    raw = json.loads(pathlib.Path(records_json).read_text())
    return write_views(raw, comp.prog, comp.sched, out_dir, num_sms)
