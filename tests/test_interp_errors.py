"""Bad inputs and broken tapes through the interpreter runtime (the CPU parts).

* A table of bad inputs to ``build_layer`` and to ``layer_step``: each raises ValueError or
  TypeError whose message names the argument, says what was expected and what was given; a
  rejected ``layer_step`` writes nothing into the KV cache (bitwise) and leaves ``x`` alone.
* Broken tapes with the verifier bypassed (a wrong target, a missing producer, a consumer
  queued before its producer): ``layer_step`` raises ``interp.MegakernelError`` after its spin
  limit of polls (never hangs; the time it takes on a GPU is checked in ``tests/test_gpu.py``),
  naming the stuck instruction (slot, opcode, SM) and the counter; the next launch of a valid
  handle in the same process works. With the verifier on, ``build_layer`` rejects each tape
  with ``schedule.TapeError`` naming the instruction.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

import pytest
import torch

import interp
import opcodes
from conftest import (bitwise_equal, bump_target, caches_equal, check_message, clone_cache, drop_producer,
                      first_waiter, rand_x, require_interpreter)
from interp import build_layer, layer_step, teardown
from interp.runtime import INTERPRETER_SPIN_LIMIT
from opcodes.config import PRESETS
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err, rope_tables
from schedule import TapeError, compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = PRESETS["tiny"]            # d 64, ffn 128, n_q 4, n_kv 1, hd 16
MAX_SEQ, PREFILL = 64, 37
TOL = 1.5e-2
D = CFG.d


def _x(seed=0, d=D):
    return rand_x(d, 500 + seed)


# ---------------------------------------------------------------------------------------------
# build_layer: a table of bad inputs
# ---------------------------------------------------------------------------------------------

@dataclasses.dataclass
class Inputs:
    weights: dict
    kv_cache: list
    cfg: object
    max_seq_len: object

    @classmethod
    def good(cls, cfg=CFG) -> "Inputs":
        return cls(make_weights(cfg, seed=3), make_kv_cache(cfg, MAX_SEQ, PREFILL, seed=4), cfg.to_dict(), MAX_SEQ)

    def L0(self) -> dict:
        return self.weights["layers"][0]


def _set(**kw) -> Callable[[Inputs], None]:
    def f(i: Inputs) -> None:
        for k, v in kw.items():
            setattr(i, k, v(i) if callable(v) else v)
    return f


def _w(name, fn) -> Callable[[Inputs], None]:
    def f(i: Inputs) -> None:
        i.L0()[name] = fn(i.L0()[name])
    return f


def _cfg(**kw) -> Callable[[Inputs], None]:
    def f(i: Inputs) -> None:
        i.cfg = {**i.cfg, **kw}
    return f


def _cfg_drop(key) -> Callable[[Inputs], None]:
    def f(i: Inputs) -> None:
        i.cfg = {k: v for k, v in i.cfg.items() if k != key}
    return f


def _kv(l, j, t_fn) -> Callable[[Inputs], None]:
    def f(i: Inputs) -> None:
        pair = list(i.kv_cache[l])
        pair[j] = t_fn(pair)
        i.kv_cache[l] = tuple(pair)
    return f


def _overlap_kv(i: Inputs) -> None:
    big = torch.zeros(1, CFG.n_kv, MAX_SEQ + 1, CFG.hd, dtype=torch.bfloat16)
    k, v = big[:, :, :MAX_SEQ], big[:, :, 1:]    # both contiguous, 32 bytes apart: they overlap
    assert k.is_contiguous() and v.is_contiguous() and k.data_ptr() != v.data_ptr()
    i.kv_cache[0] = (k, v)


def _meta(t):
    return torch.empty(t.shape, dtype=t.dtype, device="meta")



# (id, mutation of good inputs, exception types, strings the message must contain)
BUILD_CASES = [
    ("weight-fp32", _w("q", lambda t: t.float()), TypeError,
     ["weights['layers'][0]['q']", "bfloat16", "float32"]),
    ("weight-fp16", _w("down", lambda t: t.half()), TypeError,
     ["weights['layers'][0]['down']", "bfloat16", "float16"]),
    ("weight-not-a-tensor", _w("up", lambda t: t.float().numpy()),
     TypeError, ["weights['layers'][0]['up']", "tensor", "ndarray"]),
    ("weight-wrong-shape", _w("gate", lambda t: torch.zeros(CFG.ffn + 1, D, dtype=torch.bfloat16)), ValueError,
     ["weights['layers'][0]['gate']", f"({CFG.ffn}, {D})", f"({CFG.ffn + 1}, {D})"]),
    ("weight-transposed-shape", _w("o", lambda t: torch.zeros(CFG.q_dim, D + 16, dtype=torch.bfloat16).T.contiguous()),
     ValueError, ["weights['layers'][0]['o']", f"({D}, {CFG.q_dim})", f"({D + 16}, {CFG.q_dim})"]),
    ("weight-norm-wrong-shape", _w("in_norm", lambda t: t[:-1].clone()), ValueError,
     ["weights['layers'][0]['in_norm']", f"({D},)", f"({D - 1},)"]),
    ("weight-non-contiguous", _w("q", lambda t: t.T.contiguous().T), ValueError,
     ["weights['layers'][0]['q']", "contiguous", "non-contiguous"]),
    ("weight-on-meta", _w("v", _meta), ValueError, ["weights['layers'][0]['v']", "cpu", "meta"]),
    ("weight-missing-key", lambda i: i.L0().pop("down"), ValueError, ["weights['layers'][0]", "down", "missing"]),
    ("weights-not-a-dict", _set(weights=lambda i: i.weights["layers"]), TypeError, ["weights", "dict", "list"]),
    ("weights-too-many-layers", lambda i: i.weights["layers"].append(dict(i.L0())), ValueError,
     ["weights['layers']", "1", "2"]),
    ("weights-too-few-layers", _cfg(layers=2), ValueError, ["weights['layers']", "2", "1"]),
    ("cache-shorter-than-max-seq", _set(kv_cache=lambda i: make_kv_cache(CFG, MAX_SEQ - 16, PREFILL)), ValueError,
     ["kv_cache[0][0]", f"(1, {CFG.n_kv}, {MAX_SEQ}, {CFG.hd})", f"(1, {CFG.n_kv}, {MAX_SEQ - 16}, {CFG.hd})"]),
    ("cache-longer-than-max-seq", _set(kv_cache=lambda i: make_kv_cache(CFG, MAX_SEQ + 16, PREFILL)), ValueError,
     ["kv_cache[0][0]", f"{MAX_SEQ}", f"{MAX_SEQ + 16}"]),
    ("cache-batch-2", _set(kv_cache=lambda i: make_kv_cache(CFG, MAX_SEQ, PREFILL, batch=2)), ValueError,
     ["kv_cache[0][0]", "batch 1", f"(2, {CFG.n_kv}, {MAX_SEQ}, {CFG.hd})"]),
    ("cache-v-fp32", _kv(0, 1, lambda p: p[1].float()), TypeError, ["kv_cache[0][1]", "bfloat16", "float32"]),
    ("cache-k-non-contiguous",
     _kv(0, 0, lambda p: torch.zeros(1, CFG.n_kv, CFG.hd, MAX_SEQ, dtype=torch.bfloat16).transpose(2, 3)),
     ValueError, ["kv_cache[0][0]", "contiguous", "non-contiguous"]),
    ("cache-wrong-heads", _set(kv_cache=lambda i: make_kv_cache(dataclasses.replace(CFG, n_kv=2, n_q=4), MAX_SEQ,
                                                                  PREFILL)),
     ValueError, ["kv_cache[0][0]", f"(1, 1, {MAX_SEQ}, {CFG.hd})", f"(1, 2, {MAX_SEQ}, {CFG.hd})"]),
    ("cache-not-a-list", _set(kv_cache=lambda i: i.kv_cache[0][0]), TypeError, ["kv_cache", "list", f"(1, {CFG.n_kv}, {MAX_SEQ}, {CFG.hd})"]),
    ("cache-too-many-layers", _set(kv_cache=lambda i: i.kv_cache * 2), ValueError, ["kv_cache", "1", "2"]),
    ("cache-pair-of-three", lambda i: i.kv_cache.__setitem__(0, (*i.kv_cache[0], i.kv_cache[0][1].clone())),
     TypeError, ["kv_cache[0]", "pair", "tuple"]),
    ("cache-k-is-v", _kv(0, 1, lambda p: p[0]), ValueError, ["kv_cache[0][1]", "shares memory"]),
    pytest.param("cache-k-v-overlap", _overlap_kv, ValueError, ["kv_cache[0][1]", "overlap"]),
    ("cfg-d-disagrees", _cfg(d=2 * D), ValueError, ["weights['layers'][0]", f"({2 * D},)", f"({D},)"]),
    ("cfg-ffn-disagrees", _cfg(ffn=CFG.ffn + 32), ValueError,
     ["weights['layers'][0]['gate']", f"({CFG.ffn + 32}, {D})", f"({CFG.ffn}, {D})"]),
    ("cfg-n_kv-disagrees", _cfg(n_kv=2), ValueError, ["weights['layers'][0]['k']", f"(32, {D})", f"(16, {D})"]),
    ("cfg-missing-key", _cfg_drop("ffn"), ValueError, ["cfg", "missing", "ffn"]),
    ("cfg-unknown-key", _cfg(bogus=1), ValueError, ["cfg", "unknown", "bogus"]),
    ("cfg-n_q-not-multiple-of-n_kv", _cfg(n_kv=3), ValueError, ["cfg", "n_q", "n_kv", "multiple"]),
    ("cfg-d-a-string", _cfg(d="64"), TypeError, ["cfg", "'d'", "int", "str"]),
    ("cfg-eps-negative", _cfg(eps=-1e-5), ValueError, ["cfg", "eps", "positive", "-1e-05"]),
    ("cfg-hd-odd", _cfg(hd=15), ValueError, ["cfg", "hd", "15"]),
    ("cfg-wdtype-fp8", _cfg(wdtype="fp8"), ValueError, ["cfg", "wdtype", "bf16", "fp8"]),
    ("cfg-not-a-dict", _set(cfg="tiny"), TypeError, ["cfg", "dict", "str"]),
    ("max-seq-len-float", _set(max_seq_len=float(MAX_SEQ)), TypeError, ["max_seq_len", "int", "float"]),
    ("max-seq-len-tensor", _set(max_seq_len=torch.tensor(MAX_SEQ)), TypeError, ["max_seq_len", "int", "torch.int64"]),
    ("max-seq-len-zero", _set(max_seq_len=0), ValueError, ["max_seq_len", "positive", "0"]),
    ("max-seq-len-disagrees-with-cache", _set(max_seq_len=MAX_SEQ + 8), ValueError,
     ["kv_cache[0][0]", f"{MAX_SEQ + 8}", f"{MAX_SEQ}"]),
]


def _case_id(c):
    return c.values[0] if hasattr(c, "values") else c[0]


@pytest.mark.parametrize("case_id,mutate,exc,names", BUILD_CASES, ids=[_case_id(c) for c in BUILD_CASES])
def test_build_layer_rejects(case_id, mutate, exc, names):
    i = Inputs.good()
    mutate(i)
    snapshot = [[t.clone() for t in pair] for pair in i.kv_cache
                if isinstance(pair, tuple) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                   for t in pair)]
    with pytest.raises((ValueError, TypeError)) as ei:
        build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len)
    assert isinstance(ei.value, exc), f"{case_id}: expected {exc.__name__}, got {type(ei.value).__name__}: {ei.value}"
    check_message(ei.value, names)
    # nothing was written into the caller's cache
    now = [[t for t in pair] for pair in i.kv_cache
           if isinstance(pair, tuple) and all(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in pair)]
    assert caches_equal(snapshot, now)


def test_build_layer_options_rejected():
    i = Inputs.good()
    for kw, names in [(dict(num_sms=2), ["num_sms", "1", "2"]), (dict(num_sms=0), ["num_sms", "0"]),
                      (dict(spin_limit=0), ["spin_limit", "positive", "0"]),
                      (dict(spin_limit=1.5), ["spin_limit", "1.5"])]:
        with pytest.raises((ValueError, TypeError)) as ei:
            build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, **kw)
        check_message(ei.value, names)


def test_good_inputs_build():
    """The table's baseline is valid (so every rejection above is due to its one mutation)."""
    i = Inputs.good()
    h = build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len)
    teardown(h)


