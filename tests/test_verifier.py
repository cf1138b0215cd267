"""The verifier rejects broken tapes and names the culprit: "instruction <slot> (<opcode>, sm <s>)".

Broken tapes are made by editing copies of a good tape's int32 ``words`` / ``offsets``, the way a
buggy compiler (or a stray write) would. Expected slots are computed from the edit itself.
"""
from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from opcodes import BY_OPCODE, HEADER, NO_COUNTER, REGISTRY, Layout, ModelConfig, Tiling
from schedule import Schedule, Tape, TapeError, encode, list_schedule, lower, round_robin, verify
from schedule.tape import decode_slot

# several K chunks and residual blocks, two KV heads, 2 layers
CFG = ModelConfig.from_name("small-2layer")
# o_k split: every opcode appears; 16-row gate/up tiles: a down K chunk waits for several producers
LAY = Layout(CFG, Tiling.for_config(CFG, down_k=64, red_rows=64, o_k=64, gu_rows=16), 64)
PROG = lower(LAY)


def good_tape(num_sms: int = 3) -> Tape:
    return encode(list_schedule(PROG, num_sms))


def copy(tape: Tape) -> Tape:
    return dataclasses.replace(tape, words=tape.words.clone(), offsets=tape.offsets.clone(),
                               counters=list(tape.counters), prog_index=list(tape.prog_index), meta=dict(tape.meta))


def sm_of(tape: Tape, slot: int) -> int:
    return tape.sm_of_slot()[slot]


def name(tape: Tape, slot: int) -> str:
    """How the verifier names the instruction in ``slot``."""
    return f"instruction {slot} ({BY_OPCODE[int(tape.words[slot, 0])].NAME}, sm {sm_of(tape, slot)})"


def delete_slot(tape: Tape, slot: int) -> Tape:
    t = copy(tape)
    s = sm_of(tape, slot)
    t.words = torch.cat([tape.words[:slot], tape.words[slot + 1:]])
    t.offsets[s + 1:] -= 1
    del t.prog_index[slot]
    return t


def insert_row(tape: Tape, slot: int, sm: int, row: torch.Tensor) -> Tape:
    """Insert ``row`` as tape slot ``slot``, which must lie in (or at the end of) ``sm``'s queue."""
    assert int(tape.offsets[sm]) <= slot <= int(tape.offsets[sm + 1])
    t = copy(tape)
    t.words = torch.cat([tape.words[:slot], row.reshape(1, -1), tape.words[slot:]])
    t.offsets[sm + 1:] += 1
    t.prog_index.insert(slot, -1)
    return t


def problems(tape: Tape, prog=None, sequential: bool = False) -> list[str]:
    with pytest.raises(TapeError) as ei:
        verify(tape, prog, sequential=sequential)
    e = ei.value
    assert e.problems and str(e).startswith("tape verification failed")
    return e.problems


def find(tape: Tape, pred) -> int:
    for k in range(len(tape)):
        if pred(decode_slot(tape, k)):
            return k
    raise AssertionError("no such instruction in the tape")


def test_good_tapes_verify():
    for n in (1, 2, 3, 8):
        rep = verify(good_tape(n), PROG)
        assert rep.n_instructions == len(PROG) and rep.n_sms == n and rep.n_counters == len(PROG.counters)
    verify(good_tape(1), PROG, sequential=True)


# ---- a dropped instruction ------------------------------------------------------------------
@pytest.mark.parametrize("opname", ["qkv", "attn_partial", "attn_reduce", "oproj", "gate_up", "down"])
@pytest.mark.parametrize("with_prog", [True, False])
def test_dropped_instruction(opname, with_prog):
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == opname and d.ins.layer == 1)
    dropped = decode_slot(tape, k)
    assert dropped.signal != NO_COUNTER
    bad = delete_slot(tape, k)
    msgs = problems(bad, PROG if with_prog else None)
    # every consumer of its counter now waits for one producer more than exist
    target = PROG.targets()[dropped.signal]
    cname = f"counter {dropped.signal} ({tape.counters[dropped.signal]})"
    consumers = [j for j in range(len(bad)) if any(c == dropped.signal for c, _ in decode_slot(bad, j).waits)]
    assert consumers
    for j in consumers:
        want = f"{name(bad, j)}: waits on {cname} for {target}, but it has {target - 1} producer(s)"
        assert want in msgs, f"missing {want!r} in {msgs[:5]}"
    # what it wrote is never written
    assert any("is never written" in m for m in msgs)
    if with_prog:
        assert f"{dropped.ins} is missing from the tape (1 of 1 absent)" in msgs


