"""``schedule.verify.verify_system``: one verifier over a system of tapes (one per GPU). One tape is
``verify``'s check; two are a tensor-parallel step's ranks, whose problems name the rank."""
from __future__ import annotations

import pytest

from opcodes import PRESETS
from schedule import compile_model, verify, verify_system, verify_tp
from schedule.verify import TapeError

CFG = PRESETS["small-2layer"]
MAX_SEQ = 64


@pytest.fixture(scope="module")
def one():
    return compile_model(CFG, 3, max_seq=MAX_SEQ, decoder=False)


@pytest.fixture(scope="module")
def two():
    return compile_model(CFG, 3, max_seq=MAX_SEQ, decoder=False, tp=2)


def test_one_tape_is_verify(one):
    a, b = verify(one.tape, one.prog), verify_system([one.tape], [one.prog])
    assert a == b and a.n_ranks == 1 and a.n_instructions == len(one.tape) and str(a).startswith("verified: ")


def test_two_tapes_are_verify_tp(two):
    a, b = verify_tp(two.tapes), verify_system(two.tapes)
    assert a == b == two.report and a.n_ranks == 2 and a.n_cross_edges > 0
    assert a.n_instructions == sum(len(t) for t in two.tapes) and "cross-rank" in str(a)


def test_a_rank_structure_problem_names_the_rank(two):
    t0, t1 = two.tapes
    bad = compile_model(CFG, 3, max_seq=MAX_SEQ, decoder=False, tp=2).tapes[1]
    k = int(bad.offsets[1]) + 1                       # the second instruction of SM 1
    bad.words[k, 0] = 99
    with pytest.raises(TapeError) as e:
        verify_system([t0, bad])
    assert e.value.problems == [f"rank 1 instruction {k} (sm 1): unknown opcode 99"]
    with pytest.raises(TapeError) as e:
        verify(bad)                                   # the rank alone: no rank in the names
    assert e.value.problems == [f"instruction {k} (sm 1): unknown opcode 99"]


def test_system_sizes(one, two):
    with pytest.raises(TapeError, match="a system of 3 tapes"):
        verify_system([*two.tapes, two.tapes[0]])
    with pytest.raises(TapeError, match="verify_tp takes the tapes of 2 ranks, got 1"):
        verify_tp([one.tape])
    with pytest.raises(ValueError, match="sequential"):
        verify_system(two.tapes, sequential=True)