# ---------------------------------------------------------------------------------------------
# layer_step: a table of bad (x, pos)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def handle():
    i = Inputs.good()
    h = build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len)
    yield h, i
    teardown(h)


def _noncontig_x():
    x = torch.randn(1, 2 * D).to(torch.bfloat16)[:, ::2]
    assert x.shape == (1, D) and not x.is_contiguous()
    return x



OK = object()       # a valid pos (PREFILL) in STEP_CASES

STEP_CASES = [
    # (id, x factory, pos, exception types, strings the message must contain)
    ("pos-negative", lambda: _x(), -1, ValueError, ["pos", f"[0, max_seq_len={MAX_SEQ})", "-1"]),
    ("pos-eq-max-seq", lambda: _x(), MAX_SEQ, ValueError, ["pos", f"{MAX_SEQ})", f"{MAX_SEQ}"]),
    ("pos-huge", lambda: _x(), 10**9, ValueError, ["pos", f"{MAX_SEQ}", f"{10**9}"]),
    ("pos-float", lambda: _x(), float(PREFILL), TypeError, ["pos", "int", "float"]),
    ("pos-bool", lambda: _x(), True, TypeError, ["pos", "int", "bool"]),
    ("pos-str", lambda: _x(), str(PREFILL), TypeError, ["pos", "int", "str"]),
    ("pos-fraction", lambda: _x(), 1.5, TypeError, ["pos", "int", "1.5"]),     # None: the device's position
    ("pos-float-tensor", lambda: _x(), torch.tensor(float(PREFILL)), TypeError, ["pos", "int", "float"]),
    ("pos-tensor-out-of-range", lambda: _x(), torch.tensor(MAX_SEQ), ValueError, ["pos", f"{MAX_SEQ}"]),
    ("x-fp32", lambda: _x().float(), OK, (TypeError, ValueError), ["x", "bfloat16", "float32"]),
    ("x-fp16", lambda: _x().half(), OK, (TypeError, ValueError), ["x", "bfloat16", "float16"]),
    ("x-too-long", lambda: _x(d=D + 1), OK, ValueError, ["x", f"(1, {D})", f"(1, {D + 1})"]),
    ("x-batch-2", lambda: torch.cat([_x(), _x(1)]), OK, ValueError, ["x", f"(1, {D})", f"(2, {D})"]),
    ("x-column", lambda: _x().reshape(D, 1), OK, ValueError, ["x", f"(1, {D})", f"({D}, 1)"]),
    pytest.param("x-1d", lambda: _x().reshape(D), OK, ValueError, ["x", f"(1, {D})", f"({D},)"]),
    pytest.param("x-3d", lambda: _x().reshape(1, 1, D), OK, ValueError, ["x", f"(1, {D})", f"(1, 1, {D})"]),
    ("x-non-contiguous", _noncontig_x, OK, ValueError, ["x", "contiguous", "non-contiguous"]),
    ("x-on-meta", lambda: _meta(_x()), OK, ValueError, ["x", "cpu", "meta"]),
    ("x-not-a-tensor", lambda: _x().tolist(), OK, TypeError, ["x", "tensor", "list"]),
    ("x-none", lambda: None, OK, TypeError, ["x", "tensor", "None"]),
]


