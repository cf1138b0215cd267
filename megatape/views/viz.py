"""Pictures of a compiled tape: the tile DAG and the planned schedule (``megatape viz``).

:func:`render` writes into its output directory (``megatape viz --out``):

``dag.png`` / ``dag.svg``  the DAG, aggregated so that a 70B layer (thousands of tiles) reads at
    a glance: one box per (layer, opcode, counter the tiles signal) with its tile count, one grey box per
    counter with its target, columns by stage, colours by opcode. Many layers aggregate further
    to one box per (layer, opcode) and one per (layer, counter family).
``dag_zoom_*.png`` / ``.svg``  with ``--stage`` / ``--layer`` / ``--sm``: the selected tiles one
    by one (at most ``--max-nodes``; the title says when the selection was thinned), with the
    counters they touch; ``--sm`` also draws the SM's queue order.
``dag.dot`` / ``dag.graphml``  the tile DAG (every instruction, every counter) through networkx's
    DOT (pydot) and GraphML writers; ``dag_agg.dot`` the aggregated one.
``plan_gantt.png``  the planned schedule, one row per SM, coloured by opcode, the critical path
    outlined.
``plan_trace.json``  the planned schedule as a Chrome / Perfetto trace (see :mod:`megatape.views.trace`).

Pictures are drawn by matplotlib (Agg) through networkx's drawing functions; layouts are
networkx's ``multipartite_layout``; graph files are networkx's writers.
"""
from __future__ import annotations

import math
import os
import pathlib
import sys
import time
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import networkx as nx  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from opcodes import BY_OPCODE, REGISTRY, ModelConfig  # noqa: E402
from opcodes.base import NO_COUNTER  # noqa: E402

from schedule.dag import build_dag  # noqa: E402,F401  (re-exported: viz users call viz.build_dag)
from schedule.program import Program  # noqa: E402

from . import trace as T  # noqa: E402

COUNTER_COLOR = "#d9d9d9"
MAX_AGG_NODES = 160          # above this the aggregate view goes from (layer, opcode, counter) to (layer, opcode)


# ---- colours ----------------------------------------------------------------------------------
def opcode_colors() -> dict[str, tuple]:
    """One colour per opcode, in opcode-number order (stable across every picture)."""
    cmap = plt.get_cmap("tab10")
    return {BY_OPCODE[op].NAME: cmap((op - 1) % 10) for op in sorted(BY_OPCODE)}


def _stage_of(name: str) -> int:
    return REGISTRY[name].STAGE


# ---- graphs -----------------------------------------------------------------------------------
def _layer(ins) -> int:
    return int(getattr(ins, "layer", 0))


def _family(counter_name: str) -> str:
    return counter_name.split("[", 1)[0]


def _counter_layer(counter_name: str) -> int:
    """The layer of ``name[layer, ...]``; a counter of no layer (a rows program's ``embed``, before layer 0): 0."""
    if "[" not in counter_name:
        return 0
    inside = counter_name.split("[", 1)[1].rstrip("]")
    return int(inside.split(",")[0])


