"""Summaries of a measured timeline (a profiling launch of the kernel).

:func:`summarize` reports per opcode: count, busy time, wait time, HBM bytes and the bandwidth
achieved while that opcode was running anywhere on the chip; per stage of a layer what it adds to
the critical path (:func:`critical_path`) and one layer as it ran (:func:`layer_timeline`); :func:`format_summary` prints it as a
Markdown table and :func:`timeline_line` as one line. The buffer itself is read by
:func:`interp.profile.records`.
"""
from __future__ import annotations

import statistics
from collections import defaultdict

import torch

from interp.profile import records
from opcodes import BY_OPCODE
from schedule.tape import Tape


def summarize(tape: Tape, prof: torch.Tensor, pos: int | None = None, copy_Bps: float | None = None) -> dict:
    """The summary of a profiled launch (module docstring); ``pos`` times attention at that
    position, ``copy_Bps`` (the measured copy bandwidth) gives the fixed cost per instruction."""
    lay = tape.lay
    recs = records(tape, prof)
    by = defaultdict(lambda: dict(n=0, busy_ns=0, wait_ns=0, hbm_bytes=0, first_ns=float("inf"), last_ns=0))
    per_sm_wait = defaultdict(int)
    per_sm_busy = defaultdict(int)
    times = defaultdict(list)                  # opcode -> [(busy ns, hbm bytes)]
    layer_recs = defaultdict(list)             # layer -> [(stage, name, wait start, exec start, end)]
    fair = copy_Bps / tape.num_sms / 1e9 if copy_Bps else None      # bytes per ns per SM
    from opcodes import AttnPartial
    for slot, pi, name, sm, tw, te, tend in recs:
        d = by[name]
        ins = BY_OPCODE[int(tape.words[slot, 0])].decode(tape.words[slot, 6:].tolist())
        c = ins.cost(lay, pos + 1) if (isinstance(ins, AttnPartial) and pos is not None) else ins.cost(lay)
        times[name].append((tend - te, c.hbm_bytes))
        if hasattr(ins, "layer"):
            layer_recs[ins.layer].append((type(ins).STAGE, name, tw, te, tend))
        d["n"] += 1
        d["busy_ns"] += tend - te
        d["wait_ns"] += te - tw
        d["hbm_bytes"] += c.hbm_bytes
        d["first_ns"] = min(d["first_ns"], te)
        d["last_ns"] = max(d["last_ns"], tend)
        per_sm_wait[sm] += te - tw
        per_sm_busy[sm] += tend - te
    makespan = max(r[6] for r in recs)
    ops = {}
    for name, d in by.items():
        span = max(1, d["last_ns"] - d["first_ns"])
        ts = times[name]
        ops[name] = dict(d, span_ns=span,
                         per_sm_GBps=(d["hbm_bytes"] / max(1, d["busy_ns"])) if d["busy_ns"] else 0.0,
                         chip_TBps_over_span=d["hbm_bytes"] / span / 1e3,
                         median_ns=statistics.median(t for t, _ in ts),
                         fixed_ns=statistics.median(t - b / fair for t, b in ts) if fair else None)
    return dict(makespan_ns=makespan, ops=ops, total_wait_ns=sum(per_sm_wait.values()),
                total_busy_ns=sum(per_sm_busy.values()), num_sms=tape.num_sms,
                max_sm_wait_ns=max(per_sm_wait.values()), stages=critical_path(layer_recs),
                layer=layer_period(layer_recs), layer_timeline=layer_timeline(layer_recs), records=recs)