@pytest.mark.parametrize("case_id,make_x,pos,exc,names", STEP_CASES, ids=[_case_id(c) for c in STEP_CASES])
def test_layer_step_rejects(handle, case_id, make_x, pos, exc, names):
    h, i = handle
    x = make_x()
    if pos is OK:
        pos = PREFILL
    x_before = x.clone() if isinstance(x, torch.Tensor) and x.device.type == "cpu" else None
    cache_before = clone_cache(i.kv_cache)
    with pytest.raises((ValueError, TypeError)) as ei:
        layer_step(h, x, pos)
    exc = exc if isinstance(exc, tuple) else (exc,)
    assert isinstance(ei.value, exc), f"{case_id}: expected {exc}, got {type(ei.value).__name__}: {ei.value}"
    check_message(ei.value, names)
    # rejected before anything was written, x untouched
    assert caches_equal(cache_before, i.kv_cache), f"{case_id}: a rejected layer_step wrote into the KV cache"
    if x_before is not None:
        assert bitwise_equal(x, x_before)


def test_handle_still_works_after_rejections(handle):
    """The rejections above left the handle usable: a valid step matches the reference."""
    h, i = handle
    ref_cache = clone_cache(i.kv_cache)
    x = _x(7)
    out = layer_step(h, x, PREFILL)
    ref = model_ref(i.weights, ref_cache, CFG, x, PREFILL, rope_tables(CFG, MAX_SEQ))
    assert rel_err(out, ref) <= TOL


