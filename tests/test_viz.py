"""CPU tests of ``megatape viz`` (megatape/views/viz.py) and the trace writer (megatape/views/trace.py)."""
from __future__ import annotations

import json
import pathlib
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib.image as mpimg  # noqa: E402
import networkx as nx  # noqa: E402

from opcodes import ModelConfig  # noqa: E402
from schedule import compile_model  # noqa: E402
from megatape.cli import main  # noqa: E402
from megatape.views import trace as T  # noqa: E402
from megatape.views import viz  # noqa: E402

# pydot's parser uses pyparsing names that pyparsing 3.3 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated.*:DeprecationWarning")

try:
    import pydot  # noqa: F401
    HAVE_PYDOT = True
except ImportError:
    HAVE_PYDOT = False


def _check_trace(path: pathlib.Path, prog, num_sms: int) -> None:
    tr = json.loads(path.read_text())
    assert tr["displayTimeUnit"] == "ns"
    ev = tr["traceEvents"]
    assert isinstance(ev, list) and ev
    for e in ev:
        assert e["ph"] in ("X", "M", "s", "f"), e
        assert "pid" in e and "name" in e
    slices = [e for e in ev if e["ph"] == "X" and e["cat"] == "instr"]
    # exactly one slice per instruction, named by its opcode, with its operands and counters
    per_index = Counter(e["args"]["index"] for e in slices)
    assert sorted(per_index) == list(range(len(prog)))
    assert set(per_index.values()) == {1}
    targets = prog.targets()
    for e in slices:
        i = e["args"]["index"]
        ins = prog.instrs[i]
        assert e["name"] == ins.NAME
        assert e["args"]["operands"] == dict(zip(ins.operand_names(), ins.operands()))
        assert [w["counter"] for w in e["args"]["waits"]] == [prog.counters[c] for c in prog.waits[i]]
        assert [w["target"] for w in e["args"]["waits"]] == [targets[c] for c in prog.waits[i]]
        assert e["args"]["sm"] == e["tid"]
        assert e["dur"] >= 0 and e["ts"] >= 0
    # one track per SM used, each named, and no overlap on a track
    used = {e["tid"] for e in slices}
    assert used <= set(range(num_sms))
    names = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M" and e["name"] == "thread_name"}
    for s in used:
        assert names[s] == f"SM {s}"
    assert any(e["ph"] == "M" and e["name"] == "process_name" for e in ev)
    per_tid = defaultdict(list)
    for e in ev:
        if e["ph"] == "X":
            per_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    for s, spans in per_tid.items():
        spans.sort()
        for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
            assert a1 <= b0 + 1e-6, f"slices overlap on SM {s}: [{a0}, {a1}] and [{b0}, {b1}]"
    # flows come in pairs
    fl = Counter(e["ph"] for e in ev if e["ph"] in "sf")
    assert fl["s"] == fl["f"]


def _check_png(path: pathlib.Path) -> tuple[int, int]:
    img = mpimg.imread(path)
    assert img.ndim == 3 and img.shape[2] in (3, 4) and img.shape[0] > 100 and img.shape[1] > 100, img.shape
    return img.shape[:2]


