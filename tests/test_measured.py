"""megatape/views/measured.py and megatape/views/profile.py: the views of a measured timeline, fed with a synthetic 'measurement' (the plan
itself, slowed down by a known factor), so every number it prints can be checked."""
from __future__ import annotations

import json
import statistics

import matplotlib.image as mpimg
import torch

from opcodes import PRESETS
from schedule import compile_model
from megatape.views.measured import compare, to_records, write_views


def _raw_from_plan(comp, slow: float = 1.25):
    """Per tape slot (slot, program index, opcode, sm, wait_ns, exec_ns, end_ns), like
    interp.profile.records, from the planned schedule stretched by ``slow``. Pool instructions run
    on the SM the plan's simulation gave them (the kernel records the SM that took the ticket)."""
    sm_of = comp.sched.sm_of()
    out = []
    for slot, pi in enumerate(comp.tape.prog_index):
        s, e = comp.sched.start[pi] * slow * 1e9, comp.sched.finish[pi] * slow * 1e9
        out.append((slot, pi, comp.prog.instrs[pi].NAME, sm_of[pi], s, s, e))
    return out


def test_compare_reports_the_known_slowdown():
    comp = compile_model(PRESETS["small-2layer"], 4, max_seq=64)
    recs = to_records(_raw_from_plan(comp, 1.25))
    txt = compare(recs, comp.prog, comp.sched)
    assert "(measured / planned = 1.250)" in txt
    for name in {ins.NAME for ins in comp.prog.instrs}:
        row = [ln for ln in txt.splitlines() if ln.startswith(f"| {name} |")]
        assert row and row[0].split("|")[5].strip() == "1.25", row
    assert "measured critical path:" in txt


def test_write_views_files(tmp_path):
    comp = compile_model(PRESETS["tiny"], 3, max_seq=64)
    files = write_views(_raw_from_plan(comp), comp.prog, comp.sched, tmp_path, 3)
    names = {f.name for f in files}
    assert names == {"measured_trace.json", "measured_gantt.png", "measured_vs_plan.md"}
    tr = json.loads((tmp_path / "measured_trace.json").read_text())
    slices = [e for e in tr["traceEvents"] if e.get("ph") == "X" and e.get("cat") == "instr"]
    assert len(slices) == len(comp.tape)
    assert {e["tid"] for e in slices} <= {0, 1, 2}
    img = mpimg.imread(tmp_path / "measured_gantt.png")
    assert img.shape[0] > 100 and img.shape[1] > 100


def test_profile_summary_of_synthetic_timestamps():
    """megatape.views.profile.summarize on hand-made timestamps: busy, wait and bytes per opcode add up."""
    import torch

    from megatape.views.profile import format_summary, summarize, timeline_line
    comp = compile_model(PRESETS["tiny"], 2, max_seq=64, pool_us=0)     # hand-made clocks per queue
    tape = comp.tape
    sm_of = tape.sm_of_slot()
    prof = torch.zeros(len(tape), 4, dtype=torch.int64)
    clock = [1000, 1000]
    for slot in range(len(tape)):
        s = sm_of[slot]
        prof[slot] = torch.tensor([clock[s], clock[s] + 100, clock[s] + 1100, s])   # 100 ns wait, 1 us busy
        clock[s] += 1100
    summ = summarize(tape, prof, pos=40)
    assert summ["total_wait_ns"] == 100 * len(tape)
    assert summ["total_busy_ns"] == 1000 * len(tape)
    assert sum(d["n"] for d in summ["ops"].values()) == len(tape)
    assert summ["makespan_ns"] == max(clock) - 1000
    assert "measured makespan" in format_summary(summ)
    assert timeline_line(summ).startswith(f"makespan {summ['makespan_ns'] / 1e3:.1f}; wait 9.1%")