def test_step_after_teardown():
    i = Inputs.good()
    h = build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len)
    teardown(h)
    before = clone_cache(i.kv_cache)
    with pytest.raises(ValueError) as ei:
        layer_step(h, _x(), PREFILL)
    check_message(ei.value, ["teardown"])
    assert caches_equal(before, i.kv_cache)
    teardown(h)     # idempotent


# ---------------------------------------------------------------------------------------------
# broken tapes: bounded waits -> MegakernelError, never a hang
# ---------------------------------------------------------------------------------------------

SPIN = 2000


@pytest.fixture(scope="module")
def valid_tape():
    # the split attention: the merged default's shorter plan is all pool, and these tapes break a queued wait
    return compile_model(CFG, 1, max_seq=MAX_SEQ, sequential=True, tiling=opcodes.Tiling.for_config(CFG)).tape


def _bump_target(tape):
    """The first instruction that waits on something waits for one producer more than exist."""
    return bump_target(tape)


def _drop_producer(tape):
    """The last producer of the first waiter's counter signals nothing."""
    return drop_producer(tape)


def _consumer_first(tape):
    """The first waiter swapped with the last producer of its counter (one queue: it can never run)."""
    k = first_waiter(tape)
    c = int(tape.words[k, 1])
    p = max(j for j in range(k) if int(tape.words[j, 5]) == c)
    w = tape.words.clone()
    w[[p, k]] = w[[k, p]]
    return dataclasses.replace(tape, words=w), p, c