def test_dropped_instruction_that_signals_nothing():
    """The last layer's residual signals no counter: the hole in the output still names it."""
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "residual" and d.ins.layer == CFG.layers - 1)
    ins = decode_slot(tape, k).ins
    msgs = problems(delete_slot(tape, k), PROG)
    assert f"{ins} is missing from the tape (1 of 1 absent)" in msgs
    base = LAY.xout_row(ins.layer) * CFG.d
    assert f"xout[{base + ins.row0}:{base + ins.row0 + LAY.tiling.red_rows}] is never written " \
           f"(the instruction writing it is missing?)" in msgs


# ---- wrong counter targets / counters ---------------------------------------------------------
@pytest.mark.parametrize("delta", [+1, -1])
def test_wrong_counter_target(delta):
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "down" and d.ins.layer == 0 and d.ins.kc == 1)
    c, t = int(tape.words[k, 1]), int(tape.words[k, 2])
    assert t == PROG.targets()[c] > 1
    bad = copy(tape)
    bad.words[k, 2] = t + delta
    msgs = problems(bad, PROG)
    assert msgs == [f"{name(tape, k)}: waits on counter {c} ({tape.counters[c]}) for {t + delta}, "
                    f"but it has {t} producer(s)"]
    assert "instruction " + str(k) + " (down, sm " in msgs[0]


def test_zero_target():
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "oproj")
    bad = copy(tape)
    bad.words[k, 2] = 0
    msgs = problems(bad)
    assert any(m.startswith(name(tape, k)) and "targets must be >= 1" in m for m in msgs)


def test_waiting_on_the_wrong_counter():
    """A down tile of K chunk 1 waiting on chunk 0's counter (same target): the verifier sees it
    reads act values whose producers it does not wait for."""
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "down" and d.ins.layer == 0 and d.ins.kc == 1)
    c1 = int(tape.words[k, 1])
    c0 = tape.counters.index(tape.counters[c1].replace(",1]", ",0]"))
    assert c0 != c1 and PROG.targets()[c0] == PROG.targets()[c1]
    bad = copy(tape)
    bad.words[k, 1] = c0
    msgs = problems(bad, PROG)
    assert any(m.startswith(f"{name(tape, k)}: reads act[") and "which it does not wait for" in m
               and f"signals counter {c1} ({tape.counters[c1]})" in m for m in msgs), msgs


def test_missing_wait():
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "oproj" and d.ins.layer == 1)
    bad = copy(tape)
    bad.words[k, 1], bad.words[k, 2] = NO_COUNTER, 0
    msgs = problems(bad, PROG)
    assert any(m.startswith(f"{name(tape, k)}: reads attn[") and "which it does not wait for" in m for m in msgs)


@pytest.mark.parametrize("field,value", [("wait", "n"), ("wait", -2), ("signal", "n"), ("signal", 10_000)])
def test_counter_index_out_of_range(field, value):
    tape = good_tape()
    n = tape.n_counters
    v = n if value == "n" else value
    bad = copy(tape)
    if field == "wait":
        k = find(tape, lambda d: d.ins.NAME == "gate_up")
        bad.words[k, 1] = v
        want = f"{name(tape, k)}: waits on counter {v}, but the tape has {n} counters"
    else:
        k = find(tape, lambda d: d.ins.NAME == "attn_partial")
        bad.words[k, 5] = v
        want = f"{name(tape, k)}: signals counter {v}, but the tape has {n} counters"
    assert want in problems(bad)


# ---- operands, opcodes -------------------------------------------------------------------------
# every opcode of the layer program (the decoder's opcodes get their own tests in test_decoder.py)
_IN_PROG = {ins.NAME for ins in PROG.instrs}
OPERANDS = [(op, f) for op, cls in REGISTRY.items() if op in _IN_PROG for f in cls.operand_names()]


def test_operand_cases_cover_every_layer_opcode():
    assert {"qkv", "attn_partial", "attn_reduce", "oproj", "o_reduce", "gate_up", "down", "residual"} <= _IN_PROG


@pytest.mark.parametrize("opname,field", OPERANDS, ids=[f"{o}.{f}" for o, f in OPERANDS])
@pytest.mark.parametrize("value", [10_000, -1])
def test_operand_out_of_range(opname, field, value):
    """Every operand of every opcode is range-checked."""
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == opname)
    bad = copy(tape)
    bad.words[k, HEADER + REGISTRY[opname].operand_names().index(field)] = value
    msgs = problems(bad)
    hits = [m for m in msgs if m.startswith(f"{name(tape, k)}: operand out of range: ")]
    assert hits, msgs[:4]
    assert any(re.search(rf"\b{field} {value}\b", m) for m in hits), hits


@pytest.mark.parametrize("op", [0, 99, -7])
def test_unknown_opcode(op):
    tape = good_tape()
    k = int(tape.offsets[1]) + 2          # the third instruction of SM 1
    bad = copy(tape)
    bad.words[k, 0] = op
    assert f"instruction {k} (sm 1): unknown opcode {op}" in problems(bad)


