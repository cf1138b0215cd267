"""GATE_UP chains (``Tiling.gu_chain``): an SM's consecutive GATE_UP tiles of one layer that wait on
nothing stream in one pipelined loop. The tape marks each chain's head (``GateUp.run``); the VM and
the verifier still see every slot, the kernel runs the chain in the head's device function (the same
sums in the same order: bitwise the unchained kernel) and skips the slots it ran."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import bits, clone_cache, rand_x, require_interpreter
import opcodes.gate_up as gate_up
from interp import build_layer, layer_step, teardown
from opcodes import HEADER, ModelConfig, Tiling
from opcodes.gate_up import GateUp
from opcodes.reference import make_kv_cache, make_weights
from opcodes.tp import TPLayout
from schedule import compile_model
from schedule.tape import decode
from schedule.verify import TapeError, verify
from schedule.vm import run_tape, run_tp

require_interpreter()

CFG = ModelConfig.from_name("small-2layer")
COLUMN = dict(row_bytes=0, gu_rows=16)          # the column loop (chains need it): 20 gate/up tiles a layer
RUN = HEADER + GateUp.operand_names().index("run")


def _tiling(**over):
    return Tiling.for_config(CFG, **COLUMN, **over)


def _queues(tape):
    """Per SM, its slots' decoded instructions in queue order."""
    ds = decode(tape)
    return [[d for d in ds if d.sm == s] for s in range(tape.num_sms)]


def test_heads_count_the_gate_ups_after_them():
    c = compile_model(CFG, 5, max_seq=64, tiling=_tiling(gu_chain=1), pool_us=0)
    heads = 0
    for q in _queues(c.tape):
        j = 0
        while j < len(q):
            d = q[j]
            if d.ins.NAME == "gate_up":
                n = 0
                while (j + n + 1 < len(q) and q[j + n + 1].ins.NAME == "gate_up"
                       and q[j + n + 1].ins.layer == d.ins.layer and not q[j + n + 1].waits):
                    assert q[j + n + 1].ins.run == 0
                    n += 1
                assert d.ins.run == n
                heads += n > 0
                j += n + 1
            else:
                assert getattr(d.ins, "run", 0) == 0
                j += 1
    assert heads == c.tape.meta["gu_chains"] > 0
    # without the option no instruction is a head
    c0 = compile_model(CFG, 5, max_seq=64, tiling=_tiling(), pool_us=0)
    assert all(getattr(d.ins, "run", 0) == 0 for d in decode(c0.tape))


def test_the_vm_runs_every_slot_as_before():
    w = make_weights(CFG, seed=3)
    x = rand_x(CFG.d, 4)
    outs = []
    for gc in (0, 1):
        c = compile_model(CFG, 5, max_seq=64, tiling=_tiling(gu_chain=gc), pool_us=0)
        kv = make_kv_cache(CFG, 64, 17)
        outs.append((run_tape(c.tape, w, kv, x, 17, seed=1), kv))
    assert torch.equal(bits(outs[0][0]), bits(outs[1][0]))