def aggregate_dag(prog: Program, by: str = "auto") -> nx.DiGraph:
    """The DAG with tiles merged into groups, for pictures.

    ``by='signal'``: one node per (layer, opcode, counter signalled) and one per counter;
    ``by='opcode'``: one node per (layer, opcode) and one per (layer, counter family), e.g.
    ``act[3,*]``; ``'auto'``: 'signal' unless that makes more than ``MAX_AGG_NODES`` nodes.
    Node attributes: ``kind`` ('group' / 'counter'), ``layer``, ``col`` (column: 2*stage for
    tiles, 2*stage+1 for the counters a stage signals), ``count`` (tiles or counters merged),
    ``opcode``, ``label``. Edge attribute ``tiles``: the tiles behind the edge."""
    if by == "auto":
        n_groups = len({(_layer(ins), ins.NAME, s) for ins, s in zip(prog.instrs, prog.signal)})
        by = "signal" if n_groups + len(prog.counters) <= MAX_AGG_NODES else "opcode"
    if by not in ("signal", "opcode"):
        raise ValueError(f"by must be 'signal', 'opcode' or 'auto', got {by!r}")
    targets = prog.targets()
    G = nx.DiGraph(name=f"{prog.lay.cfg.name} (by {by})", by=by)
    # the stage that signals each counter (for its column)
    ctr_stage = [0] * len(prog.counters)
    for i, s in enumerate(prog.signal):
        if s != NO_COUNTER:
            ctr_stage[s] = prog.instrs[i].STAGE

    def gkey(i):
        ins = prog.instrs[i]
        if by == "signal":
            return ("grp", _layer(ins), ins.NAME, prog.signal[i])
        return ("grp", _layer(ins), ins.NAME)

    def ckey(c):
        if by == "signal":
            return ("ctr", c)
        name = prog.counters[c]
        return ("ctr", _counter_layer(name), _family(name))

    # nodes, in program order so that columns read top-down in dataflow order
    for i, ins in enumerate(prog.instrs):
        k = gkey(i)
        if k not in G:
            G.add_node(k, kind="group", layer=_layer(ins), opcode=ins.NAME, stage=ins.STAGE,
                       col=2 * ins.STAGE, count=0)
        G.nodes[k]["count"] += 1
        s = prog.signal[i]
        if s != NO_COUNTER:
            ck = ckey(s)
            if ck not in G:
                name = prog.counters[s]
                G.add_node(ck, kind="counter", layer=_counter_layer(name), opcode="",
                           stage=ctr_stage[s], col=2 * ctr_stage[s] + 1, count=0, names=[], targets=[])
            if prog.counters[s] not in G.nodes[ck]["names"]:
                G.nodes[ck]["names"].append(prog.counters[s])
                G.nodes[ck]["targets"].append(targets[s])
                G.nodes[ck]["count"] += 1
    for i in range(len(prog)):
        k = gkey(i)
        s = prog.signal[i]
        if s != NO_COUNTER:
            e = G.get_edge_data(k, ckey(s))
            if e is None:
                G.add_edge(k, ckey(s), tiles=1)
            else:
                e["tiles"] += 1
        for c in prog.waits[i]:
            e = G.get_edge_data(ckey(c), k)
            if e is None:
                G.add_edge(ckey(c), k, tiles=1)
            else:
                e["tiles"] += 1
    for k, d in G.nodes(data=True):
        if d["kind"] == "group":
            d["label"] = f"{d['opcode']}\n×{d['count']}"
        else:
            names, tg = d.pop("names"), d.pop("targets")
            if len(names) == 1:
                d["label"] = f"{names[0]}\n≥{tg[0]}"
            else:
                fam = _family(names[0])
                tgt = f"≥{tg[0]}" if len(set(tg)) == 1 else f"≥{min(tg)}..{max(tg)}"
                d["label"] = f"{fam}[{d['layer']},*]\n{len(names)} × {tgt}"
            d["target"] = tg[0] if len(set(tg)) == 1 else -1
    return G


def _short(ins) -> str:
    """'qkv k h3 j1' style label of one instruction (operands but the layer)."""
    names, ops = ins.operand_names(), ins.operands()
    parts = [f"{n}={v}" for n, v in zip(names, ops) if n != "layer"]
    return ins.NAME + "\n" + " ".join(parts)