def test_bad_offsets():
    tape = good_tape()
    bad = copy(tape)
    bad.offsets[-1] -= 1
    msgs = problems(bad)
    assert len(msgs) == 1 and "do not split" in msgs[0]


# ---- written twice ---------------------------------------------------------------------------
@pytest.mark.parametrize("opname", ["gate_up", "residual", "qkv"])
def test_duplicated_instruction(opname):
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == opname and d.ins.layer == CFG.layers - 1)
    s = sm_of(tape, k)
    bad = insert_row(tape, k + 1, s, tape.words[k])         # the same words twice in a row
    ins = decode_slot(tape, k).ins
    msgs = problems(bad, PROG)
    r = ins.writes(LAY)[0]
    want = (f"instruction {k + 1} ({opname}, sm {s}): writes {r.buf}[{r.lo}:{r.hi}], overlapping an earlier "
            f"write (every element must be written exactly once per call)")
    assert want in msgs, msgs[:6]
    assert f"instruction {k + 1} ({opname}, sm {s}): {ins} appears 2 times, the program has it 1 times" in msgs


def test_duplicated_on_another_sm():
    tape = good_tape()
    k = find(tape, lambda d: d.ins.NAME == "down")
    s = sm_of(tape, k)
    other = (s + 1) % tape.num_sms
    slot = int(tape.offsets[other + 1])                      # end of the other SM's queue
    bad = insert_row(tape, slot, other, tape.words[k])
    msgs = problems(bad)
    first, second = sorted((k, slot))
    assert any(m.startswith(name(bad, second)) and "overlapping an earlier write" in m for m in msgs), msgs[:6]


# ---- deadlocks ------------------------------------------------------------------------------------
def consumer_before_producer(num_sms: int = 2):
    """A schedule where, on one SM, a consumer is moved just ahead of a producer it waits for."""
    sched = list_schedule(PROG, num_sms)
    producers = PROG.producers()
    for s, q in enumerate(sched.queues):
        for pos, i in enumerate(q):
            for c in PROG.waits[i]:
                same = [q.index(p) for p in producers[c] if p in q[:pos]]
                if same:
                    j = min(same)
                    q.insert(j, q.pop(pos))
                    return encode(sched), s, j, i
    raise AssertionError("no SM holds a producer and its consumer")


def test_deadlock_consumer_before_producer_same_sm():
    tape, s, j, i = consumer_before_producer()
    slot = int(tape.offsets[s]) + j
    assert tape.prog_index[slot] == i
    c = PROG.waits[i][0]
    msgs = problems(tape, PROG)
    hit = [m for m in msgs if m.startswith(f"deadlock: {name(tape, slot)} waits on counter ")]
    assert hit, msgs
    assert f"sm {s}" in hit[0] and "never gets to run" in hit[0]
    assert any(f"counter {cc} ({tape.counters[cc]})" in hit[0] for cc in PROG.waits[i])
    del c


def cross_sm_cycle() -> tuple[Tape, int, int]:
    """SM 1 runs one attention merge, then every QKV tile; SM 0 runs everything else. SM 0's first
    attention partial waits for QKV tiles queued behind the merge on SM 1, which waits for SM 0."""
    red = next(i for i, ins in enumerate(PROG.instrs) if ins.NAME == "attn_reduce")
    qkv = [i for i, ins in enumerate(PROG.instrs) if ins.NAME == "qkv" and ins.layer == 0]
    sm1 = [red] + qkv
    sm0 = [i for i in range(len(PROG)) if i not in set(sm1)]
    tape = encode(Schedule(PROG, 2, [sm0, sm1], "cycle"))
    first_partial = next(k for k in range(len(tape)) if decode_slot(tape, k).ins.NAME == "attn_partial")
    return tape, first_partial, int(tape.offsets[1])


def test_deadlock_cross_sm_cycle():
    tape, k0, k1 = cross_sm_cycle()
    assert sm_of(tape, k0) == 0 and sm_of(tape, k1) == 1
    msgs = problems(tape, PROG)
    assert any(m.startswith(f"deadlock: {name(tape, k0)} waits on counter ") for m in msgs), msgs
    assert any(m.startswith(f"deadlock: instruction {k1} (attn_reduce, sm 1) waits on counter ") for m in msgs), msgs