BROKEN = [_bump_target, _drop_producer, _consumer_first]


def _stuck_names(tape, slot: int, counter: int) -> list[str]:
    op = opcodes.BY_OPCODE[int(tape.words[slot, 0])].NAME
    return [f"instruction {slot}", op, "sm 0", tape.counters[counter]]


def _two_steps_match_reference(h, inp) -> list:
    """Two steps at PREFILL, PREFILL + 1 through ``h``, each within TOL of the reference run on a
    copy of the cache; returns the reference's cache after them."""
    ref_cache = clone_cache(inp.kv_cache)
    cs = rope_tables(CFG, MAX_SEQ)
    for step in range(2):
        xs = _x(10 + step)
        out = layer_step(h, xs, PREFILL + step)
        ref = model_ref(inp.weights, ref_cache, CFG, xs, PREFILL + step, cs)
        assert rel_err(out, ref) <= TOL
    return ref_cache


@pytest.mark.parametrize("breaker", BROKEN, ids=[b.__name__.lstrip("_") for b in BROKEN])
def test_verifier_rejects_broken_tape(valid_tape, breaker):
    broken, slot, counter = breaker(valid_tape)
    i = Inputs.good()
    with pytest.raises(TapeError) as ei:
        build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=broken)
    # the verifier names an instruction involved (the stuck consumer, or the one that moved)
    assert re.search(r"instruction \d+ \(", str(ei.value)), str(ei.value)
    op = opcodes.BY_OPCODE[int(broken.words[slot, 0])].NAME
    check_message(ei.value, [f"instruction {slot}", op])