def layer_timeline(layer_recs: dict, layer: int | None = None) -> dict | None:
    """One layer's stages as they ran (default: the middle layer), in the order they started: per
    stage its instructions' first wait start, the spread of their exec starts and of their ends (ns
    from the layer's first exec start), and their median exec and wait times. The spread of a
    stage's starts is what the per-opcode table cannot show: tiles that began late, not slowly."""
    if not layer_recs:
        return None
    layer = sorted(layer_recs)[len(layer_recs) // 2] if layer is None else layer
    by_stage: dict = defaultdict(list)
    for stage, name, tw, te, tend in layer_recs[layer]:
        by_stage[(stage, name)].append((tw, te, tend))
    cols = {k: tuple(zip(*rs)) for k, rs in by_stage.items()}          # (wait starts, exec starts, ends)
    t0 = min(min(te) for _, te, _ in cols.values())
    rows = []
    for (stage, name), (tw, te, tend) in sorted(cols.items(), key=lambda kv: min(kv[1][1])):
        rows.append(dict(stage=name, n=len(te), wait0_ns=min(tw) - t0,
                         exec_ns=(min(te) - t0, max(te) - t0), end_ns=(min(tend) - t0, max(tend) - t0),
                         median_exec_ns=statistics.median(e - x for x, e in zip(te, tend)),
                         median_wait_ns=statistics.median(x - w for w, x in zip(tw, te))))
    return dict(layer=layer, rows=rows)


def critical_path(layer_recs: dict) -> list[dict]:
    """Per stage of a layer (in dataflow order), the medians over layers of what it adds to the
    layer's critical path (``adds_ns``: its last end after the previous stage's last end; for a
    layer's first stage, the previous layer's last stage) and of the hop (``hop_ns``: from the
    previous stage's last end to the first start of this stage's instructions that were waiting
    then; None where none was). The first layer's first stage has no previous stage."""
    adds, hops = defaultdict(list), defaultdict(list)
    order: dict = {}
    prev_last = None                           # the records of the previous layer's last stage
    for layer in sorted(layer_recs):
        by_stage: dict = defaultdict(list)
        for stage, name, tw, te, tend in layer_recs[layer]:
            by_stage[(stage, name)].append((tw, te, tend))
            order[(stage, name)] = None
        keys = sorted(by_stage)
        steps = [(by_stage[a], b) for a, b in zip(keys, keys[1:])]
        if prev_last is not None and keys:
            steps.insert(0, (prev_last, keys[0]))
        for prev_recs, cur in steps:
            prev_end = max(e for _, _, e in prev_recs)
            adds[cur].append(max(e for _, _, e in by_stage[cur]) - prev_end)
            late = [te for tw, te, _ in by_stage[cur] if tw <= prev_end <= te]
            if late:
                hops[cur].append(min(late) - prev_end)
        prev_last = by_stage[keys[-1]] if keys else None
    return [dict(stage=name, adds_ns=statistics.median(adds[k]),
                 hop_ns=statistics.median(hops[k]) if hops[k] else None, layers=len(adds[k]))
            for k in sorted(order) for name in [k[1]] if adds[k]]


def layer_period(layer_recs: dict) -> dict | None:
    """A layer's time on the critical path, from the previous layer's last end to its own: the
    median over the layers after the first (``ns``) and their number (``layers``); None with fewer
    than two layers. The per-stage ``adds_ns`` of :func:`critical_path` are its parts."""
    ends = [max(r[4] for r in layer_recs[l]) for l in sorted(layer_recs) if layer_recs[l]]
    if len(ends) < 2:
        return None
    return dict(ns=statistics.median(b - a for a, b in zip(ends, ends[1:])), layers=len(ends) - 1)


def format_summary(s: dict) -> str:
    lines = [f"measured makespan {s['makespan_ns'] / 1e3:.1f} us on {s['num_sms']} SMs; "
             f"total wait {s['total_wait_ns'] / 1e3:.0f} SM-us ({s['total_wait_ns'] / (s['makespan_ns'] * s['num_sms']):.1%} "
             f"of SM time), busy {s['total_busy_ns'] / (s['makespan_ns'] * s['num_sms']):.1%}",
             "| opcode | n | busy SM-us | wait SM-us | first..last us | GB/s per SM while busy | TB/s over its span |",
             "|---|---|---|---|---|---|---|"]
    lines[-2] = lines[-2][:-1] + " median us | fixed us |"
    lines[-1] += "---|---|"
    for name, d in sorted(s["ops"].items(), key=lambda kv: kv[1]["first_ns"]):
        fixed = "-" if d.get("fixed_ns") is None else f"{d['fixed_ns'] / 1e3:.2f}"
        lines.append(f"| {name} | {d['n']} | {d['busy_ns'] / 1e3:.0f} | {d['wait_ns'] / 1e3:.0f} | "
                     f"{d['first_ns'] / 1e3:.1f}..{d['last_ns'] / 1e3:.1f} | {d['per_sm_GBps']:.1f} | "
                     f"{d['chip_TBps_over_span']:.2f} | {d['median_ns'] / 1e3:.2f} | {fixed} |")
    if any(d.get("fixed_ns") is not None for d in s["ops"].values()):
        lines += ["", "fixed us: the median instruction's time over its bytes at an even share of the copy "
                      "bandwidth (negative: it streamed faster than that share)"]
    if s.get("stages"):
        lines += ["", "per layer (median over layers): what each stage adds to the critical path, and its hop",
                  "| stage | adds us | hop us | layers |", "|---|---|---|---|"]
        for r in s["stages"]:
            hop = "-" if r["hop_ns"] is None else f"{r['hop_ns'] / 1e3:.2f}"
            lines.append(f"| {r['stage']} | {r['adds_ns'] / 1e3:.2f} | {hop} | {r['layers']} |")
        if s.get("layer"):
            lines.append(f"| a whole layer (last end to last end) | {s['layer']['ns'] / 1e3:.2f} | - | "
                         f"{s['layer']['layers']} |")
    tl_ = s.get("layer_timeline")
    if tl_:
        lines += ["", f"layer {tl_['layer']} as it ran (us from its first instruction's start)",
                  "| stage | n | first wait | exec starts | ends | median exec | median wait |",
                  "|---|---|---|---|---|---|---|"]
        for r in tl_["rows"]:
            (a, b), (c, d) = r["exec_ns"], r["end_ns"]
            lines.append(f"| {r['stage']} | {r['n']} | {r['wait0_ns'] / 1e3:.1f} | {a / 1e3:.1f}..{b / 1e3:.1f} | "
                         f"{c / 1e3:.1f}..{d / 1e3:.1f} | {r['median_exec_ns'] / 1e3:.2f} | "
                         f"{r['median_wait_ns'] / 1e3:.2f} |")
    return "\n".join(lines)


def timeline_line(summ: dict) -> str:
    """One line of a measured profile: makespan, waiting share, and per opcode its span and median
    instruction time (us)."""
    per: dict = {}
    for slot, pi, name, sm, tw, te, tend in summ["records"]:
        d = per.setdefault(name, [float("inf"), 0, []])
        d[0], d[1] = min(d[0], te), max(d[1], tend)
        d[2].append(tend - te)
    tot = summ["total_wait_ns"] + summ["total_busy_ns"]
    parts = [f"makespan {summ['makespan_ns'] / 1e3:.1f}", f"wait {100 * summ['total_wait_ns'] / max(1, tot):.1f}%"]
    for name, (a, b, ds) in per.items():
        parts.append(f"{name} {a / 1e3:.1f}..{b / 1e3:.1f} (med {statistics.median(ds) / 1e3:.2f})")
    return "; ".join(parts)