def _run(tmp_path, argv, capsys):
    assert main(["viz"] + argv + ["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    written = [pathlib.Path(line.split()[1]) for line in out.splitlines() if line.startswith("wrote ")]
    assert "total" in out.splitlines()[-1]
    for p in written:
        assert p.exists() and p.stat().st_size > 0, p
    return written


def _check_outputs(d: pathlib.Path, comp, num_sms: int, svg: bool = True) -> None:
    prog = comp.prog
    for name in ["dag.png", "dag.dot", "dag.graphml", "dag_agg.dot", "plan_gantt.png", "plan_trace.json"] + (
            ["dag.svg"] if svg else []):
        assert (d / name).exists() and (d / name).stat().st_size > 0, name
    for png in d.glob("*.png"):
        _check_png(png)
    for svgf in d.glob("*.svg"):
        assert ET.parse(svgf).getroot().tag.endswith("svg")
    _check_trace(d / "plan_trace.json", prog, num_sms)
    # the full DAG reads back with the right size (GraphML: fast at any size)
    G = nx.read_graphml(d / "dag.graphml")
    assert G.number_of_nodes() == len(prog) + len(prog.counters)
    assert G.number_of_edges() == sum(s >= 0 for s in prog.signal) + sum(len(w) for w in prog.waits)
    agg = viz.aggregate_dag(prog)
    if HAVE_PYDOT:
        A = nx.nx_pydot.read_dot(d / "dag_agg.dot")
        assert A.number_of_nodes() == agg.number_of_nodes()
        assert A.number_of_edges() == agg.number_of_edges()


def test_tiny(tmp_path, capsys):
    _run(tmp_path, ["--preset", "tiny", "--sms", "4"], capsys)
    comp = compile_model(ModelConfig.from_name("tiny"), 4)
    _check_outputs(tmp_path, comp, 4)
    if HAVE_PYDOT:   # pydot's parser is slow, so the full DOT file is read back only here
        G = nx.nx_pydot.read_dot(tmp_path / "dag.dot")
        assert G.number_of_nodes() == len(comp.prog) + len(comp.prog.counters)


def test_tiny_zoom(tmp_path, capsys):
    written = _run(tmp_path, ["--preset", "small-2layer", "--sms", "8", "--policy", "round-robin", "--sm", "3",
                                 "--layer", "1", "--no-svg"], capsys)
    names = {p.name for p in written}
    assert "dag_zoom_layer-1_sm-3.png" in names
    assert not any(p.suffix == ".svg" for p in written)
    _check_png(tmp_path / "dag_zoom_layer-1_sm-3.png")
    comp = compile_model(ModelConfig.from_name("small-2layer"), 8, policy="round-robin")
    _check_trace(tmp_path / "plan_trace.json", comp.prog, 8)


def test_a_rows_program(tmp_path, capsys):
    """``megatape viz --rows``: the many-rows kernel's tape (its counter ``embed`` has no layer index), every file
    written; the column headers name the opcodes drawn (the rows ones), not every opcode of their stage."""
    from opcodes.rows import rows_tiling
    from schedule.rows_program import rows_lowering
    _run(tmp_path, ["--preset", "llama3.2-1b", "--layers", "1", "--sms", "8", "--max-seq", "256", "--rows", "16",
                    "--no-svg"], capsys)
    cfg = ModelConfig.from_name("llama3.2-1b").with_layers(1)
    comp = compile_model(cfg, 8, max_seq=256, tiling=rows_tiling(cfg, 16, 256), lowering=rows_lowering(16, 1))
    _check_outputs(tmp_path, comp, 8, svg=False)
    import matplotlib.pyplot as plt
    seen = []
    real_text = plt.Axes.text
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plt.Axes, "text", lambda ax, x, y, s, *a, **k: (seen.append(s), real_text(ax, x, y, s, *a, **k))[1])
        viz.draw_dag(viz.aggregate_dag(comp.prog), "t", [tmp_path / "again.png"])
    assert "gate_up_r" in seen and not any("/" in s and "gate_up_r" in s for s in seen), seen


def test_llama70b_layer(tmp_path, capsys):
    """(Its 30 s limit is measured in tests/test_gpu.py: CPU tests assert no wall-clock times.)"""
    _run(tmp_path, ["--preset", "llama70b-layer", "--sms", "132"], capsys)
    comp = compile_model(ModelConfig.from_name("llama70b-layer"), 132)
    _check_outputs(tmp_path, comp, 132)
    # the aggregate picture stays small whatever the tile count
    assert viz.aggregate_dag(comp.prog).number_of_nodes() <= viz.MAX_AGG_NODES
    h, w = _check_png(tmp_path / "plan_gantt.png")
    assert h > 800    # 132 rows must not be squashed


def test_build_dag():
    comp = compile_model(ModelConfig.from_name("small-2layer"), 8)
    prog = comp.prog
    G = viz.build_dag(prog, num_sms=8)
    assert nx.is_directed_acyclic_graph(G)
    assert G.number_of_nodes() == len(prog) + len(prog.counters)
    for c, t in enumerate(prog.targets()):
        assert G.nodes[("ctr", c)]["target"] == t == G.in_degree(("ctr", c))
        assert G.nodes[("ctr", c)]["name"] == prog.counters[c]
    d = G.nodes[0]
    assert d["opcode"] == prog.instrs[0].NAME and d["stage"] == prog.instrs[0].STAGE and d["layer"] == 0
    assert d["cost"] > 0 and isinstance(d["operands"], dict)
    # without counter nodes: producer -> consumer edges, same reachability
    H = viz.build_dag(prog, counters_as_nodes=False)
    assert H.number_of_nodes() == len(prog)
    assert nx.is_directed_acyclic_graph(H)
    last = len(prog) - 1
    assert nx.ancestors(H, last) == {n for n in nx.ancestors(G, last) if isinstance(n, int)}
    # the aggregate keeps every tile exactly once
    A = viz.aggregate_dag(prog, "signal")
    assert sum(d["count"] for _, d in A.nodes(data=True) if d["kind"] == "group") == len(prog)
    B = viz.aggregate_dag(prog, "opcode")
    assert B.number_of_nodes() < A.number_of_nodes()


def test_zoom_cap_and_errors():
    comp = compile_model(ModelConfig.from_name("llama70b-layer"), 132)
    G, note = viz.zoom_dag(comp.prog, comp.sched, stage="gate_up", max_nodes=50)
    assert sum(1 for _, d in G.nodes(data=True) if d["kind"] == "instr") == 50
    assert "showing 50" in note
    G, note = viz.zoom_dag(comp.prog, comp.sched, sm=7)
    # SM 7's queue and the pool instructions the plan's simulation gave it
    assert sum(1 for _, d in G.nodes(data=True) if d["kind"] == "instr") == len(comp.sched.per_sm()[7])
    assert len(comp.sched.per_sm()[7]) > len(comp.sched.queues[7])
    with pytest.raises(ValueError, match="unknown stage"):
        viz.zoom_dag(comp.prog, comp.sched, stage="nope")
    with pytest.raises(ValueError, match="out of range"):
        viz.zoom_dag(comp.prog, comp.sched, sm=132)


def test_trace_measured_records():
    """The same writer takes measured records: waits become their own slices, the critical path
    follows whatever bounded the end."""
    comp = compile_model(ModelConfig.from_name("tiny"), 2, pool_us=0)     # hand-made clocks per queue
    prog, sched = comp.prog, comp.sched
    recs = []
    for sm, q in enumerate(sched.queues):
        t = 1.0 + sm * 1e-6          # arbitrary origin: the trace starts at 0
        for i in q:
            recs.append((i, sm, t + 0.5e-6, t + 2e-6, t))
            t += 2e-6
    tr = T.to_trace_events(recs, prog, num_sms=2)
    ev = tr["traceEvents"]
    waits = [e for e in ev if e["ph"] == "X" and e["cat"] == "wait"]
    instr = [e for e in ev if e["ph"] == "X" and e["cat"] == "instr"]
    assert len(waits) == len(instr) == len(prog)
    assert min(e["ts"] for e in ev if e["ph"] == "X") == 0.0
    assert all(e["args"]["wait_us"] == pytest.approx(0.5) for e in instr)
    path = T.critical_path(recs, prog)
    assert path and path[-1] == max(recs, key=lambda r: r[3])[0]
    s = T.summary(recs, prog)
    assert s["wait"][0] == pytest.approx(0.5e-6 * len(sched.queues[0]))


def test_planned_records_match_schedule():
    comp = compile_model(ModelConfig.from_name("small-gqa4"), 5, policy="round-robin")
    recs = T.planned_records(comp.sched)
    assert sorted(r.index for r in recs) == list(range(len(comp.prog)))
    for r in recs:
        assert r.start == comp.sched.start[r.index] and r.end == comp.sched.finish[r.index]
        if r.wait_start is not None:
            assert r.wait_start < r.start
    crit = T.critical_path(recs, comp.prog)
    ends = {r.index: r.end for r in recs}
    assert ends[crit[-1]] == pytest.approx(comp.sched.makespan)
    starts = {r.index: r.start for r in recs}
    for a, b in zip(crit, crit[1:]):
        assert ends[a] <= starts[b] + 1e-12


def test_dot_fallback_without_pydot(tmp_path, monkeypatch, capsys):
    """Without pydot / pygraphviz: GraphML from networkx and a DOT file that still parses."""
    monkeypatch.setattr(viz, "dot_writer", lambda: None)
    comp = compile_model(ModelConfig.from_name("tiny"), 3)
    G = viz.build_dag(comp.prog, num_sms=3)
    files = viz.write_graph(G, tmp_path / "dag")
    assert sorted(p.name for p in files) == ["dag.dot", "dag.graphml"]
    assert "minimal writer" in capsys.readouterr().err
    assert nx.read_graphml(tmp_path / "dag.graphml").number_of_nodes() == G.number_of_nodes()
    if HAVE_PYDOT:
        D = nx.nx_pydot.read_dot(tmp_path / "dag.dot")
        assert D.number_of_nodes() == G.number_of_nodes()
        assert D.number_of_edges() == G.number_of_edges()


def test_cli_errors(tmp_path, capsys):
    assert main(["viz", "--preset", "nope", "--sms", "4", "--out", str(tmp_path / "a")]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err
    assert main(["viz", "--preset", "tiny", "--sms", "4", "--layer", "5", "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "no instruction matches layer 5" in err
    assert not (tmp_path / "b").exists()