@pytest.mark.parametrize("breaker", BROKEN, ids=[b.__name__.lstrip("_") for b in BROKEN])
def test_broken_tape_raises_not_hangs(valid_tape, runslow, breaker):
    """Each broken tape raises (twice: its counters were reset); the next launches in the process work.
    (That last part, four interpreter steps, runs after the first breaker by default, after each with
    ``--runslow``: a failed launch leaves nothing behind but its own handle's counters, reset either way.)"""
    broken, slot, counter = breaker(valid_tape)
    i = Inputs.good()
    good = Inputs.good()
    # a valid handle built BEFORE the failure, in the same process
    h_good = build_layer(good.weights, good.kv_cache, good.cfg, good.max_seq_len, tape=valid_tape)
    h_bad = build_layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=broken, verify_tape=False,
                        spin_limit=SPIN)
    x = _x(3)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h_bad, x, PREFILL)
    err = ei.value
    # bounded: the wait gave up after spin_limit polls (the time it takes is checked in tests/test_gpu.py)
    check_message(err, _stuck_names(broken, slot, counter) + [f"after {SPIN} polls"])
    assert len(err.stuck) == 1 and err.stuck[0][0] == 0 and err.stuck[0][1] == slot, err.stuck
    # the same broken handle fails the same way again (its counters were reset, no stale state)
    with pytest.raises(interp.MegakernelError) as ei2:
        layer_step(h_bad, x, PREFILL + 1)
    check_message(ei2.value, _stuck_names(broken, slot, counter))
    teardown(h_bad)
    if not runslow and breaker is not BROKEN[0]:
        teardown(h_good)
        return

    # the next launches in the same process work: the valid handle built before, and a fresh one
    for h, inp in ((h_good, good), (None, Inputs.good())):
        if h is None:
            h = build_layer(inp.weights, inp.kv_cache, inp.cfg, inp.max_seq_len, tape=valid_tape)
        ref_cache = _two_steps_match_reference(h, inp)
        for pa, pb in zip(ref_cache, inp.kv_cache):
            for a, b in zip(pa, pb):
                assert rel_err(b[:, :, PREFILL:PREFILL + 2], a[:, :, PREFILL:PREFILL + 2]) <= TOL
                assert bitwise_equal(b[:, :, :PREFILL], a[:, :, :PREFILL])
                assert bitwise_equal(b[:, :, PREFILL + 2:], a[:, :, PREFILL + 2:])
        teardown(h)


def test_broken_pool_raises_names_the_pool_and_resets_its_tickets(handles):
    """A pool instruction waiting for one producer too many: the error names it as a pool
    instruction; the ticket counter is reset with the others, so the handle fails the same way
    again (not at some other slot) and a valid pooled handle works before and after."""
    pooled = compile_model(CFG, 1, max_seq=MAX_SEQ, sequential=True, pool_us=1e9).tape
    k = next(k for k in pooled.pool_range() if int(pooled.words[k, 1]) >= 0)
    w = pooled.words.clone()
    w[k, 2] += 1
    broken = dataclasses.replace(pooled, words=w)
    good = Inputs.good()
    h_good = handles.layer(good.weights, good.kv_cache, good.cfg, good.max_seq_len, tape=pooled)
    i = Inputs.good()
    h_bad = handles.layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=broken, verify_tape=False,
                          spin_limit=SPIN)
    names = [f"instruction {k}", opcodes.BY_OPCODE[int(w[k, 0])].NAME, "pool", pooled.counters[int(w[k, 1])]]
    for call in range(2):
        with pytest.raises(interp.MegakernelError) as ei:
            layer_step(h_bad, _x(3), PREFILL + call)
        check_message(ei.value, names)
        assert [s[1] for s in ei.value.stuck] == [k]
        assert int(h_bad.counters.abs().sum()) == 0
    _two_steps_match_reference(h_good, good)
    assert int(h_good.counters[pooled.pool_counter]) == 2 * pooled.tickets_per_call()