def zoom_dag(prog: Program, sched=None, stage: str | None = None, layer: int | None = None,
             sm: int | None = None, max_nodes: int = 120) -> tuple[nx.DiGraph, str]:
    """The tiles selected by ``stage`` (opcode name or stage number), ``layer`` and ``sm`` (all
    that are given), one node each, with the counters they wait on and signal. At most
    ``max_nodes`` tiles are kept, evenly spread over the selection in program order. Returns the
    graph and a note for the title. ``sm`` needs ``sched``; then nodes carry the predicted start."""
    sel = list(range(len(prog)))
    what = []
    if stage is not None:
        st = _parse_stage(stage)
        sel = [i for i in sel if prog.instrs[i].STAGE == st]
        what.append(f"stage {st} ({_stage_name(st)})")
    if layer is not None:
        sel = [i for i in sel if _layer(prog.instrs[i]) == layer]
        what.append(f"layer {layer}")
    if sm is not None:
        if sched is None:
            raise ValueError("zoom by SM needs the schedule")
        if not 0 <= sm < sched.num_sms:
            raise ValueError(f"--sm {sm} out of range: the schedule has {sched.num_sms} SMs")
        mine = sched.per_sm()[sm]
        if sched.start is not None:        # pool instructions the simulation gave this SM, in time order
            mine.sort(key=lambda i: (sched.start[i], sched.finish[i]))
        on = set(mine)
        order = {i: k for k, i in enumerate(mine)}
        sel = sorted((i for i in sel if i in on), key=order.__getitem__)
        what.append(f"SM {sm}")
    total = len(sel)
    if total == 0:
        raise ValueError(f"no instruction matches {', '.join(what) or 'the selection'}")
    note = f"{', '.join(what)}: {total} tiles"
    if total > max_nodes:
        step = total / max_nodes
        sel = [sel[int(k * step)] for k in range(max_nodes)]
        note += f" (showing {len(sel)} spread evenly over them: --max-nodes {max_nodes})"
    targets = prog.targets()
    G = nx.DiGraph(name=note)
    start = sched.start if sched is not None and sched.start is not None else None
    ctr_stage = {}
    for i, s in enumerate(prog.signal):
        if s != NO_COUNTER:
            ctr_stage[s] = prog.instrs[i].STAGE
    for i in sel:
        ins = prog.instrs[i]
        lab = _short(ins)
        if start is not None and sm is not None:
            lab += f"\nt={start[i] * 1e6:.1f}µs"
        G.add_node(i, kind="instr", layer=_layer(ins), opcode=ins.NAME, stage=ins.STAGE,
                   col=2 * ins.STAGE, label=lab)
    for i in sel:
        cs = list(prog.waits[i]) + ([prog.signal[i]] if prog.signal[i] != NO_COUNTER else [])
        for c in cs:
            k = ("ctr", c)
            if k not in G:
                name = prog.counters[c]
                G.add_node(k, kind="counter", layer=_counter_layer(name), opcode="",
                           stage=ctr_stage.get(c, 0), col=2 * ctr_stage.get(c, 0) + 1,
                           label=f"{name}\n≥{targets[c]}")
        if prog.signal[i] != NO_COUNTER:
            G.add_edge(i, ("ctr", prog.signal[i]), kind="signal")
        for c in prog.waits[i]:
            G.add_edge(("ctr", c), i, kind="wait")
    if sm is not None:
        for a, b in zip(sel, sel[1:]):
            if not G.has_edge(a, b):
                G.add_edge(a, b, kind="queue")
    return G, note


def _parse_stage(stage) -> int:
    s = str(stage)
    if s.lstrip("-").isdigit():
        st = int(s)
        if st not in {c.STAGE for c in REGISTRY.values()}:
            raise ValueError(f"no opcode has stage {st}")
        return st
    if s not in REGISTRY:
        raise ValueError(f"unknown stage {s!r}: use an opcode name ({', '.join(REGISTRY)}) or a stage number")
    return REGISTRY[s].STAGE


def _stage_name(st: int) -> str:
    return "/".join(c.NAME for c in REGISTRY.values() if c.STAGE == st)