def test_sequential_mode_rejects_sm0_waiting_on_sm1():
    """Round-robin on 2 SMs is fine on a GPU but not when SM 0 runs to the end before SM 1
    starts (the Triton interpreter): find the first SM 0 instruction that needs SM 1."""
    tape = encode(round_robin(PROG, 2))
    verify(tape, PROG)                                        # any-interleaving check passes
    done = [0] * tape.n_counters
    expect = None
    for k in tape.sm_range(0):
        d = decode_slot(tape, k, 0)
        if any(done[c] < t for c, t in d.waits):
            expect = (k, next((c, t) for c, t in d.waits if done[c] < t), d)
            break
        if d.signal != NO_COUNTER:
            done[d.signal] += 1
    assert expect is not None
    k, (c, t), d = expect
    msgs = problems(tape, PROG, sequential=True)
    assert msgs == [f"instruction {k} ({d.ins.NAME}, sm 0): under sequential execution (Triton interpreter) waits "
                    f"on counter {c} ({tape.counters[c]}) for {t} but only {done[c]} producers ran before it"]
    # a single queue in topological order is fine sequentially
    verify(good_tape(1), PROG, sequential=True)


# ---- the pool (instructions taken by ticket at run time) ------------------------------------
def pooled_tape(num_sms: int = 3, frac: float = 0.4) -> Tape:
    from schedule import CostModel, simulate
    from schedule.assign import with_pool
    base = simulate(list_schedule(PROG, num_sms), CostModel())
    return encode(with_pool(base, CostModel(), base.makespan * frac))


def pool_name(tape: Tape, slot: int) -> str:
    return f"instruction {slot} ({BY_OPCODE[int(tape.words[slot, 0])].NAME}, pool)"


def test_pooled_tapes_verify():
    for n in (1, 2, 3, 8):
        for frac in (0.2, 0.6, 2.0):
            t = pooled_tape(n, frac)
            assert t.pool_len > 0
            verify(t, PROG)
    verify(pooled_tape(1, 0.5), PROG, sequential=True)


def test_queue_waiting_on_the_pool():
    """Move a pool instruction that waits on another pool instruction to the end of SM 0's queue."""
    tape = pooled_tape()
    pool = list(tape.pool_range())
    sig = {int(tape.words[k, 5]): k for k in pool if int(tape.words[k, 5]) != NO_COUNTER}
    k = next(k for k in pool if any(int(tape.words[k, 1 + 2 * j]) in sig for j in range(2)))
    c = next(int(tape.words[k, 1 + 2 * j]) for j in range(2) if int(tape.words[k, 1 + 2 * j]) in sig)
    n = tape.num_sms
    t = copy(tape)
    end0 = int(tape.offsets[1])
    rows = list(range(len(tape)))
    rows.remove(k)
    rows.insert(end0, k)
    t.words = tape.words[rows]
    t.prog_index = [tape.prog_index[r] for r in rows]
    t.offsets[1:n + 1] += 1
    moved = end0                                   # its new slot, the last of SM 0's queue
    msgs = problems(t, PROG)
    producer = [j for j in t.pool_range() if int(t.words[j, 5]) == c][0]
    assert any(m.startswith(f"instruction {moved} ({BY_OPCODE[int(t.words[moved, 0])].NAME}, sm 0): waits on "
                            f"counter {c} ({t.counters[c]}), which pool {pool_name(t, producer)} signals: "
                            "a queue may not wait on the pool") for m in msgs), msgs


def test_pool_out_of_topological_order():
    tape = pooled_tape()
    pool = list(tape.pool_range())
    t = copy(tape)
    rows = list(range(pool[0])) + pool[::-1]
    t.words = tape.words[rows]
    t.prog_index = [tape.prog_index[r] for r in rows]
    msgs = problems(t, PROG)
    late = [m for m in msgs if "later in the pool (the pool must be in a topological order)" in m]
    assert late and all(", pool): waits on counter" in m for m in late)


def test_pool_ticket_counter_misused():
    tape = pooled_tape()
    k = next(k for k in tape.sm_range(0) if int(tape.words[k, 1]) != NO_COUNTER)
    t = copy(tape)
    t.words[k, 1] = tape.pool_counter
    msgs = problems(t, PROG)
    assert any(m.startswith(f"{name(t, k)}: uses counter {tape.pool_counter} (pool), the pool's ticket counter")
               for m in msgs), msgs
    t2 = copy(tape)
    t2.pool_counter = NO_COUNTER
    msgs = problems(t2, PROG)
    assert msgs == [f"the pool holds {tape.pool_len} instructions but its ticket counter is -1 "
                    f"(the tape has {tape.n_counters} counters)"]


def test_sequential_mode_runs_the_pool_after_sm0():
    """The interpreter runs SM 0's queue, then SM 0 takes every ticket: a pool instruction that
    needs SM 1's queue cannot run there."""
    tape = pooled_tape(2, 0.5)
    verify(tape, PROG)
    msgs = problems(tape, PROG, sequential=True)
    assert len(msgs) == 1 and "under sequential execution (Triton interpreter)" in msgs[0]
    assert ", pool): under sequential" in msgs[0] or ", sm 0): under sequential" in msgs[0]