@pytest.mark.parametrize("pos", [0, 23])
def test_kernel_chains_and_is_bitwise_the_unchained_kernel(pos, monkeypatch):
    """On the CPU the kernel runs one SM: with no pool each layer's 20 gate/up tiles are one chain of
    20, run by its head (a spy on the chain loop sees it), over two calls; pool slots (the plan's
    last microseconds, any SM) run one tile each."""
    w = make_weights(CFG, seed=5)
    x = rand_x(CFG.d, 6)
    kv0 = make_kv_cache(CFG, 64, pos)
    chains = []
    orig = gate_up._gu_chain

    def spy(*args, **kw):
        chains.append(int(args[1]))
        return orig(*args, **kw)

    outs, want = [], {}
    for pool_us in (0, None):
        for gc in (0, 1):
            if gc:
                monkeypatch.setattr(gate_up, "_gu_chain", spy)
                chains.clear()
            kv = clone_cache(kv0)
            h = build_layer(w, kv, CFG.to_dict(), 64, tiling=_tiling(gu_chain=gc), pool_us=pool_us)
            ys = [layer_step(h, x, pos).clone(), layer_step(h, x, pos + 1).clone()]
            outs.append((ys, kv))
            if gc:
                ds = decode(h.tape)
                heads = [d.ins.run + 1 for d in ds if d.ins.NAME == "gate_up" and d.sm != h.tape.POOL
                         and not any(e.ins.NAME == "gate_up" and e.sm == d.sm and e.slot < d.slot <= e.slot + e.ins.run
                                     for e in ds)]
                pooled = sum(d.ins.NAME == "gate_up" and d.sm == h.tape.POOL for d in ds)
                want[pool_us] = (sorted((heads + [1] * pooled) * 2), sorted(chains))
            teardown(h)
    n_gu = CFG.ffn // COLUMN["gu_rows"]
    assert want[0][0] == [n_gu] * (2 * CFG.layers)   # no pool: one chain per layer per call, every tile in it
    for exp, seen in want.values():
        assert seen == exp
    for o in outs[1:]:
        for a, b in zip(outs[0][0], o[0]):
            assert torch.equal(bits(a), bits(b))
        assert all(torch.equal(bits(a), bits(b)) for p, q in zip(outs[0][1], o[1]) for a, b in zip(p, q))


def _with_run(tape, slot, run):
    words = tape.words.clone()
    words[slot, RUN] = run
    return dataclasses.replace(tape, words=words) if dataclasses.is_dataclass(tape) else type(tape)(
        tape.lay, tape.num_sms, words, tape.offsets.clone(), list(tape.counters), list(tape.prog_index),
        dict(tape.meta), tape.pool_counter)


def test_verifier_names_a_broken_chain():
    c = compile_model(CFG, 5, max_seq=64, tiling=_tiling(gu_chain=1), pool_us=0)
    q = next(q for q in _queues(c.tape) if any(d.ins.NAME == "gate_up" and d.ins.run for d in q))
    j = next(j for j, d in enumerate(q) if d.ins.NAME == "gate_up" and d.ins.run)
    head = q[j]
    # one slot too many: the chain covers what follows the last gate/up (another opcode, a waiting
    # slot, or the end of the queue)
    with pytest.raises(TapeError, match=r"run=\d+ (covers|reaches past)"):
        verify(_with_run(c.tape, head.slot, head.ins.run + 1))
    # a pool instruction cannot chain
    cp = compile_model(CFG, 5, max_seq=64, tiling=_tiling(gu_chain=1))
    pool = [d for d in decode(cp.tape) if d.sm == cp.tape.POOL and d.ins.NAME == "gate_up"]
    assert pool, "the default pool of this config holds gate/up tiles"
    with pytest.raises(TapeError, match="pool instruction cannot run"):
        verify(_with_run(cp.tape, pool[0].slot, 1))
    # a negative run is an operand out of range
    with pytest.raises(TapeError, match="operand out of range: run -1"):
        verify(_with_run(c.tape, head.slot, -1))


def test_tensor_parallel_tapes_chain_and_stay_bitwise():
    w = make_weights(CFG, seed=7)
    x = rand_x(CFG.d, 8)
    sc = TPLayout.of(CFG, 0, 2).cfg
    outs = []
    for gc in (0, 1):
        t = TPLayout.default_tiling(sc, **COLUMN, gu_chain=gc)
        c = compile_model(CFG, 3, max_seq=64, tiling=t, tp=2, decoder=False, pool_us=0)
        assert (max(getattr(d.ins, "run", 0) for d in decode(c.tapes[0])) > 0) == bool(gc)
        kv = make_kv_cache(CFG, 64, 30)
        outs.append(run_tp(c.tapes, w, kv, x, 30, seed=1, calls=2, return_all=True))
    for a, b in zip(outs[0], outs[1]):
        assert torch.equal(a[0], b[0]) and torch.equal(b[0], b[1])