# ---- layout and drawing -----------------------------------------------------------------------
def layered_layout(G: nx.DiGraph, row_gap: float = 1.0, max_rows: int = 24) -> dict:
    """Columns by the ``col`` attribute, one band per model layer, bands stacked top to bottom; a
    column of more than ``max_rows`` nodes wraps into several side by side.

    Each band is networkx's ``multipartite_layout`` of that layer's nodes (columns centred, nodes
    in insertion order); it is mapped back to grid units (one column step and one node step = 1)
    so that the bands of all layers share columns even where a layer lacks one (no ``out``
    counter after the last layer)."""
    by_layer: dict[int, list] = defaultdict(list)
    for n, d in G.nodes(data=True):
        by_layer[d["layer"]].append(n)
    # columns of every band, wrapped: (layer, col) -> list of sub-columns
    wrapped: dict[int, dict] = {}
    width: dict[int, int] = defaultdict(int)
    for L, nodes in by_layer.items():
        cols: dict[int, list] = defaultdict(list)
        for n in nodes:
            cols[G.nodes[n]["col"]].append(n)
        subsets = {}
        for c, members in cols.items():
            k = math.ceil(len(members) / max_rows)
            per = math.ceil(len(members) / k)
            for j in range(k):
                subsets[(c, j)] = members[j * per:(j + 1) * per]
            width[c] = max(width[c], k)
        wrapped[L] = dict(sorted(subsets.items()))
    x0, x = {}, 0
    for c in sorted(width):
        x0[c] = x
        x += width[c]
    pos = {}
    y0 = 0.0
    for L in sorted(wrapped):
        subsets = wrapped[L]
        p = nx.multipartite_layout(G.subgraph(by_layer[L]), subset_key=subsets, align="vertical")
        # undo the rescaling: x of consecutive columns differ by one unit of the band's grid
        xs = sorted({float(v[0]) for v in p.values()})
        if len(xs) > 1:
            unit = xs[1] - xs[0]
        else:
            ys = sorted(float(v[1]) for v in p.values())
            unit = (ys[-1] - ys[0]) / (len(ys) - 1) if len(ys) > 1 and ys[-1] > ys[0] else 1.0
        tallest = max(len(v) for v in subsets.values())
        for (c, j), members in subsets.items():
            for n in members:
                # multipartite stacks a column upwards in insertion order: flip so it reads top-down
                pos[n] = (float(x0[c] + j), y0 - (tallest - 1) / 2 - float(p[n][1]) / unit)
        y0 -= tallest + row_gap
    return pos


def _with_layer_inputs(G: nx.DiGraph) -> nx.DiGraph:
    """For drawing: an edge from a counter of layer l to a tile of layer l+1 would cross the whole
    picture, so the counter is drawn a second time at the head of layer l+1's band (column -1)
    and the edge starts there. Nodes left without edges by this are dropped. SM queue edges
    (``--sm``) keep their long way: they show the SM moving on to the next layer."""
    cross = [(u, v) for u, v, k in G.edges(data="kind")
             if G.nodes[u]["layer"] != G.nodes[v]["layer"] and k != "queue"]
    if not cross:
        return G
    D = G.copy()
    for u, v in cross:
        L = G.nodes[v]["layer"]
        proxy = ("from", u, L)
        if proxy not in D:
            D.add_node(proxy, **{**G.nodes[u], "layer": L, "col": -1})
        D.remove_edge(u, v)
        D.add_edge(proxy, v, **G.edges[u, v])
    D.remove_nodes_from([n for n in list(D.nodes) if D.degree(n) == 0 and G.degree(n) > 0])
    return D


def _box_margins(fig, ax, pos, texts, edges, gap_pt: float = 1.5) -> tuple[list, list]:
    """Per edge, the distance (points) from each end's node centre to the border of its label box
    along the edge, so that arrows start and end at the boxes whatever their size."""
    fig.canvas.draw()
    half = {}
    for n, t in texts.items():
        bb = t.get_bbox_patch().get_window_extent()
        half[n] = (bb.width / 2, bb.height / 2)
    to_pt = 72.0 / fig.dpi
    disp = {n: ax.transData.transform(p) for n, p in pos.items()}

    def exit_dist(n, dx, dy):
        hw, hh = half.get(n, (0.0, 0.0))
        t = min(hw / abs(dx) if dx else math.inf, hh / abs(dy) if dy else math.inf)
        return 0.0 if math.isinf(t) else t * to_pt + gap_pt

    src, dst = [], []
    for u, v in edges:
        dx, dy = disp[v] - disp[u]
        norm = math.hypot(dx, dy) or 1.0
        dx, dy = dx / norm, dy / norm
        src.append(exit_dist(u, dx, dy))
        dst.append(exit_dist(v, dx, dy))
    return src, dst