def test_a_pool_ticket_out_of_step_with_the_call_count_is_an_error(handles):
    """An all-pool tape whose ticket counter is ahead of the call count (as if another launch of the
    handle had run beside this one): every ticket falls past this call's range. The kernel must say so
    (a counter past its target, the pool's), not run nothing and return a stale output; the next launch
    starts clean."""
    from interp.codegen import CTL_CALLS
    pooled = compile_model(CFG, 1, max_seq=MAX_SEQ, sequential=True, pool_us=1e9).tape
    assert pooled.pool_len == len(pooled)
    i = Inputs.good()
    h = handles.layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=pooled, spin_limit=SPIN)
    layer_step(h, _x(3), PREFILL)
    layer_step(h, _x(3), PREFILL)
    h.ctl[CTL_CALLS] = 0                                # the count falls behind the tickets
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, _x(3), PREFILL + 1)
    check_message(ei.value, ["past its target", "pool ticket", pooled.counters[pooled.pool_counter]])
    assert int(h.counters.abs().sum()) == 0
    # the ticket's own row in the status block: no instruction (slot -1), the counter past this call's range
    ((sm, slot, _, _, tgt, seen, ep, _),) = ei.value.stuck
    assert (slot, ep) == (-1, 1) and seen >= tgt == pooled.tickets_per_call()
    ref_kv = clone_cache(i.kv_cache)
    out = layer_step(h, _x(4), PREFILL + 1)
    assert rel_err(out, model_ref(i.weights, ref_kv, CFG, _x(4), PREFILL + 1)) <= 1.5e-2


def test_megakernel_error_says_whether_pos_was_written(valid_tape, handles):
    broken, slot, counter = _bump_target(valid_tape)
    i = Inputs.good()
    h = handles.layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=broken, verify_tape=False, spin_limit=SPIN)
    before = clone_cache(i.kv_cache)
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, _x(), PREFILL)
    written = not caches_equal(before, i.kv_cache)
    msg = str(ei.value)
    assert re.search(rf"\b(pos|position)\s*(=\s*)?{PREFILL}\b", msg), msg
    if written:
        assert re.search(r"\bwas (partially )?written\b", msg) and "not written" not in msg, msg
    else:
        assert "not written" in msg, msg


def test_broken_tape_default_spin_limit_raises(handles):
    """With the default spin limit (on the CPU: one poll decides, since the interpreter runs the
    programs one after another) a broken tape raises instead of waiting; on a GPU the default
    limit's time to fail is checked in tests/test_gpu.py."""
    tape, slot, counter = _bump_target(compile_model(CFG, 1, max_seq=MAX_SEQ, sequential=True,
                                                     tiling=opcodes.Tiling.for_config(CFG)).tape)
    i = Inputs.good()
    h = handles.layer(i.weights, i.kv_cache, i.cfg, i.max_seq_len, tape=tape, verify_tape=False)
    assert h.spin_limit == INTERPRETER_SPIN_LIMIT
    with pytest.raises(interp.MegakernelError) as ei:
        layer_step(h, torch.zeros(1, D, dtype=torch.bfloat16), PREFILL)
    check_message(ei.value, _stuck_names(tape, slot, counter) + [f"after {INTERPRETER_SPIN_LIMIT} polls"])


def test_a_handle_stepped_from_two_threads_at_once_raises():
    """A handle's counters serve one launch at a time: a second thread inside a step is refused."""
    cfg = PRESETS["tiny"]
    w = make_weights(cfg)
    kv = make_kv_cache(cfg, 64, 37)
    h = build_layer(w, kv, cfg.to_dict(), 64)
    try:
        x = (torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(3))).to(torch.bfloat16)
        assert h.lock.acquire(blocking=False)              # another thread is inside a step of h
        try:
            with pytest.raises(RuntimeError, match="two threads"):
                layer_step(h, x, 37)
        finally:
            h.lock.release()
        ref = model_ref(w, make_kv_cache(cfg, 64, 37), cfg, x, 37)
        assert rel_err(layer_step(h, x, 37), ref) <= 1.5e-2  # and the handle is fine afterwards
    finally:
        teardown(h)