def test_profile_critical_path_and_fixed_cost():
    """Per stage of a layer: what it adds after the previous stage's last end, and the hop of its
    late instructions; per opcode: the time over what the bytes take at an even share."""
    from megatape.views.profile import critical_path, format_summary, layer_period, layer_timeline, summarize
    # two layers 20 us apart, stages 0 (a) and 1 (b): b's first waiting instruction starts 2 us after
    # a's end; layer 1's a waits from 14 us, before layer 0's b ends (15 us), and starts at 20 us
    t = [0, 20_000]
    recs = {l: [(0, "a", t[l] - 6_000 * l, t[l], t[l] + 10_000 + l), (0, "a", t[l], t[l], t[l] + 8_000),
                (1, "b", t[l] + 500, t[l] + 12_000 + l, t[l] + 15_000 + 3 * l),
                (1, "b", t[l] + 9_000, t[l] + 9_500, t[l] + 11_000)] for l in (0, 1)}
    rows = critical_path(recs)
    tl_ = layer_timeline(recs)
    assert tl_["layer"] == 1 and [r["stage"] for r in tl_["rows"]] == ["a", "b"]
    a, b = tl_["rows"]
    assert (a["n"], a["exec_ns"], a["end_ns"], a["median_wait_ns"]) == (2, (0, 0), (8_000, 10_001), 3_000)
    # b's instructions start 9.5 us and 12.001 us after the layer's first start: the late tile shows
    assert (b["wait0_ns"], b["exec_ns"], b["end_ns"]) == (500, (9_500, 12_001), (11_000, 15_003))
    assert b["median_exec_ns"] == (1_500 + 3_002) / 2 and b["median_wait_ns"] == (500 + 11_501) / 2
    # a: only layer 1's, after layer 0's b (30.001 us - 15 us), its hop from 15 us to its start at 20
    assert [r["stage"] for r in rows] == ["a", "b"]
    assert (rows[0]["adds_ns"], rows[0]["hop_ns"], rows[0]["layers"]) == (15_001, 5_000, 1)
    assert rows[1]["adds_ns"] == 5_000 + 1                 # median of 5000 and 5002
    assert (rows[1]["hop_ns"], rows[1]["layers"]) == (2_000, 2)      # 12000 - 10000, both layers
    # a whole layer: layer 1's last end (35.003 us) after layer 0's (15 us)
    assert layer_period(recs) == dict(ns=20_003, layers=1)
    assert layer_period({0: recs[0]}) is None
    comp = compile_model(PRESETS["tiny"], 1, max_seq=64, pool_us=0)
    tape = comp.tape
    prof = torch.zeros(len(tape), 4, dtype=torch.int64)
    for slot in range(len(tape)):
        prof[slot] = torch.tensor([2000 * slot, 2000 * slot, 2000 * slot + 2000, 0])   # 2 us each
    summ = summarize(tape, prof, pos=40, copy_Bps=1e12)    # 1 kB/ns on one SM
    from schedule.tape import decode
    for name, d in summ["ops"].items():
        byts = [x.ins.cost(tape.lay).hbm_bytes for x in decode(tape) if x.ins.NAME == name]
        if name != "attn_partial":
            assert d["fixed_ns"] == statistics.median(2000 - b / 1e3 for b in byts), name
    assert "hop us" in format_summary(summ) and summ["stages"]
    assert "streamed faster than that share" in format_summary(summ)
    assert "as it ran" in format_summary(summ) and summ["layer_timeline"]["layer"] == 0


def test_instruction_rows_name_every_slot_and_survive_json():
    """interp.profile.instruction_rows (what the benches' --profile write): one row per tape slot with
    its layer and its instruction as text, taken from the tape's words, through JSON unchanged."""
    from interp.profile import instruction_rows, records
    comp = compile_model(PRESETS["small-2layer"], 3, max_seq=64)
    tape = comp.tape
    prof = torch.zeros(len(tape), 4, dtype=torch.int64)
    for slot in range(len(tape)):
        prof[slot] = torch.tensor([10 * slot, 10 * slot + 2, 10 * slot + 7, slot % 3])
    rows = instruction_rows(tape, records(tape, prof))
    assert json.loads(json.dumps(rows)) == rows and len(rows) == len(tape)
    for row in rows:
        ins = comp.prog.instrs[tape.prog_index[row[0]]]
        assert row[1] == ins.NAME and row[2] == ins.layer and row[7] == str(ins)
        assert row[3] == row[0] % 3 and row[6] - row[5] == 5
    assert {r[2] for r in rows} == {0, 1}