def draw_dag(G: nx.DiGraph, title: str, paths: list, font_size: float | None = None) -> None:
    """Draw a layered graph (``aggregate_dag`` or ``zoom_dag``) to each of ``paths``."""
    colors = opcode_colors()
    G = _with_layer_inputs(G)
    pos = layered_layout(G)
    xs = [p[0] for p in pos.values()]
    ys = [p[1] for p in pos.values()]
    ncols = max(xs) - min(xs) + 1
    nrows = max(ys) - min(ys) + 1
    fs = font_size or (9 if nrows <= 40 else 7)
    strs = [str(t) for t in nx.get_node_attributes(G, "label").values()]
    lines = max(t.count("\n") + 1 for t in strs)
    chars = max(len(part) for t in strs for part in t.split("\n"))
    col_in = max(1.15 * fs / 9, chars * fs * 0.6 / 72 + 0.45)      # inches per column step
    w = min(48.0, max(8.0, col_in * ncols + 1.5))
    h = min(80.0, max(3.2, (0.17 * lines + 0.16) * nrows * fs / 9 + 2.2))
    fig, ax = plt.subplots(figsize=(w, h))
    groups = [n for n, d in G.nodes(data=True) if d["kind"] != "counter"]
    ctrs = [n for n, d in G.nodes(data=True) if d["kind"] == "counter"]
    # nodes are their labels, drawn as coloured boxes
    labels = nx.get_node_attributes(G, "label")
    texts = {}
    for op in sorted({G.nodes[n]["opcode"] for n in groups}, key=_stage_of):
        ns = [n for n in groups if G.nodes[n]["opcode"] == op]
        texts.update(nx.draw_networkx_labels(
            G, pos, labels={n: labels[n] for n in ns}, ax=ax, font_size=fs,
            bbox=dict(boxstyle="round,pad=0.3", fc=colors[op], ec="black", lw=0.5, alpha=0.95)))
    texts.update(nx.draw_networkx_labels(G, pos, labels={n: labels[n] for n in ctrs}, ax=ax, font_size=fs * 0.9,
                                         bbox=dict(boxstyle="sawtooth,pad=0.3", fc=COUNTER_COLOR, ec="#777777",
                                                   lw=0.4)))
    # column headers: the stage of each tile column
    top = max(ys) + 0.9
    col_xs, col_ops = defaultdict(list), defaultdict(dict)
    for n in G.nodes:
        col_xs[G.nodes[n]["col"]].append(pos[n][0])
        if G.nodes[n].get("opcode"):
            col_ops[G.nodes[n]["col"]][G.nodes[n]["opcode"]] = None
    cols = sorted(((min(v) + max(v)) / 2, c) for c, v in col_xs.items())
    for x, c in cols:     # a tile column: the opcodes drawn in it (the program's, not every opcode of the stage)
        txt = "from layer above" if c < 0 else ("/".join(col_ops[c]) or _stage_name(c // 2)) if c % 2 == 0 \
            else "counters"
        ax.text(x, top, txt, ha="center", va="bottom", fontsize=fs + 1.5,
                fontweight="bold" if c % 2 == 0 else "normal", color="black" if c % 2 == 0 else "#666666")
    layers = sorted({G.nodes[n]["layer"] for n in G.nodes})
    if len(layers) > 1:
        band = {}
        for n in G.nodes:
            band.setdefault(G.nodes[n]["layer"], []).append(pos[n][1])
        for L, yl in band.items():
            ax.text(min(xs) - 0.75, sum(yl) / len(yl), f"layer {L}", ha="right", va="center", fontsize=fs + 1)
    ax.set_xlim(min(xs) - (1.6 if len(layers) > 1 else 0.8), max(xs) + 0.8)
    ax.set_ylim(min(ys) - 0.8, top + 0.9)
    ekind = nx.get_edge_attributes(G, "kind")
    dep = [e for e in G.edges if ekind.get(e) != "queue"]
    queue = [e for e in G.edges if ekind.get(e) == "queue"]
    handles = [Patch(fc=colors[op], ec="black", lw=0.5, label=op) for op in colors
               if any(G.nodes[n]["opcode"] == op for n in groups)]
    handles.append(Patch(fc=COUNTER_COLOR, ec="#777777", lw=0.4, label="counter (≥ target)"))
    if queue:
        handles.append(Line2D([], [], color="#c00000", ls="--", label="SM queue order"))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.01), ncol=len(handles),
              fontsize=fs + 1.5, frameon=False)
    ax.set_title(title, fontsize=fs + 4)
    ax.axis("off")
    fig.tight_layout()
    # edges go under the boxes and stop at their borders: measure the boxes as laid out
    src_m, dst_m = _box_margins(fig, ax, pos, texts, dep)
    busy = len(dep) > 150       # many edges: lighter, so that the boxes stay in front
    nx.draw_networkx_edges(G, pos, edgelist=dep, ax=ax, edge_color="#555555", width=0.5 if busy else 0.6,
                           alpha=0.35 if busy else 0.6,
                           arrows=True, arrowsize=7, node_size=0, min_source_margin=src_m,
                           min_target_margin=dst_m, hide_ticks=False)
    if queue:
        src_m, dst_m = _box_margins(fig, ax, pos, texts, queue)
        nx.draw_networkx_edges(G, pos, edgelist=queue, ax=ax, edge_color="#c00000", width=1.0, style="dashed",
                               arrows=True, arrowsize=8, node_size=0, min_source_margin=src_m,
                               min_target_margin=dst_m, connectionstyle="arc3,rad=0.15", hide_ticks=False)
    for p in paths:
        fig.savefig(p, dpi=110)
    plt.close(fig)


