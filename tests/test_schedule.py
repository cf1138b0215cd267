"""Lowering, SM assignment, the cost model's predictions and the tape encoding (all CPU).

Expected values are derived here from the model config and tiling, independently of
``schedule/program.py``; none is copied from a run.
"""
from __future__ import annotations

import dataclasses
import json
from collections import Counter
from functools import lru_cache

import networkx as nx
import pytest
import torch

from opcodes import (QKV, BY_OPCODE, HEADER, NO_COUNTER, PRESETS, REGISTRY, WORDS, Layout, ModelConfig, Tiling,
                     cdiv)
from schedule import (CostModel, Schedule, Tape, compile_model, decode, encode, list_schedule, lower,
                      random_schedule, round_robin, simulate, verify)
from schedule.assign import check_pool, with_pool
from schedule.verify import TapeError
from schedule.fluid import FluidModel, simulate_fluid

L70 = "llama70b-layer"


def layout(name: str, max_seq: int = 64, **tiling) -> Layout:
    cfg = ModelConfig.from_name(name)
    return Layout(cfg, Tiling.for_config(cfg, **tiling), max_seq)


def expected_counts(lay: Layout) -> dict[str, int]:
    """Instructions per opcode, from the shapes: what each opcode's tile covers."""
    c, t = lay.cfg, lay.tiling
    per_layer = {
        "qkv": (c.n_q + 2 * c.n_kv) * (c.hd // t.qkv_rows),   # q heads, k heads, v heads x row tiles
        # one per (KV head, key split); with key_in_reduce the merge takes the key at pos: no one-key split
        "attn_partial": c.n_kv * (t.attn_splits - t.key_in_reduce),
        "oproj": cdiv(c.d, t.o_rows) * lay.n_o_k,             # one per (row tile, K chunk)
        "o_reduce": cdiv(c.d, t.red_rows) if lay.n_o_k > 1 else 0,
        "gate_up": t.gu_tiles or cdiv(c.ffn, t.gu_rows),        # Tiling.gu_tiles: that many (the 1B: 132)
        "down": cdiv(c.d, t.down_rows) * cdiv(c.ffn, t.down_k),
    }
    # the attention merge is per query head or per KV group depending on the opcode's operands
    per_layer["attn_reduce"] = c.n_q if "h" in REGISTRY["attn_reduce"].operand_names() else c.n_kv
    counts = {k: v * c.layers for k, v in per_layer.items() if v}
    # RESIDUAL in every layer, or with the residual folded (Tiling.res_fold) in the last one only
    counts["residual"] = cdiv(c.d, t.red_rows) * (1 if lay.folds_residual else c.layers)
    return counts


# configs for lowering: the 70B layer, a multi-layer model, non-power-of-two d/ffn with several
# K chunks and residual blocks (tiling overrides), and a 16-layer real shape
LOWER_CASES = [
    (L70, {}),
    ("small-2layer", {}),
    ("tiny-gqa8", dict(down_k=64, red_rows=32, down_rows=32)),
    ("small-gqa4", dict(gu_rows=16, down_k=128, red_rows=64)),
    ("small-2layer", dict(o_k=32, red_rows=64, down_k=64)),            # O projection split along K
    ("llama3.2-1b", {}),
    ("llama3.2-1b", dict(res_fold=0)),                                # every layer's RESIDUAL
]


@pytest.mark.parametrize("name,tiling", LOWER_CASES, ids=[c[0] for c in LOWER_CASES])
def test_lowering_instruction_counts(name, tiling):
    lay = layout(name, max_seq=256, **tiling)
    prog = lower(lay)
    got = Counter(ins.NAME for ins in prog.instrs)
    want = expected_counts(lay)
    # the layer opcodes (the decoder's embed / lm_head / argmax never appear in a layer program)
    layer_ops = {"qkv", "attn_partial", "attn_reduce", "oproj", "o_reduce", "gate_up", "down", "residual"}
    assert layer_ops <= set(REGISTRY), "test's opcode list is out of date with the registry"
    assert set(want) <= layer_ops
    assert dict(got) == want
    assert len(prog) == sum(want.values())
    # every instruction is distinct (a tile is lowered once)
    assert len(set(prog.instrs)) == len(prog)
    # every operand is in range and fits the tape
    for ins in prog.instrs:
        assert ins.check_operands(lay) == [], ins


def test_lowering_70b_layer_tiles_cover_the_weights():
    """The HBM bytes of the 70B layer's instructions are exactly its weight matrices (read once)
    plus K and V of max_seq keys: no tile is missing or read twice."""
    lay = layout(L70, max_seq=4224)
    prog = lower(lay)
    c = lay.cfg
    matrices = 2 * (c.q_dim * c.d + 2 * c.kv_dim * c.d + c.d * c.q_dim + 3 * c.ffn * c.d)
    assert lay.max_seq % lay.tiling.attn_splits == 0
    want = matrices + c.kv_bytes(lay.max_seq)
    assert sum(ins.cost(lay).hbm_bytes for ins in prog.instrs) == want
    assert CostModel().lower_bound(prog) == pytest.approx(want / CostModel().hbm_bw, rel=1e-12)


GRANULAR_CASES = [
    ("small-2layer", dict(down_k=64, red_rows=64)),
    ("small-2layer", dict(down_k=64, red_rows=64, res_fold=0)),
    ("tiny-gqa8", dict(down_k=64, red_rows=32, down_rows=32)),
    ("small-gqa4", dict(gu_rows=16, down_k=128, red_rows=64)),
    ("small-2layer", dict(o_k=32, red_rows=64, down_k=64)),            # O projection split along K
]


@pytest.mark.parametrize("name,tiling", GRANULAR_CASES, ids=[c[0] for c in GRANULAR_CASES])
def test_dependencies_are_tile_granular(name, tiling):
    """A down tile waits only for the gate/up tiles of its own K chunk, a residual block only for
    the down tiles of its rows, an attention partial only for its KV group's QKV tiles."""
    lay = layout(name, **tiling)
    prog = lower(lay)
    c, t = lay.cfg, lay.tiling
    producers = prog.producers()
    targets = prog.targets()
    for i, ins in enumerate(prog.instrs):
        for cnt in prog.waits[i]:
            assert targets[cnt] == len(producers[cnt]) > 0
        if ins.NAME == "down":
            (cnt,) = prog.waits[i]
            rows = {p.row0 for p in (prog.instrs[j] for j in producers[cnt])}
            k0, k1 = ins.kc * t.down_k, min((ins.kc + 1) * t.down_k, c.ffn)
            assert all(prog.instrs[j].NAME == "gate_up" and prog.instrs[j].layer == ins.layer
                       for j in producers[cnt])
            assert rows == set(range(k0, k1, t.gu_rows)), f"{ins} waits on gate/up rows {sorted(rows)}"
        elif ins.NAME == "residual":
            (cnt,) = prog.waits[i]
            prods = [prog.instrs[j] for j in producers[cnt]]
            # its own rows' down tiles; with the residual folded, the (last) layer's down tiles signal
            # one counter, which the next layer's QKV would read whole
            r0, r1 = (0, c.d) if lay.folds_residual else (ins.row0, min(ins.row0 + t.red_rows, c.d))
            assert all(p.NAME == "down" and p.layer == ins.layer for p in prods)
            assert {(p.row0, p.kc) for p in prods} == {
                (r, kc) for r in range(r0, r1, t.down_rows) for kc in range(cdiv(c.ffn, t.down_k))}
        elif ins.NAME == "qkv" and ins.layer > 0:
            # the layer before's output: its RESIDUAL blocks, or folded, its down tiles themselves
            prods = [prog.instrs[j] for cnt in prog.waits[i] for j in producers[cnt]]
            want = "down" if lay.folds_residual else "residual"
            assert prods and all(p.NAME == want and p.layer == ins.layer - 1 for p in prods), ins
            assert len(prods) == sum(1 for p in prog.instrs if p.NAME == want and p.layer == ins.layer - 1)
        elif ins.NAME == "attn_partial":
            # prefix splits wait only for the group's Q tiles; the last split (the key at pos) also
            # for the K and V tiles of its KV head
            prods = [prog.instrs[j] for cnt in prog.waits[i] for j in producers[cnt]]
            heads = {(p.sec, p.head) for p in prods}
            want = {(0, h) for h in range(ins.g * c.group, (ins.g + 1) * c.group)}
            if ins.s == t.attn_splits - 1:
                want |= {(1, ins.g), (2, ins.g)}
            assert heads == want, (ins, sorted(heads))
        elif ins.NAME == "attn_reduce":
            # a head's merge waits for all the splits of its group
            prods = [prog.instrs[j] for cnt in prog.waits[i] for j in producers[cnt]]
            g = ins.h // c.group
            assert {(p.g, p.s) for p in prods} == {(g, s) for s in range(t.attn_splits)}, ins
    # K chunks and residual blocks really are several here
    assert cdiv(c.ffn, t.down_k) > 1 and cdiv(c.d, t.red_rows) > 1


# ---- queues: sub-sequences of one topological order -----------------------------------------
def queue_graph(sched: Schedule) -> nx.DiGraph:
    """Dataflow (producer -> counter -> consumer) plus queue order (each SM's consecutive
    instructions). Acyclic iff every queue is a sub-sequence of one topological order of the
    dataflow, i.e. iff no interleaving of the SMs can deadlock."""
    prog = sched.prog
    g = nx.DiGraph()
    g.add_nodes_from(range(len(prog)))
    for i in range(len(prog)):
        if prog.signal[i] != NO_COUNTER:
            g.add_edge(i, ("c", prog.signal[i]))
        for cnt in prog.waits[i]:
            g.add_edge(("c", cnt), i)
    for q in sched.queues:
        nx.add_path(g, q)
    return g


def check_queues(sched: Schedule) -> None:
    flat = [i for q in sched.queues for i in q]
    assert sorted(flat) == list(range(len(sched.prog))), "every instruction exactly once"
    assert len(sched.queues) == sched.num_sms
    assert nx.is_directed_acyclic_graph(queue_graph(sched))


POLICY_FNS = {
    "cost": lambda prog, n: list_schedule(prog, n),
    "round-robin": lambda prog, n: round_robin(prog, n),
    "random": lambda prog, n: random_schedule(prog, n, seed=7),
}


@pytest.mark.parametrize("policy", list(POLICY_FNS))
@pytest.mark.parametrize("name,sms", [("tiny", 1), ("tiny-gqa8", 3), ("small-2layer", 8), ("small-gqa4", 132),
                                      (L70, 132)])
def test_queues_are_subsequences_of_one_topological_order(policy, name, sms):
    lay = layout(name, max_seq=4224 if name == L70 else 64)
    prog = lower(lay)
    sched = POLICY_FNS[policy](prog, sms)
    check_queues(sched)
    tape = encode(sched)
    rep = verify(tape, prog)
    assert rep.n_instructions == len(prog) and rep.n_sms == sms


def test_queue_check_can_fail():
    """The checker above rejects a queue with a consumer ahead of its producer."""
    prog = lower(layout("tiny"))
    sched = round_robin(prog, 1)
    q = sched.queues[0]
    cons = next(i for i in q if prog.waits[i])
    prod = prog.producers()[prog.waits[cons][0]][0]
    q.remove(cons)
    q.insert(q.index(prod), cons)
    with pytest.raises(AssertionError):
        check_queues(sched)


def test_simulate_reproduces_list_schedule_prediction():
    """Re-simulating the list schedule's queues gives the start/finish times it predicted."""
    prog = lower(layout("small-2layer", max_seq=256))
    model = CostModel()
    sched = list_schedule(prog, 8, model)
    again = simulate(Schedule(prog, 8, [list(q) for q in sched.queues], "copy"), model)
    assert again.finish == pytest.approx(sched.finish, rel=1e-12, abs=1e-15)
    assert again.makespan == pytest.approx(sched.makespan, rel=1e-12)
    # and no instruction starts before its producers finish
    producers = prog.producers()
    for i in range(len(prog)):
        for cnt in prog.waits[i]:
            assert sched.start[i] >= max(sched.finish[j] for j in producers[cnt]) - 1e-15


# ---- the 70B layer on 132 SMs --------------------------------------------------------------
# (the compile-time limits, 5 s for the layer and 30 s for 16 layers, are measured in tests/test_gpu.py:
# CPU tests assert no wall-clock times)
@lru_cache(maxsize=None)
def compiled_70b(policy: str):
    return compile_model(ModelConfig.from_name(L70), 132, policy=policy), None


def test_compile_70b_layer():
    c, _ = compiled_70b("cost")
    assert len(c.tape) == len(c.prog) and c.report.n_sms == 132


@pytest.mark.slow
def test_compile_70b_16_layers():
    """Slow (~5 s): multi-layer lowering and verification are covered at small sizes (small-2layer
    above, test_cli's --layers 3), the 70B layer on 132 SMs by test_compile_70b_layer, and this
    16-layer compile with its time limit by tests/test_gpu.py."""
    c = compile_model(ModelConfig.from_name(L70).with_layers(16), 132)
    one, _ = compiled_70b("cost")
    assert len(c.tape) == 16 * len(one.tape)
    assert c.report.n_instructions == len(c.tape)


def test_cost_model_beats_round_robin_70b():
    cost, _ = compiled_70b("cost")
    rr, _ = compiled_70b("round-robin")
    lb = CostModel().lower_bound(cost.prog)
    assert lb == CostModel().lower_bound(rr.prog)
    assert lb <= cost.sched.makespan
    assert cost.sched.makespan <= rr.sched.makespan, (
        f"cost {cost.sched.makespan * 1e6:.1f} us > round-robin {rr.sched.makespan * 1e6:.1f} us")


def test_no_schedule_beats_the_lower_bound():
    """Lower bound = bytes / bandwidth: also below every SM's share of the work on average."""
    cost, _ = compiled_70b("cost")
    model = CostModel()
    busy = cost.sched.busy(model)
    lb = model.lower_bound(cost.prog)
    assert sum(busy) / len(busy) >= lb
    assert max(cost.sched.finish) == cost.sched.makespan >= max(busy)


def test_cost_schedule_within_5_percent_of_lower_bound_70b():
    """The default tape of the 70B layer on 132 SMs, as the H200 model expects it to run
    (shared bandwidth, measured jitter and ticket cost; Compiled.expected_makespan), is within 5%
    of that model's bandwidth lower bound, and ahead of round-robin's."""
    cost, _ = compiled_70b("cost")
    rr, _ = compiled_70b("round-robin")
    lb = cost.expected_lower_bound(cost.prog)
    e_cost, e_rr = cost.expected_makespan(), rr.expected_makespan()
    assert e_cost >= lb and e_rr >= lb
    assert e_cost / lb <= 1.05, (f"expected makespan {e_cost * 1e6:.1f} us is {100 * (e_cost / lb - 1):.1f}% over "
                                 f"the lower bound {lb * 1e6:.1f} us")
    assert e_cost < e_rr


# H200 measurements of the 70B layer (us, CUDA-event medians of 32 steps), two leases, one lease
# per dict: bench/NOTES.md v13 / v14 (bench/results/s3-run23, s3-run24). Specs as bench variants.
H200_RUNS = [
    {"stages=4,pool=0": 431.8, "stages=4,pool=30": 427.3, "stages=4": 425.7, "stages=4,pool=120": 426.3,
     "stages=4,pool=250": 428.1},
    {"stages=4,pool=0": 433.1, "stages=4": 425.9, "stages=5": 422.6, "": 421.4},
]


def test_h200_model_reproduces_the_measured_builds():
    """The H200 model against every 70B-layer build measured in two normal leases: within 2%, and
    a pool of 60 us expected faster than static queues, as measured."""
    cfg = ModelConfig.from_name(L70)
    for run in H200_RUNS:
        for spec, measured in run.items():
            kv = dict(x.split("=") for x in spec.split(",") if x)
            pool = float(kv.pop("pool")) if "pool" in kv else None
            c = compile_model(cfg, 132, tiling=Tiling.for_config(cfg, **{k: int(v) for k, v in kv.items()}),
                              pool_us=pool)
            e = c.expected_makespan() * 1e6
            assert abs(e / measured - 1) <= 0.02, (spec, e, measured)
    static = compile_model(cfg, 132, pool_us=0).expected_makespan()
    pooled = compile_model(cfg, 132).expected_makespan()
    assert pooled < static


def test_expected_makespan_is_deterministic_and_leaves_the_schedule_alone():
    from schedule.fluid import expected_makespan
    c = compile_model(ModelConfig.from_name("small-2layer"), 8, max_seq=256)
    before = (list(c.sched.start), list(c.sched.finish), dict(c.sched.pool_sm))
    a, b = c.expected_makespan(), c.expected_makespan()
    assert a == b and a > 0
    assert (c.sched.start, c.sched.finish, c.sched.pool_sm) == before
    quiet = FluidModel.h200(c.prog.lay)
    quiet = dataclasses.replace(quiet, noise=0.0)
    assert expected_makespan(c.sched, quiet, draws=5) == expected_makespan(c.sched, quiet, draws=1)
    with pytest.raises(ValueError, match="draws"):
        expected_makespan(c.sched, quiet, draws=0)


def test_sm_cap_follows_bytes_in_flight():
    caps = [FluidModel.sm_cap(k * 32768) for k in (1, 3, 5, 100)]
    assert caps == sorted(caps) and caps[-1] < FluidModel.SM_FILL
    lay = layout("small-gqa4", stages=4)
    m = FluidModel.h200(lay)
    assert m.cap[QKV] == pytest.approx(FluidModel.sm_cap(3 * lay.tiling.qkv_rows * lay.tiling.bk * 2))
    assert FluidModel.h200(layout("small-gqa4", stages=6)).cap[QKV] > m.cap[QKV]


# ---- tape encoding ----------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["cost", "round-robin", "random"])
def test_tape_encode_decode_roundtrip(policy):
    lay = layout("small-2layer", down_k=64, red_rows=64)
    prog = lower(lay)
    sched = POLICY_FNS[policy](prog, 5)
    tape = encode(sched)
    targets = prog.targets()
    assert tape.words.dtype == torch.int32 and tuple(tape.words.shape) == (len(prog), WORDS)
    assert tape.offsets.dtype == torch.int32
    ends = torch.tensor([len(q) for q in sched.queues]).cumsum(0).tolist()
    assert tape.offsets.tolist() == [0] + ends + [ends[-1]]          # the last range: an empty pool
    dec = decode(tape)
    assert [d.slot for d in dec] == list(range(len(prog)))
    k = 0
    for s, q in enumerate(sched.queues):
        for i in q:
            d = dec[k]
            assert d.sm == s
            assert d.ins == prog.instrs[i] and type(d.ins) is BY_OPCODE[int(tape.words[k, 0])]
            assert d.waits == tuple((cnt, targets[cnt]) for cnt in prog.waits[i])
            assert d.signal == prog.signal[i]
            assert tape.prog_index[k] == i
            # unused operand words are zero
            n_ops = len(d.ins.operand_names())
            assert tape.words[k, HEADER + n_ops:].eq(0).all()
            k += 1
    # re-encoding the decoded queues gives the same words
    queues = [[tape.prog_index[j] for j in tape.sm_range(s)] for s in range(tape.num_sms)]
    again = encode(Schedule(prog, tape.num_sms, queues, policy))
    assert torch.equal(again.words, tape.words) and torch.equal(again.offsets, tape.offsets)


def assert_tapes_equal(a: Tape, b: Tape) -> None:
    assert a.lay == b.lay and a.lay.cfg.name == b.lay.cfg.name
    assert a.num_sms == b.num_sms
    assert a.words.dtype == b.words.dtype == torch.int32
    assert torch.equal(a.words, b.words)
    assert torch.equal(a.offsets, b.offsets)
    assert a.counters == b.counters
    assert a.prog_index == b.prog_index
    assert a.meta == b.meta


def test_tape_json_roundtrip_exact(tmp_path):
    lay = layout("small-gqa4", gu_rows=16, down_k=128, red_rows=64)
    prog = lower(lay)
    tape = encode(list_schedule(prog, 7))
    tape.meta["note"] = "round trip"
    back = Tape.from_json(json.loads(json.dumps(tape.to_json())))
    assert_tapes_equal(tape, back)
    verify(back, prog)
    path = tmp_path / "tape.json"
    tape.save(path)
    loaded = Tape.load(path)
    assert_tapes_equal(tape, loaded)
    assert decode(loaded) == decode(tape)


def test_tape_json_rejects_foreign_files():
    tape = encode(round_robin(lower(layout("tiny")), 2))
    obj = tape.to_json()
    with pytest.raises(ValueError, match="not a megatape tape"):
        Tape.from_json({**obj, "format": "something-else"})
    ops = dict(obj["opcodes"])
    a, b = list(ops)[:2]
    ops[a], ops[b] = ops[b], ops[a]
    with pytest.raises(ValueError, match="opcodes"):
        Tape.from_json({**obj, "opcodes": ops})


def test_presets_are_valid_and_cover_gqa_ratios():
    groups = {cfg.group for cfg in PRESETS.values()}
    assert {1, 4, 8} <= groups
    assert any(cfg.d & (cfg.d - 1) and cfg.ffn & (cfg.ffn - 1) for cfg in PRESETS.values())


@pytest.mark.parametrize("name,splits", [("llama3.2-1b", 16), ("llama3.1-8b", 8), (L70, 16)])
def test_attention_splits_per_shape(name, splits):
    # the per-shape default decided on the H200 (bench/NOTES.md v80): 8 splits where 2048 < d <= 4096
    # (the 8B shape), 16 elsewhere; one layer's partials follow it
    cfg = dataclasses.replace(ModelConfig.from_name(name), layers=1)
    lay = Layout(cfg, Tiling.for_config(cfg), 1152)
    assert lay.tiling.attn_splits == splits
    parts = [ins for ins in lower(lay).instrs if type(ins).NAME == "attn_partial"]
    assert len(parts) == cfg.n_kv * (splits - lay.tiling.key_in_reduce)


# ---- RoPE scaling fields of ModelConfig (Llama 3.1 / 3.2's rope_type "llama3") -------------------------
SPEC_KEYS = {"layers", "d", "ffn", "n_q", "n_kv", "hd", "eps", "theta", "wdtype"}
LLAMA3 = dict(rope_type="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_pos=32)


def test_model_config_rope_scaling_roundtrip():
    # unscaled RoPE: the spec's cfg dict, as before (no rope keys), and a dict without them is accepted
    tiny = PRESETS["tiny"]
    assert set(tiny.to_dict()) == SPEC_KEYS and tiny.rope_type == "default" and tiny.rope_factor is None
    spec = {"layers": 1, "d": 8192, "ffn": 28672, "n_q": 64, "n_kv": 8, "hd": 128, "eps": 1e-5, "theta": 500000.0,
            "wdtype": "bf16"}
    assert ModelConfig.from_dict(spec) == PRESETS["llama70b-layer"] and ModelConfig.from_dict(spec).to_dict() == spec
    # the real Llama 3.1 / 3.2 presets carry their checkpoints' scaling
    for name, factor in (("llama3.2-1b", 32.0), ("llama3.1-8b", 8.0)):
        d = PRESETS[name].to_dict()
        assert {k: d[k] for k in LLAMA3} == dict(LLAMA3, rope_factor=factor, rope_original_max_pos=8192)
        assert ModelConfig.from_dict(d, name=name) == PRESETS[name]
    # scaled: to_dict -> JSON -> from_dict is the identity; ints are kept as the same numbers
    cfg = dataclasses.replace(tiny, **LLAMA3)
    d = cfg.to_dict()
    assert set(d) == SPEC_KEYS | set(LLAMA3) and {k: d[k] for k in LLAMA3} == LLAMA3
    back = ModelConfig.from_dict(json.loads(json.dumps(d)))
    assert back == cfg and back != tiny and back.to_dict() == d
    ints = ModelConfig.from_dict({**d, "rope_factor": 8, "rope_low_freq_factor": 1, "rope_high_freq_factor": 4})
    assert ints == cfg and ints.to_dict() == d and isinstance(ints.rope_factor, float)
    assert cfg.with_layers(3).rope_factor == 8.0
    # and through a tape's JSON
    tape = encode(round_robin(lower(Layout(cfg, Tiling.for_config(cfg), 64)), 2))
    loaded = Tape.from_json(json.loads(json.dumps(tape.to_json())))
    assert loaded.lay.cfg == cfg and loaded.lay.cfg.to_dict() == d
    assert_tapes_equal(tape, loaded)


ROPE_CFG_ERRORS = [
    # (id, changes to tiny's cfg dict, exception, substrings the message must contain)
    ("unknown-type", dict(rope_type="yarn"), ValueError, ["cfg['rope_type']", "'yarn'", "'llama3'"]),
    ("factor-without-type", dict(rope_factor=8.0), ValueError, ["cfg['rope_factor']", "'default'"]),
    ("llama3-missing", {**LLAMA3, "rope_original_max_pos": None, "rope_high_freq_factor": None}, ValueError,
     ["cfg['rope_high_freq_factor']", "cfg['rope_original_max_pos']"]),
    ("factor-below-1", {**LLAMA3, "rope_factor": 0.5}, ValueError, ["cfg['rope_factor']", ">= 1", "0.5"]),
    ("factor-not-number", {**LLAMA3, "rope_factor": "8"}, ValueError, ["cfg['rope_factor']", "'8'"]),
    ("factor-bool", {**LLAMA3, "rope_factor": True}, ValueError, ["cfg['rope_factor']", "True"]),
    ("factor-inf", {**LLAMA3, "rope_factor": float("inf")}, ValueError, ["cfg['rope_factor']", "finite"]),
    ("low-not-positive", {**LLAMA3, "rope_low_freq_factor": -1.0}, ValueError, ["cfg['rope_low_freq_factor']", "> 0"]),
    ("high-not-above-low", {**LLAMA3, "rope_high_freq_factor": 1.0}, ValueError,
     ["cfg['rope_high_freq_factor'] = 1.0", "cfg['rope_low_freq_factor'] = 1.0"]),
    ("original-float", {**LLAMA3, "rope_original_max_pos": 32.0}, TypeError, ["cfg['rope_original_max_pos']", "int"]),
    ("original-zero", {**LLAMA3, "rope_original_max_pos": 0}, ValueError, ["cfg['rope_original_max_pos']", "positive"]),
    ("misspelt-key", dict(rope_scaling={"factor": 8.0}), ValueError, ["unknown keys", "'rope_scaling'"]),
]


@pytest.mark.parametrize("case,changes,exc,words", ROPE_CFG_ERRORS, ids=[c[0] for c in ROPE_CFG_ERRORS])
def test_model_config_rope_scaling_errors(case, changes, exc, words):
    d = {k: v for k, v in {**PRESETS["tiny"].to_dict(), **changes}.items() if v is not None}
    with pytest.raises(exc) as ei:
        ModelConfig.from_dict(d)
    for w in words:
        assert w in str(ei.value), f"{case}: {w!r} not in {str(ei.value)!r}"


def test_networkx_dag_and_critical_path():
    """The networkx DAG has one node per instruction and per counter, is acyclic, and its critical
    path bounds the list schedule's makespan from below (and the bandwidth bound does too)."""
    import networkx as nx

    from schedule import build_dag, critical_path_seconds
    lay = layout(L70, max_seq=4224)
    prog = lower(lay)
    G = build_dag(prog)
    assert G.number_of_nodes() == len(prog) + len(prog.counters)
    assert nx.is_directed_acyclic_graph(G)
    assert G.number_of_edges() == sum(s >= 0 for s in prog.signal) + sum(len(w) for w in prog.waits)
    sched = list_schedule(prog, 132)
    cp = critical_path_seconds(prog, 132)
    assert 0 < cp <= sched.makespan
    assert CostModel().lower_bound(prog) <= sched.makespan


# ---- the shared-bandwidth (fluid) model -------------------------------------------------------

def _streaming_program(n: int, rows: int = 64):
    """``n`` independent gate/up tiles of the 1B shape (no waits): a pure streaming workload."""
    lay = layout("llama3.2-1b", max_seq=256, gu_rows=rows)
    from opcodes import GateUp
    from schedule.program import Program
    prog = Program(lay)
    for k in range(n):
        prog.add(GateUp(0, k * rows))
    return prog


def test_fluid_one_instruction_streams_at_its_cap():
    prog = _streaming_program(1)
    m = FluidModel(hbm_bw=4e12, sm_bw=40e9, overhead=1e-6, l2_bw_sm=1e30)
    s = simulate_fluid(Schedule(prog, 4, [[0], [], [], []], "one"), m)
    b = prog.instrs[0].cost(prog.lay).hbm_bytes
    assert s.makespan == pytest.approx(1e-6 + b / 40e9, rel=1e-9)


def test_fluid_many_instructions_share_the_chip():
    """100 SMs at a 40 GB/s cap want 4 TB/s but the chip has 2: each gets 20 GB/s."""
    prog = _streaming_program(100)
    m = FluidModel(hbm_bw=2e12, sm_bw=40e9, overhead=0.0, l2_bw_sm=1e30)
    s = simulate_fluid(Schedule(prog, 100, [[i] for i in range(100)], "all"), m)
    b = prog.instrs[0].cost(prog.lay).hbm_bytes
    assert s.makespan == pytest.approx(100 * b / 2e12, rel=1e-9)
    # and on 10 SMs the per-SM cap binds instead: 10 rounds at 40 GB/s
    s10 = simulate_fluid(Schedule(prog, 10, [list(range(k, 100, 10)) for k in range(10)], "ten"), m)
    assert s10.makespan == pytest.approx(10 * b / 40e9, rel=1e-9)


def test_attention_latency_model_counts_round_trips():
    from opcodes.attn_partial import attention_latency
    lay1 = layout(L70, max_seq=4224, attn_block=64, attn_stages=1)
    lay3 = layout(L70, max_seq=4224, attn_block=128, attn_stages=3)
    # 274 keys: 5 blocks of 64, one trip each unpipelined; 3 blocks of 128, 2 in flight -> 2 trips
    assert attention_latency(lay1, 274, 2.6e-6, 2.1e-6, 0.2e-6) == pytest.approx(2.6e-6 + 5 * 2.1e-6 + 5 * 0.2e-6)
    assert attention_latency(lay3, 274, 2.6e-6, 2.1e-6, 0.2e-6) == pytest.approx(2.6e-6 + 2 * 2.1e-6 + 3 * 0.2e-6)
    # the per-SM model uses it for attention splits; the bytes-only model does not
    prog = lower(lay3)
    i = next(k for k, ins in enumerate(prog.instrs) if ins.NAME == "attn_partial")
    keys = prog.instrs[i].cost(lay3).hbm_bytes // (4 * lay3.cfg.hd)
    assert keys == 282                    # max_seq 4224: 4223 prefix keys over 15 splits, rounded up
    assert CostModel().time(prog, i, 132) == pytest.approx(attention_latency(lay3, keys))
    assert CostModel.bytes_only().time(prog, i, 132) != pytest.approx(CostModel().time(prog, i, 132))


# ---- backfilling: list scheduling without planned idle where other work is ready -----------------
def _planned_idle(sched, name: str) -> float:
    """Seconds the plan leaves an SM idle before starting a ``name`` instruction, summed over the SMs."""
    idle = 0.0
    for q in sched.queues:
        t = 0.0
        for i in q:
            if sched.prog.instrs[i].NAME == name:
                idle += max(0.0, sched.start[i] - t)
            t = sched.finish[i]
    return idle


def test_backfilling_starts_ready_work_where_the_plan_would_idle():
    """One 8B-shaped layer's 1024-row chunk (down in 2 K chunks): plain list scheduling places the first chunk's
    DOWN tiles mid-GATE_UP, where they idle their SMs until that chunk's GATE_UP tiles are planned done (the
    measured profile's DOWN waits, run 325: 7.5% of the 8B chunk's SM time); backfilled, those SMs run the released
    GATE_UP tiles first: no idle before DOWN_R, a shorter plan, a verified tape. compile_model takes the shorter of
    the two plans, and the plain one where they tie (the tapes the GPU measured keep their queues)."""
    from opcodes.rows import rows_tiling
    from schedule.compile import _best_list_schedule
    from schedule.rows_program import lower_rows
    cfg = PRESETS["llama3.1-8b"].with_layers(1)
    prog = lower_rows(Layout(cfg, rows_tiling(cfg, 1024, 1100), 1100), rows=1024, batch=1)
    q, m = CostModel.bytes_only(), CostModel()
    plain = simulate(list_schedule(prog, 132, q), m)
    filled = simulate(list_schedule(prog, 132, q, backfill=True), m)
    assert _planned_idle(plain, "down_r") > 1e-4 and _planned_idle(filled, "down_r") == 0.0
    assert filled.makespan < 0.985 * plain.makespan
    verify(encode(filled), prog)
    assert _best_list_schedule(prog, 132, q, m).queues == filled.queues
    small = lower(layout("small-2layer", max_seq=256))      # nothing to backfill: the same plan, kept as it was
    a, b = (simulate(list_schedule(small, 8, q, backfill=f), m) for f in (False, True))
    assert a.makespan == b.makespan and _best_list_schedule(small, 8, q, m).queues == a.queues


# ---- the pool: the plan's tail taken at run time ---------------------------------------------
def test_with_pool_moves_a_suffix_of_each_queue_in_start_order():
    prog = lower(layout("small-2layer", max_seq=256))
    model = CostModel()
    base = simulate(list_schedule(prog, 8, model), model)
    tail = base.makespan / 3
    pooled = with_pool(base, model, tail)
    cut = base.makespan - tail
    assert pooled.pool and all(base.start[i] >= cut for i in pooled.pool)
    for q0, q1 in zip(base.queues, pooled.queues):
        assert q1 == q0[:len(q1)] and all(base.start[i] < cut for i in q1) and all(base.start[i] >= cut for i in q0[len(q1):])
    assert [base.start[i] for i in pooled.pool] == sorted(base.start[i] for i in pooled.pool)
    check_pool(pooled)
    # every pool instruction got an SM in the simulation and starts after its producers finish
    assert set(pooled.pool_sm) == set(pooled.pool) and all(0 <= s < 8 for s in pooled.pool_sm.values())
    producers = prog.producers()
    for i in range(len(prog)):
        for cnt in prog.waits[i]:
            assert pooled.start[i] >= max(pooled.finish[j] for j in producers[cnt]) - 1e-15
    tape = encode(pooled)
    verify(tape, prog)
    assert tape.pool_len == len(pooled.pool) and tape.counters[tape.pool_counter] == "pool"
    assert tape.tickets_per_call() == len(pooled.pool) + 8
    assert with_pool(base, model, 0) is base


def test_pool_balances_a_lopsided_schedule():
    """Everything queued on SM 0 takes the sum of all times; pooled, the other SMs take their share."""
    prog = lower(layout("small-gqa4", max_seq=256))
    model = CostModel()
    order = [i for q in list_schedule(prog, 1, model).queues for i in q]
    lop = simulate(Schedule(prog, 4, [order, [], [], []], "lopsided"), model)
    assert lop.makespan == pytest.approx(sum(model.time(prog, i, 4) for i in range(len(prog))))
    pooled = with_pool(lop, model, lop.makespan * 2)         # all of it
    assert not any(pooled.queues) and len(pooled.pool) == len(prog)
    assert pooled.makespan < 0.5 * lop.makespan
    assert len(set(pooled.pool_sm.values())) == 4
    # the fluid simulator takes the pool the same way
    fl = simulate_fluid(Schedule(prog, 4, [[], [], [], []], "p", pool=list(pooled.pool)), FluidModel())
    assert len(set(fl.pool_sm.values())) == 4 and fl.makespan > 0


def test_check_pool_rejects_unsafe_pools():
    prog = lower(layout("tiny", max_seq=64))
    model = CostModel()
    base = simulate(list_schedule(prog, 3, model), model)
    pooled = with_pool(base, model, base.makespan / 2)
    # a queued instruction that waits on a pool instruction's counter
    first = next(i for i in pooled.pool if prog.signal[i] >= 0 and any(prog.signal[i] in prog.waits[j] for j in pooled.pool))
    cons = [j for q in pooled.queues for j in q if prog.signal[first] in prog.waits[j]]
    waiter = next(j for j in pooled.pool if prog.signal[first] in prog.waits[j])
    bad = Schedule(prog, 3, [list(q) for q in pooled.queues], "bad", pool=list(pooled.pool))
    bad.pool.remove(waiter)
    bad.queues[1].append(waiter)
    with pytest.raises(ValueError, match=f"queued instruction {waiter} .*a queue may not wait on the pool"):
        check_pool(bad)
    assert not cons
    # the pool out of topological order
    rev = Schedule(prog, 3, [list(q) for q in pooled.queues], "rev", pool=list(reversed(pooled.pool)))
    with pytest.raises(ValueError, match="later pool instruction"):
        check_pool(rev)
    # an instruction both queued and pooled
    dup = Schedule(prog, 3, [list(q) for q in pooled.queues], "dup", pool=list(pooled.pool) + [pooled.queues[0][0]])
    with pytest.raises(ValueError, match="placed 2 times"):
        check_pool(dup)


def test_tape_with_pool_json_roundtrip_and_format_1(tmp_path):
    c = compile_model(ModelConfig.from_name("small-gqa4"), 5, max_seq=64, pool_us=5)
    tape = c.tape
    assert tape.pool_len > 0 and tape.offsets.numel() == 7
    back = Tape.from_json(json.loads(json.dumps(tape.to_json())))
    assert_tapes_equal(tape, back)
    assert back.pool_counter == tape.pool_counter
    verify(back, c.prog)
    # a tape written before pools existed (format 1: num_sms + 1 offsets) loads with an empty pool
    c0 = compile_model(ModelConfig.from_name("small-gqa4"), 5, max_seq=64, pool_us=0)
    assert c0.tape.pool_len == 0
    old = c0.tape.to_json()
    old["format"], old["offsets"] = "megatape-tape/1", old["offsets"][:-1]
    del old["pool_counter"]
    t1 = Tape.from_json(old)
    assert t1.offsets.tolist() == c0.tape.offsets.tolist() and t1.pool_len == 0
    verify(t1, c0.prog)
    assert "pool:" in tape.listing() and "a pool of" in tape.listing()


def test_compile_model_pool_us_argument():
    cfg = ModelConfig.from_name("tiny")
    for bad in (-1, "5", float("nan"), True):
        with pytest.raises(ValueError, match="pool_us"):
            compile_model(cfg, 3, max_seq=64, pool_us=bad)
    # default: the plan's last DEFAULT_POOL_US for cost / fluid, none for the baselines
    from schedule.compile import DEFAULT_POOL_US
    assert compile_model(cfg, 3, max_seq=64).sched.policy.endswith(f"pool({DEFAULT_POOL_US:.0f}us)")
    assert not compile_model(cfg, 3, max_seq=64, policy="round-robin").sched.pool
    for policy in ("cost", "round-robin", "random"):
        c = compile_model(cfg, 3, max_seq=64, policy=policy, pool_us=1e9)
        assert len(c.sched.pool) == len(c.prog) and c.tape.pool_len == len(c.prog)




def test_repeated_waits_counts_waits_an_earlier_instruction_of_the_sm_made():
    """On one SM every wait on a counter after the first is met before it is polled; on more SMs
    only waits whose counter the same queue already waited on count."""
    from schedule.tape import decode
    cfg = ModelConfig.from_name("small-2layer")
    split = Tiling.for_config(cfg)      # the split attention (at 64 positions the default merges it: fewer waits)
    one = compile_model(cfg, 1, max_seq=64, pool_us=0, elide_waits=False, tiling=split).tape
    waits = [c for d in decode(one) for c, _ in d.waits]
    assert one.repeated_waits() == (len(waits), len(waits) - len(set(waits)))
    many = compile_model(cfg, 8, max_seq=64, pool_us=0, elide_waits=False, tiling=split).tape
    assert compile_model(cfg, 8, max_seq=64, pool_us=0, tiling=split).tape.repeated_waits()[1] == 0   # the default elides
    per_sm = [[c for d in decode(many) if d.sm == s for c, _ in d.waits] for s in range(8)]
    assert many.repeated_waits() == (sum(map(len, per_sm)), sum(len(w) - len(set(w)) for w in per_sm))
    assert 0 < many.repeated_waits()[1] < one.repeated_waits()[1]


@pytest.mark.parametrize("name,sms", [("small-2layer", 8), ("small-gqa4", 5), (L70, 132)])
def test_elided_repeated_waits_verify_and_compute_the_same(name, sms):
    """Dropping the waits an earlier instruction of the same SM made leaves a tape the verifier
    proves (reading across the queue order) and, in the VM, bitwise the same results."""
    cfg = ModelConfig.from_name(name)
    # (a small model's plan is all pool; the split attention, which the default merges at 64 positions)
    kw = dict(max_seq=64, pool_us=0, tiling=Tiling.for_config(cfg)) if cfg.d < 1024 else dict(max_seq=4224)
    c = compile_model(cfg, sms, elide_waits=False, **kw)
    el = c.tape.elide_repeated_waits()
    total, repeated = c.tape.repeated_waits()
    assert repeated > 0 and el.repeated_waits() == (total - repeated, 0)
    assert sum(len(d.waits) for d in decode(el)) == sum(len(d.waits) for d in decode(c.tape)) - repeated
    verify(el, c.prog)
    assert compile_model(cfg, sms, elide_waits=True, **kw).tape.words.equal(el.words)
    if cfg.d < 1024:
        from opcodes.reference import make_kv_cache, make_weights
        from schedule.vm import run_tape
        w = make_weights(cfg)
        x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
        outs = [run_tape(t, w, make_kv_cache(cfg, 64, 40), x, 40, seed=s) for t in (c.tape, el) for s in (0, 1)]
        assert all(torch.equal(o, outs[0]) for o in outs[1:])


def test_a_wait_another_sm_made_is_not_enough():
    """The verifier's queue-order reasoning is per SM: drop a wait whose counter no earlier
    instruction of that SM waited on, and the read it guarded is named uncovered."""
    cfg = ModelConfig.from_name("small-2layer")
    c = compile_model(cfg, 8, max_seq=64, pool_us=0)
    tape = c.tape
    seen: dict[int, set] = {}
    victim = None
    for d in decode(tape):
        mine = seen.setdefault(d.sm, set())
        fresh = [cn for cn, _ in d.waits if cn not in mine]
        if victim is None and fresh and d.ins.reads(tape.lay) and len(d.waits) == 1:
            victim = d.slot
        mine.update(cn for cn, _ in d.waits)
    assert victim is not None
    words = tape.words.clone()
    words[victim, 1], words[victim, 2] = NO_COUNTER, 0
    broken = Tape(tape.lay, tape.num_sms, words, tape.offsets, tape.counters, tape.prog_index, {}, tape.pool_counter)
    with pytest.raises(TapeError, match=rf"instruction {victim} .*does not wait for"):
        verify(broken)