def test_records_stage_table_orders_stages_and_names_the_last_to_end(tmp_path):
    """bench.records on a hand-made records file: stages in the order they start, times from the
    layer's first wait, the instruction that ends last listed, a missing layer named."""
    import gzip

    import pytest

    from bench import records as R
    rows = [[0, "qkv", 1, 0, 1000, 2000, 9000, "qkv layer=1 sec=0 head=0 j=0"],
            [1, "qkv", 1, 1, 1000, 2000, 12000, "qkv layer=1 sec=1 head=0 j=0"],
            [2, "oproj", 1, 0, 9000, 13000, 20000, "oproj layer=1 row0=0 oc=0"],
            [3, "qkv", 0, 0, 0, 10, 20, "qkv layer=0 sec=0 head=0 j=0"]]
    path = tmp_path / "r.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(rows, f)
    lines = R.stage_table(R.load(str(path)), 1, tail=1)
    assert lines[0].startswith("layer 1: 3 instructions") and "19.00 us to its last end" in lines[0]
    assert lines[1].lstrip().startswith("qkv") and "exec     1.00..    1.00 end     8.00..   11.00" in lines[1]
    assert "qkv layer=1 sec=1 head=0 j=0" in lines[2] and "ends    11.00" in lines[2]
    assert lines[3].lstrip().startswith("oproj") and "wait med   4.00" in lines[3]
    with pytest.raises(ValueError, match="no instruction of layer 7"):
        R.stage_table(rows, 7)
    assert R.main([str(path), "--layer", "1"]) == 0


def test_records_per_sm_separates_slow_sms_from_noise():
    """bench.records --per-sm: an SM slow in every layer gives an even/odd correlation near 1, is named
    slowest, and balancing would end the stage earlier by its offset from the mean; the same spread
    shuffled between layers at random gives no correlation."""
    import random
    import re

    import pytest

    from bench import records as R
    rng = random.Random(3)
    speed = {sm: 1000 + 100 * sm for sm in range(8)}          # SM 7 the slowest in every layer
    rows, slot = [], 0
    for layer in range(16):
        for sm in range(8):
            t = speed[sm] + rng.randrange(10)
            rows.append([slot, "gate_up", layer, sm, 0, 50, 50 + t, f"gate_up layer={layer} row0={64 * sm}"])
            u = 1000 + rng.randrange(800)                       # no SM effect: noise only
            rows.append([slot + 1, "down", layer, sm, 0, 100000, 100000 + u, f"down layer={layer} row0={16 * sm} kc=0"])
            slot += 2
    rows.append([slot, "embed", -1, 0, 0, 0, 10, "embed col0=0"])
    lines = R.per_sm_table(rows, show=2)
    gu = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("gate_up"))
    assert "sms=  8" in lines[gu] and "1.00 /    1.36 /    1.71 us" in lines[gu]
    r_of = lambda ln: float(re.search(r"r=\s*(-?[\d.]+)", ln).group(1))     # noqa: E731
    r_gu = r_of(lines[gu])
    r_dn = r_of(next(ln for ln in lines if ln.lstrip().startswith("down")))
    assert r_gu > 0.95 and abs(r_dn) < 0.8
    # SM 7 (1.70 us) is 0.35 us over the mean (1.35): at the mean speed each layer's last end is that much earlier
    assert 0.3 < float(re.search(r"end\s+(-?[\d.]+) us earlier", lines[gu]).group(1)) < 0.4
    assert lines[gu + 1].split("slowest")[1].split()[0].startswith("7:")
    assert lines[gu + 1].split("fastest")[1].split()[0].startswith("0:")
    with pytest.raises(ValueError, match="no per-layer"):
        R.per_sm_table([[0, "embed", -1, 0, 0, 0, 10, "embed col0=0"]])


def test_kernel_span_splits_a_launch_around_its_instructions():
    """interp.profile.kernel_span: SM rows (entry, queue done, exit) around tape rows (wait, exec, end)."""
    import torch

    from interp.profile import format_kernel_span, kernel_span
    prof = torch.tensor([[3000, 3500, 9000, 0], [2500, 2600, 12000, 1]], dtype=torch.int64)
    sm = torch.tensor([[1000, 9100, 9900, 0], [1400, 12100, 13500, 1]], dtype=torch.int64)
    got = kernel_span(prof, sm)
    want = {"entry_spread": 0.4, "to_first": 1.5, "instructions": 9.5, "from_last": 1.5, "resident": 12.5}
    assert got.keys() == want.keys() and all(abs(got[k] - v) < 1e-9 for k, v in want.items())
    line = format_kernel_span(got, 16.0)
    assert "resident 12.5 us" in line and "3.5 us outside" in line