def gantt(records, prog: Program, num_sms: int, path, title: str, critical=None,
          lower_bound: float | None = None) -> None:
    """Per-SM Gantt chart of a timeline (``megatape.views.trace`` records, seconds), time in µs."""
    colors = opcode_colors()
    recs = [T.Record(*r) for r in records]
    t0 = min(r.start if r.wait_start is None else min(r.start, r.wait_start) for r in recs)
    t1 = max(r.end for r in recs)
    crit = set(critical or ())
    h = min(40.0, max(4.0, 0.06 * num_sms + 2.4))
    fig, ax = plt.subplots(figsize=(16, h), layout="constrained")
    per_sm: dict[int, list] = defaultdict(list)
    for r in recs:
        per_sm[r.sm].append(r)
    for s, rs in per_sm.items():
        xr = [((r.start - t0) * 1e6, (r.end - r.start) * 1e6) for r in rs]
        fc = [colors[prog.instrs[r.index].NAME] for r in rs]
        ax.broken_barh(xr, (s - 0.42, 0.84), facecolors=fc, edgecolors="white", linewidth=0.15)
        waits = [((r.wait_start - t0) * 1e6, (r.start - r.wait_start) * 1e6) for r in rs
                 if r.wait_start is not None and r.start > r.wait_start]
        if waits:
            ax.broken_barh(waits, (s - 0.12, 0.24), facecolors="#bbbbbb", edgecolors="none")
    if crit:
        cr = [r for r in recs if r.index in crit]
        for s in {r.sm for r in cr}:
            xr = [((r.start - t0) * 1e6, (r.end - r.start) * 1e6) for r in cr if r.sm == s]
            ax.broken_barh(xr, (s - 0.5, 1.0), facecolors="none", edgecolors="black", linewidth=0.9)
    ax.set_ylim(num_sms - 0.5, -0.5)
    step = 8 if num_sms > 32 else (4 if num_sms > 8 else 1)
    ax.set_yticks(range(0, num_sms, step))
    ax.set_ylabel("SM")
    ax.set_xlabel("time (µs)")
    ax.set_xlim(0, (t1 - t0) * 1e6 * 1.01)
    ax.grid(axis="x", color="#dddddd", lw=0.5)
    ax.set_axisbelow(True)
    handles = [Patch(fc=colors[op], label=op) for op in colors
               if any(prog.instrs[r.index].NAME == op for r in recs)]
    if any(r.wait_start is not None for r in recs):
        handles.append(Patch(fc="#bbbbbb", label="waiting on counters"))
    if crit:
        handles.append(Patch(fc="none", ec="black", label="critical path"))
    if lower_bound:
        ax.axvline(lower_bound * 1e6, color="black", ls=":", lw=1.2)
        handles.append(Line2D([], [], color="black", ls=":",
                              label=f"bytes/bandwidth bound {lower_bound * 1e6:.3g} µs"))
    fig.legend(handles=handles, loc="outside lower center", ncol=len(handles), fontsize=9, frameon=False)
    ax.set_title(title, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- graph files --------------------------------------------------------------------------------
def _exportable(G: nx.DiGraph) -> nx.DiGraph:
    """A copy with string node ids ('i12', 'c3') and scalar attributes (what DOT/GraphML hold);
    ``label`` gives Graphviz a readable node text."""
    def nid(n):
        if isinstance(n, int):
            return f"i{n}"
        return "_".join(str(x) for x in n)

    H = nx.DiGraph()
    H.graph["name"] = str(G.graph.get("name", ""))
    for n, d in G.nodes(data=True):
        a = {}
        for k, v in d.items():
            if v is None or v == "":
                continue
            k2 = "counter" if k == "name" else k
            if isinstance(v, dict):
                v = " ".join(f"{kk}={vv}" for kk, vv in v.items())
            elif isinstance(v, (list, tuple)):
                v = ",".join(map(str, v))
            elif isinstance(v, bool):
                v = int(v)
            a[k2] = v if isinstance(v, (int, float, str)) else str(v)
        if "label" not in a:
            if d.get("kind") == "counter":
                a["label"] = f"{d.get('name')} >= {d.get('target')}"
            elif d.get("kind") == "instr":
                a["label"] = f"{d['opcode']} " + a.get("operands", "")
        if isinstance(a.get("label"), str):
            a["label"] = a["label"].replace("\n", " ").replace("≥", ">=").replace("×", "x")
        H.add_node(nid(n), **a)
    for u, v, d in G.edges(data=True):
        H.add_edge(nid(u), nid(v), **{k: (val if isinstance(val, (int, float, str)) else str(val))
                                      for k, val in d.items() if val is not None})
    return H


def dot_writer():
    """networkx's DOT writer that can be imported here (pydot, then pygraphviz), or None."""
    try:
        import pydot  # noqa: F401
        return nx.nx_pydot.write_dot
    except ImportError:
        pass
    try:
        import pygraphviz  # noqa: F401
        return nx.nx_agraph.write_dot
    except ImportError:
        return None


def _quote(s) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _minimal_write_dot(H: nx.DiGraph, path) -> None:
    """Only used when neither pydot nor pygraphviz is installed (see :func:`write_graph`)."""
    with open(path, "w") as f:
        f.write(f"strict digraph {_quote(H.graph.get('name', ''))} {{\n")
        for n, d in H.nodes(data=True):
            attrs = ", ".join(f"{k}={_quote(v)}" for k, v in d.items())
            f.write(f"{_quote(n)} [{attrs}];\n")
        for u, v, d in H.edges(data=True):
            attrs = ", ".join(f"{k}={_quote(val)}" for k, val in d.items())
            f.write(f"{_quote(u)} -> {_quote(v)}" + (f" [{attrs}]" if attrs else "") + ";\n")
        f.write("}\n")


def write_graph(G: nx.DiGraph, stem, graphml: bool = False) -> list[pathlib.Path]:
    """``stem.dot`` through networkx's DOT writer (pydot or pygraphviz) and, with ``graphml``,
    ``stem.graphml`` (networkx's GraphML writer: reads back in a fraction of a second where
    pydot's DOT parser takes minutes for a 70B layer, and loads in Gephi / yEd / Cytoscape).
    Without pydot and pygraphviz the DOT file comes from a minimal writer here and GraphML is
    always written. Returns the files written."""
    H = _exportable(G)
    stem = pathlib.Path(stem)
    dot = stem.with_suffix(".dot")
    gml = stem.with_suffix(".graphml")
    w = dot_writer()
    if w is not None:
        w(H, dot)
    else:
        print("viz: neither pydot nor pygraphviz is installed: writing DOT with a minimal writer "
              "(pip install pydot for networkx's)", file=sys.stderr)
        _minimal_write_dot(H, dot)
        graphml = True
    if graphml:
        nx.write_graphml(H, gml)
        return [dot, gml]
    return [dot]


# ---- everything at once (``megatape viz``) ------------------------------------------------------
def render(cfg: ModelConfig, num_sms: int, out, max_seq: int | None = None, policy: str = "cost",
           stage=None, layer: int | None = None, sm: int | None = None, max_nodes: int = 120,
           aggregate: str = "auto", svg: bool = True, tiling=None, lowering=None) -> list[pathlib.Path]:
    """Compile ``cfg`` for ``num_sms`` SMs (a whole-model config gets the decoder lowering, as
    :func:`schedule.compile_model` decides) and write every picture, graph file and the planned
    trace described in the module docstring into ``out`` (created). ``stage`` / ``layer`` / ``sm``
    select a zoom; ``tiling`` overrides the config's default :class:`opcodes.Tiling`; ``lowering`` the program's
    (a rows program: ``megatape viz --rows``). Prints one
    ``wrote PATH (N KiB)`` line per file and a timing line; returns the
    paths. A selection that matches nothing raises ValueError before anything is written."""
    t_start = time.perf_counter()
    from schedule.compile import compile_model

    if max_nodes <= 0:
        raise ValueError(f"--max-nodes must be positive, got {max_nodes}")
    out = pathlib.Path(out)
    comp = compile_model(cfg, num_sms, max_seq=max_seq, tiling=tiling, policy=policy, lowering=lowering)
    prog, sched = comp.prog, comp.sched
    written: list[pathlib.Path] = []
    timings: dict[str, float] = {"compile": comp.seconds}
    exts = (".png",) if not svg else (".png", ".svg")
    head = (f"{cfg.name}: {len(prog)} tiles, {len(prog.counters)} counters, {num_sms} SMs, "
            f"policy {sched.policy}")

    def tick(name, t):
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t

    # the zoom first: a selection that matches nothing fails before any file is written
    zoom = None
    if stage is not None or layer is not None or sm is not None:
        t = time.perf_counter()
        zoom = zoom_dag(prog, sched, stage, layer, sm, max_nodes)
        tick("zoom picture", t)
    out.mkdir(parents=True, exist_ok=True)

    # aggregate DAG picture
    t = time.perf_counter()
    agg = aggregate_dag(prog, aggregate)
    by = agg.graph["by"]
    what = ("one box per (layer, opcode, counter signalled)" if by == "signal"
            else "one box per (layer, opcode), one grey box per (layer, counter family)")
    paths = [out / f"dag{e}" for e in exts]
    draw_dag(agg, f"tile DAG of {head}\n{what}; ×N: tiles in the box, ≥T: counter target", paths)
    written += paths
    tick("dag picture", t)

    # zoom
    if zoom is not None:
        t = time.perf_counter()
        zg, note = zoom
        parts = [f"stage-{stage}" if stage is not None else "", f"layer-{layer}" if layer is not None else "",
                 f"sm-{sm}" if sm is not None else ""]
        stem = "dag_zoom_" + "_".join(p for p in parts if p)
        paths = [out / f"{stem}{e}" for e in exts]
        draw_dag(zg, f"tiles of {head}\n{note}", paths)
        written += paths
        tick("zoom picture", t)

    # graph files
    t = time.perf_counter()
    G = build_dag(prog, counters_as_nodes=True, model=comp.model, num_sms=num_sms)
    written += write_graph(G, out / "dag", graphml=True)
    written += write_graph(agg, out / "dag_agg")
    tick("graph files", t)

    # planned timeline
    t = time.perf_counter()
    recs = T.planned_records(sched)
    crit = T.critical_path(recs, prog)
    lb = comp.model.lower_bound(prog)
    gpath = out / "plan_gantt.png"
    gantt(recs, prog, num_sms, gpath,
          f"planned schedule of {head}\nmakespan {sched.makespan * 1e6:.1f} µs, bytes/bandwidth bound "
          f"{lb * 1e6:.1f} µs, critical path {len(crit)} tiles", critical=crit, lower_bound=lb)
    written.append(gpath)
    tick("gantt", t)

    t = time.perf_counter()
    tr = T.to_trace_events(recs, prog, process_name=f"megatape plan: {head}", num_sms=num_sms, critical=crit,
                           metadata={"kind": "planned", "preset": cfg.name, "num_sms": num_sms,
                                     "policy": sched.policy, "makespan_us": sched.makespan * 1e6,
                                     "lower_bound_us": lb * 1e6, "max_seq": prog.lay.max_seq})
    tpath = out / "plan_trace.json"
    T.write_trace(tpath, tr)
    written.append(tpath)
    tick("trace", t)

    for p in written:
        print(f"wrote {p} ({os.path.getsize(p) / 1024:.0f} KiB)")
    total = time.perf_counter() - t_start
    print("time: " + ", ".join(f"{k} {v:.2f} s" for k, v in timings.items()) + f"; total {total:.2f} s")
    return written
