"""The tile DAG of a program as a networkx graph.

Nodes are program indices (``kind='instr'``) and, by default, one node per counter
(``kind='counter'``): producer -> counter -> consumer. With counters as nodes the graph stays linear
in size even where a stage is all-to-all (every gate/up tile waits for every O tile).
"""
from __future__ import annotations

import networkx as nx

from opcodes.base import NO_COUNTER

from .assign import CostModel
from .program import Program


def _layer(ins) -> int:
    return getattr(ins, "layer", 0)


def build_dag(prog: Program, counters_as_nodes: bool = True, model: CostModel | None = None,
              num_sms: int | None = None) -> nx.DiGraph:
    """The tile DAG of ``prog``.

    Nodes: program indices (``kind='instr'``, with ``opcode``, ``stage``, ``layer``, ``operands``
    (a dict), ``hbm_bytes``, ``l2_bytes``, ``flops`` and, when ``num_sms`` is given, ``cost``: the
    predicted seconds under ``model``), and with ``counters_as_nodes`` one node ``('ctr', id)`` per
    counter (``kind='counter'``, ``name``, ``target`` = number of producers). Edges: producer ->
    counter -> consumer. Without counter nodes, every producer of a counter gets an edge to every
    consumer (``counter`` = its name): all-to-all stages make that quadratic, so prefer the default.
    """
    G = nx.DiGraph(name=prog.lay.cfg.name)
    model = model or CostModel()
    lay = prog.lay
    for i, ins in enumerate(prog.instrs):
        c = ins.cost(lay)
        attrs = dict(kind="instr", opcode=ins.NAME, stage=ins.STAGE, layer=_layer(ins),
                     operands=dict(zip(ins.operand_names(), ins.operands())),
                     hbm_bytes=c.hbm_bytes, l2_bytes=c.l2_bytes, flops=c.flops)
        if num_sms is not None:
            attrs["cost"] = model.time(prog, i, num_sms)
        G.add_node(i, **attrs)
    targets = prog.targets()
    if counters_as_nodes:
        for c, name in enumerate(prog.counters):
            G.add_node(("ctr", c), kind="counter", name=name, target=targets[c])
        for i, s in enumerate(prog.signal):
            if s != NO_COUNTER:
                G.add_edge(i, ("ctr", s))
        for i, ws in enumerate(prog.waits):
            for c in ws:
                G.add_edge(("ctr", c), i)
    else:
        cons = prog.consumers()
        for c, ps in enumerate(prog.producers()):
            for p in ps:
                for q in cons[c]:
                    G.add_edge(p, q, counter=prog.counters[c])
    return G


def critical_path_seconds(prog: Program, num_sms: int, model: CostModel | None = None) -> float:
    """Length of the longest path through the DAG under ``model`` (a lower bound on the makespan
    with unlimited SMs)."""
    G = build_dag(prog, model=model, num_sms=num_sms)
    for n, d in G.nodes(data=True):
        d["w"] = d.get("cost", 0.0)
    best = {}
    for n in nx.topological_sort(G):
        w = G.nodes[n]["w"]
        best[n] = w + max((best[p] for p in G.predecessors(n)), default=0.0)
    return max(best.values(), default=0.0)
