"""
Visualize the schedule graph
============================

A compiled tape is a DAG of tiles (instructions) connected through counters, cut into per-SM
queues by a scheduler that also predicts when each tile runs. In this tutorial you will learn how
to look at all three with ``megatape.views``:

* the tile DAG, aggregated (one box per layer, opcode and counter signalled, so that thousands of
  tiles read at a glance) and zoomed (the tiles of one stage, or one SM's queue, one by one), plus
  the full DAG as DOT / GraphML files for other tools;
* the planned schedule: a Gantt chart with one row per SM and the critical path outlined, and the
  same plan as a Chrome / Perfetto trace (open it at https://ui.perfetto.dev);
* on a GPU, the *measured* schedule: a profiling build of the kernel records per-instruction
  timestamps, which become a Perfetto trace, a Gantt chart and a planned-vs-measured table.

``megatape viz --preset NAME --sms N --out DIR`` draws the same pictures in one command. Run this
with ``python examples/02_schedule_graph.py [--out DIR]`` (CPU: ``small-2layer`` on 8 SMs, a few
seconds; on a GPU the 70B layer on every SM). Needs matplotlib (``pip install 'megatape[plots]'``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # run from a clone: no install needed

import torch  # noqa: E402  (torch does not import triton)

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from megatape.views import trace as T  # noqa: E402
from megatape.views import viz  # noqa: E402  (matplotlib, Agg backend)
from opcodes import ModelConfig  # noqa: E402
from schedule import build_dag, compile_model  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--preset", default="llama70b-layer" if CUDA else "small-2layer")
    ap.add_argument("--sms", type=int, default=None, help="SMs to compile for (default: the GPU's, or 8)")
    ap.add_argument("--out", default=None, help="output directory (default: a temporary directory)")
    a = ap.parse_args(argv)
    sms = a.sms or (torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 8)
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="megatape-02-"))
    out.mkdir(parents=True, exist_ok=True)
    written = []

    # %%
    # 1. Compile
    # ----------
    cfg = ModelConfig.from_name(a.preset)
    max_seq = 256 if cfg.d < 1024 else 4224
    comp = compile_model(cfg, sms, max_seq=max_seq)
    prog, sched = comp.prog, comp.sched
    head = f"{cfg.name}, {len(prog)} tiles, {sms} SMs"
    print(f"== 1. compiled {head}: {len(prog.counters)} counters, planned makespan {sched.makespan * 1e6:.1f} us")

    # %%
    # 2. The DAG, aggregated
    # ----------------------
    # ``aggregate_dag`` merges tiles into one node per (layer, opcode, counter signalled), with the
    # tile count, and keeps one grey node per counter with its target; ``draw_dag`` lays it out in
    # columns by stage and colours nodes by opcode.
    agg = viz.aggregate_dag(prog)
    viz.draw_dag(agg, f"tile DAG of {head} (aggregated)", [out / "dag.png"])
    written.append(out / "dag.png")
    print(f"== 2. aggregated DAG: {agg.number_of_nodes()} nodes (from {len(prog)} tiles + "
          f"{len(prog.counters)} counters), {agg.number_of_edges()} edges")

    # %%
    # 3. The DAG, zoomed
    # ------------------
    # ``zoom_dag`` keeps the tiles of one stage (opcode name), one layer or one SM, one node each,
    # with the counters they touch; with ``sm`` it also draws that SM's queue order.
    for what, kw in (("stage-gate_up", dict(stage="gate_up")), ("sm-0", dict(sm=0))):
        g, note = viz.zoom_dag(prog, sched, max_nodes=40, **kw)
        viz.draw_dag(g, f"{head}: {note}", [out / f"dag_zoom_{what}.png"])
        written.append(out / f"dag_zoom_{what}.png")
        print(f"== 3. zoom {what}: {g.number_of_nodes()} nodes ({note})")

    # %%
    # 4. The full DAG as graph files
    # ------------------------------
    # Every tile and every counter, with the planned start/finish times as node attributes, through
    # networkx's DOT and GraphML writers (open the GraphML in Gephi or read it back with networkx).
    G = build_dag(prog, counters_as_nodes=True, model=comp.model, num_sms=sms)
    written += viz.write_graph(G, out / "dag", graphml=True)
    print(f"== 4. full DAG: {G.number_of_nodes()} nodes, {G.number_of_edges()} edges")

    # %%
    # 5. The planned schedule
    # -----------------------
    # ``planned_records`` turns the simulated schedule into one record per tile (SM, start, end and
    # when its SM began waiting for it); the critical path is the chain of tiles that bounded the end.
    recs = T.planned_records(sched)
    crit = T.critical_path(recs, prog)
    lb = comp.model.lower_bound(prog)
    viz.gantt(recs, prog, sms, out / "plan_gantt.png", f"planned schedule of {head}", critical=crit, lower_bound=lb)
    tr = T.to_trace_events(recs, prog, num_sms=sms, critical=crit, process_name=f"megatape plan: {head}")
    T.write_trace(out / "plan_trace.json", tr)
    written += [out / "plan_gantt.png", out / "plan_trace.json"]
    print(f"== 5. plan: makespan {sched.makespan * 1e6:.1f} us, bound {lb * 1e6:.1f} us, critical path "
          f"{len(crit)} tiles: {' -> '.join(prog.instrs[i].NAME for i in crit[:6])}{' ...' if len(crit) > 6 else ''}")

    # %%
    # 6. A measured trace (GPU)
    # -------------------------
    # A profiling build (``profile=True``) records (wait start, exec start, end, SM) per instruction
    # with the GPU's global timer. Building from the same tape keeps plan and measurement comparable.
    if CUDA:
        from interp import build_layer, layer_step, teardown
        from interp.profile import records
        from interp.runtime import profile_records
        from megatape.views import format_summary, summarize, write_views
        from opcodes.reference import make_kv_cache, make_weights
        dev = torch.device("cuda")
        prefill = max_seq - 2
        h = build_layer(make_weights(cfg, device=dev), make_kv_cache(cfg, max_seq, prefill, device=dev),
                        cfg.to_dict(), max_seq, tape=comp.tape, profile=True)
        x = torch.randn(1, cfg.d, device=dev).to(torch.bfloat16)
        for _ in range(3):                          # the last launch's timestamps are kept
            layer_step(h, x, prefill)
        prof = profile_records(h)
        print(format_summary(summarize(comp.tape, prof, pos=prefill)))
        written += write_views(records(comp.tape, prof), prog, sched, out, sms)   # measured_{trace.json,gantt.png,vs_plan.md}
        print("== 6. measured:", (out / "measured_vs_plan.md").read_text().splitlines()[0])
        teardown(h)
    else:
        print("== 6. no GPU: no measured trace (on a GPU this writes measured_trace.json, "
              "measured_gantt.png and measured_vs_plan.md)")

    for p in written:
        print(f"wrote {p} ({p.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
