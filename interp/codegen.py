"""Generates the persistent interpreter kernel from the opcode registry.

The kernel interprets the whole instruction set: one ``if op == ...`` branch per registered
opcode, whatever the tape holds. Its parameters (the build-time pointers the device functions
take, :func:`opcodes.kernel_pointers`, and the constexprs of :func:`opcodes.kernel_constexprs`),
its operand decoding and its dispatch are written from the opcode classes, so no opcode number,
pointer or constexpr is listed by hand here: a new opcode module is in the next kernel generated.
(A kernel of only the tape's opcodes measured 1.0-1.5% slower on the H200: the branches it drops
change the register allocation of the whole loop.) The source goes to a cache folder (Triton's JIT
reads kernels from source files).
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import pathlib
import sys

import opcodes
from opcodes import HEADER, WORDS
from opcodes.base import WAIT_ARGS, kernel_classes
from opcodes.base import PER_CALL_POINTERS, signals_peer


#: runtime parameters of the kernel before the model's buffers
FIXED_PARAMS = ("tape_ptr", "qoff_ptr", "cnt_ptr", "status_ptr", "prof_ptr", "ptab_ptr", "ctl_ptr", "spin_limit")
#: the position parameter: this call's position, or -1 to take it from the control block
SCALARS = ("pos_arg",)
#: the control block (int32, on the device): calls completed, SMs arrived at the end of this call,
#: the next position. The kernel advances it itself, so a launch is the same every time (a CUDA
#: graph can replay it): call ``e = calls + 1`` waits for ``target * e``.
CTL_CALLS, CTL_ARRIVED, CTL_POS = 0, 1, 2
CTL_WORDS = 4
#: the words of ``qoff`` after the queue and pool offsets: the pool's ticket counter, the number of
#: counters, and the call after which the counters start over from zero (before int32 overflows)
QOFF_EXTRA = ("pool_counter", "n_counters", "epoch_limit")
#: status codes of a failed SM (status row word 0); FAIL_TIME: a tensor-parallel kernel's wait ran
#: past its time bound (``tp_wait_ptr``, nanoseconds of ``interp.sync.clock_ns``)
FAIL_TIMEOUT, FAIL_PAST_TARGET, FAIL_POSITION, FAIL_TIME = 1, 2, 3, 4
_TL_TYPES = {"bf16": "tl.bfloat16", "fp32": "tl.float32", "i64": "tl.int64", "i32": "tl.int32"}
#: compile-time switches of the kernel itself
SWITCHES = ("PROFILE",)
STATUS_WORDS = 8     # per SM: [code, sm, slot, opcode, counter, target, seen, epoch]; row 0: any failed
PROF_WORDS = 4       # per slot (int64): [wait start, exec start, end, sm]; then per SM: [entry, queue done, exit, sm]


def _check_args(classes, pointers: dict, constexprs) -> None:
    """Every parameter a device function takes has a declaration."""
    known = set(pointers) | set(constexprs) | {"pos", "epoch"} | set(PER_CALL_POINTERS)   # pos, epoch: the call's
    for cls in classes:
        if cls.WAIT_INSIDE is not None and cls.WAIT_INSIDE not in cls.CONSTEXPRS:
            raise TypeError(f"opcode {cls.NAME}: WAIT_INSIDE names {cls.WAIT_INSIDE!r}, which is not one of its "
                            f"CONSTEXPRS {sorted(cls.CONSTEXPRS)}")
        bad = [a for a in cls.ARGS if a not in known]
        if bad:
            raise TypeError(f"opcode {cls.NAME} takes kernel parameters {bad} that nothing declares: a pointer "
                            f"needs an owner (a layout tensor, an opcode's scratch / state / TABLES), a constexpr "
                            f"an entry in some opcode's CONSTEXPRS or in Layout.constexprs")


def _emit_waits(w, ind: str, tp: bool = False, interp: str = "True", inside=()) -> None:
    """The instruction's waits (bounded polls; a failed one is written to the status block).
    During call ``e`` a counter ends at exactly ``target * e`` (the verifier: every wait's target is
    the number of its producers): below it after ``spin_limit`` polls, a producer never signalled;
    beyond it, another launch of the same handle ran beside this one or the call count is out of
    step with the counters (never silent). One test per wait on the common path (``seen != wt``),
    the two told apart on the failure path.

    ``tp`` (a tensor-parallel kernel): a counter the peer signals (``peer_sig_ptr[wc] == 1``) may be
    past this call's target, since the peer may already be in its next call
    (``schedule.verify``: why two parity slots suffice), so there ``seen > wt`` passes; a counter of this rank
    alone still fails past its target. The polls of a counter the peer signals are system-scope
    acquires (the peer is another GPU); those of the rank's own counters gpu-scope ones.
    Every wait of a tensor-parallel kernel is also bounded in time: from its first unmet poll, at
    most ``tl.load(tp_wait_ptr)`` ns of ``interp.sync.clock_ns`` (the globaltimer; the host's clock
    under the interpreter), as a peer driven by another process may never launch; a wait that runs
    out of time fails with ``FAIL_TIME``. ``interp``: the kernel's interpreter flag (source text).
    ``inside``: the opcodes with ``WAIT_INSIDE``; where its constexpr is true, an instruction of
    one is not waited for here (its device function waits, :func:`_emit_dispatch`)."""
    for k in range(opcodes.MAX_WAITS):
        w(f"{ind}wc = tl.load(ins + {1 + 2 * k})")
        for cls in inside:
            w(f"{ind}if {cls.WAIT_INSIDE}:")
            w(f"{ind}    wc = tl.where(op == {cls.OPCODE}, -1, wc)")
        w(f"{ind}wt = tl.load(ins + {2 + 2 * k}) * epoch")
        w(f"{ind}if (wc >= 0) & (failed == 0):")
        if tp:
            # system scope only where the peer signals the counter; this rank's own counters are
            # released at gpu scope (signal_counter) and acquired at gpu scope
            w(f"{ind}    psig = tl.load(peer_sig_ptr + wc)")
            w(f"{ind}    seen = poll_tp(cnt_ptr + wc, psig)")
            w(f"{ind}    n = 0")
            # the time bound: read the clock only once a poll has failed (the common path is one poll)
            w(f"{ind}    if seen < wt:")
            w(f"{ind}        t1 = clock_ns({interp})")
            w(f"{ind}        deadline = t1 + tl.load(tp_wait_ptr)")
            w(f"{ind}        while (seen < wt) & (n < spin_limit) & (t1 < deadline):")
            w(f"{ind}            seen = poll_tp(cnt_ptr + wc, psig)")
            w(f"{ind}            n += 1")
            w(f"{ind}            t1 = clock_ns({interp})")
        else:
            w(f"{ind}    seen = poll_counter(cnt_ptr + wc, wt, spin_limit)")
        w(f"{ind}    if seen != wt:")
        if tp:
            w(f"{ind}        if (seen < wt) | (psig == 0):")
            ind += "    "
        w(f"{ind}        failed = sm * 0 + 1")
        if tp:
            w(f"{ind}        code = tl.where(seen < wt, tl.where(n < spin_limit, {FAIL_TIME}, {FAIL_TIMEOUT}), "
              f"{FAIL_PAST_TARGET})")
        else:
            w(f"{ind}        code = tl.where(seen < wt, {FAIL_TIMEOUT}, {FAIL_PAST_TARGET})")
        w(f"{ind}        _fail(status_ptr, sm, i, op, wc, wt, seen, epoch, code)")


def _emit_signal(w, classes, ind: str, tp: bool) -> None:
    """The instruction's signal: this rank's counter, or (a ``SIGNALS_PEER`` opcode of a
    tensor-parallel kernel) the peer's counter of the same index, with a system-scope release."""
    w(f"{ind}sig = tl.load(ins + 5)")
    for cls in classes:
        if cls.WAIT_INSIDE is not None:      # a wait made inside a device function may have failed
            w(f"{ind}if {cls.WAIT_INSIDE}:")
            w(f"{ind}    sig = tl.where(failed == 0, sig, -1)")
    w(f"{ind}if sig >= 0:")
    if not tp:
        w(f"{ind}    signal_counter(cnt_ptr + sig)")
        return
    peer_ops = [cls.OPCODE for cls in classes if cls.SIGNALS_PEER]
    w(f"{ind}    if " + " | ".join(f"(op == {o})" for o in peer_ops) + ":")
    w(f"{ind}        signal_peer_counter(peer_cnt_ptr + sig)")
    w(f"{ind}    else:")
    w(f"{ind}        signal_counter(cnt_ptr + sig)")


def _emit_dispatch(w, classes, ind: str) -> None:
    for j, cls in enumerate(classes):
        ops = [f"a{k}" for k in range(len(cls.operand_names()))]
        w(f"{ind}{'if' if j == 0 else 'elif'} op == {cls.OPCODE}:  # {cls.NAME}")
        if cls.WAIT_INSIDE is None:
            w(f"{ind}    _{cls.NAME}(" + ", ".join(ops + list(cls.ARGS)) + ")")
            continue
        call = f"_{cls.NAME}(" + ", ".join(ops + list(cls.ARGS) + list(WAIT_ARGS)) + ")"
        w(f"{ind}    if {cls.WAIT_INSIDE}:     # the device function waits, after its first weight loads")
        w(f"{ind}        wc, seen, t_exec = {call}")
        w(f"{ind}        if wc >= 0:")
        w(f"{ind}            wt = tl.where(tl.load(ins + 1) == wc, tl.load(ins + 2), tl.load(ins + 4)) * epoch")
        w(f"{ind}            failed = sm * 0 + 1")
        w(f"{ind}            _fail(status_ptr, sm, i, op, wc, wt, seen, epoch, "
          f"tl.where(seen < wt, {FAIL_TIMEOUT}, {FAIL_PAST_TARGET}))")
        w(f"{ind}    else:")
        w(f"{ind}        {call}")


def kernel_source(pointers: dict, constexprs, used=()) -> str:
    """The kernel of the opcodes of :func:`opcodes.base.kernel_classes` (every opcode in every
    kernel, plus those of ``used`` that are not): ``pointers`` (name -> element type) reach it
    through the address table, in this order; ``constexprs`` are the names of its compile-time
    parameters."""
    classes = kernel_classes(used)
    constexprs = sorted(constexprs)
    _check_args(classes, pointers, constexprs)
    tp = signals_peer(classes)          # a tensor-parallel kernel (interp.tp): peer signals and waits
    n_ops = max(len(c.operand_names()) for c in classes)
    interp = "INTERP" if "INTERP" in constexprs else "True"   # the kernel's interpreter flag
    L = []
    w = L.append
    w("# Generated by interp/codegen.py from the opcode registry. Do not edit: regenerate.")
    w("import triton")
    w("import triton.language as tl")
    w("from interp.sync import signal_counter" + (", signal_peer_counter, clock_ns, poll_tp" if tp else ""))
    w("from triton.language.extra.cuda import globaltimer as _globaltimer")
    if not tp:
        w("from opcodes.common import poll_counter")
    for cls in classes:
        w(f"from {cls.__module__} import {cls.__name__} as _{cls.NAME}_cls")
    w("")
    for cls in classes:
        w(f"_{cls.NAME} = _{cls.NAME}_cls.device")
    w("")
    w("")
    w("")
    w("@triton.jit")
    w("def _ticket(qoff_ptr, cnt_ptr, epoch, i, stop, in_pool):")
    w("    # (slot, stop, in_pool) of this SM's next pool instruction; unchanged if the tape has no pool.")
    w("    # A ticket outside this call's range (the counter out of step with the call count: another launch")
    w("    # beside this one, or a reset count) stops the SM with in_pool = 2, which the kernel reports after")
    w("    # its loop as the pool's counter past its target: running nothing would return a wrong answer")
    w("    nsm = tl.num_programs(0)")
    w("    p0 = tl.load(qoff_ptr + nsm)")
    w("    p1 = tl.load(qoff_ptr + nsm + 1)")
    w("    if p1 > p0:")
    w("        t = tl.atomic_add(cnt_ptr + tl.load(qoff_ptr + nsm + 2), 1, sem=\"relaxed\", scope=\"gpu\")")
    w("        k = t - (epoch - 1) * (p1 - p0 + nsm)")
    w("        bad = (k < 0) | (k >= p1 - p0 + nsm)")
    w("        i = tl.where(bad, p1, p0 + k)")
    w("        stop = p1")
    w("        in_pool = tl.where(bad, 2, 1)")
    w("    return i, stop, in_pool")
    w("")
    w("")
    w("@triton.jit")
    w("def _ticket_fail(qoff_ptr, cnt_ptr, status_ptr, sm, epoch):")
    w("    # after the loop of an SM whose ticket was out of range (_ticket): the pool's counter, past its")
    w("    # target (this call's last ticket), as an instruction-less row (slot -1)")
    w("    nsm = tl.num_programs(0)")
    w("    tc = tl.load(qoff_ptr + nsm + 2)")
    w("    want = epoch * (tl.load(qoff_ptr + nsm + 1) - tl.load(qoff_ptr + nsm) + nsm)")
    w("    seen = tl.atomic_add(cnt_ptr + tc, 0, sem=\"relaxed\", scope=\"gpu\")")
    w(f"    _fail(status_ptr, sm, -1, 0, tc, want, seen, epoch, {FAIL_PAST_TARGET})")
    w("")
    w("")
    w("@triton.jit")
    w("def _fail(status_ptr, sm, i, op, wc, wt, seen, epoch, code):")
    w("    # row 0 of the status block is a one-word summary the host polls; SM rows follow")
    w(f"    st = status_ptr + (sm + 1) * {STATUS_WORDS}")
    w("    tl.store(st + 1, sm)")
    w("    tl.store(st + 2, i)")
    w("    tl.store(st + 3, op)")
    w("    tl.store(st + 4, wc)")
    w("    tl.store(st + 5, wt)")
    w("    tl.store(st + 6, seen)")
    w("    tl.store(st + 7, epoch)")
    w("    tl.store(st + 0, code)")
    w("    tl.store(status_ptr, 1)")
    w("")
    w("")
    w("@triton.jit")
    w("def _end_of_call(ctl_ptr, cnt_ptr, qoff_ptr, epoch, pos):")
    w("    # the last SM to arrive advances the call count and the position (and, every")
    w("    # epoch_limit calls, zeroes the counters and starts the count over)")
    w("    nsm = tl.num_programs(0)")
    w(f"    arrived = tl.atomic_add(ctl_ptr + {CTL_ARRIVED}, 1, sem=\"acq_rel\", scope=\"gpu\")")
    w("    if arrived == nsm - 1:")
    w(f"        tl.store(ctl_ptr + {CTL_ARRIVED}, 0)")
    w("        calls = epoch")
    w("        if epoch >= tl.load(qoff_ptr + nsm + 4):")
    w("            ncnt = tl.load(qoff_ptr + nsm + 3)")
    w("            for c0 in range(0, ncnt, 1024):")
    w("                cs = c0 + tl.arange(0, 1024)")
    w("                tl.store(cnt_ptr + cs, tl.zeros([1024], dtype=tl.int32), mask=cs < ncnt)")
    w("            calls = epoch * 0")
    w(f"        tl.store(ctl_ptr + {CTL_CALLS}, calls)")
    w(f"        tl.store(ctl_ptr + {CTL_POS}, pos + 1)")
    w("")
    w("")
    w("@triton.jit")
    w("def _now(PROFILE: tl.constexpr):")
    w("    if PROFILE:")
    w("        t = _globaltimer()")
    w("    else:")
    w("        t = tl.full([], 0, tl.int64)")
    w("    return t")
    w("")
    w("")
    # NOTE: no value specialisation of the per-call scalars: the compiled kernel is launched directly
    # (runtime.launch), so it must be valid for every spin limit and position.
    w('@triton.jit(do_not_specialize=["spin_limit", "pos_arg"])')
    params = list(FIXED_PARAMS) + list(SCALARS) + list(PER_CALL_POINTERS) + \
        [f"{c}: tl.constexpr" for c in constexprs] + [f"{s}: tl.constexpr" for s in SWITCHES]
    w("def megakernel(" + ", ".join(params) + "):")
    w("    sm = tl.program_id(0)")
    w("    t_entry = _now(PROFILE)")
    w("    # build-time buffers: addresses from the table (16-byte aligned, checked by the host)")
    for k, (name, dt) in enumerate(pointers.items()):
        ty = _TL_TYPES[dt]
        w(f"    {name} = tl.multiple_of(tl.load(ptab_ptr + {k}).to(tl.pointer_type({ty})), 16)")
    w("    i = tl.load(qoff_ptr + sm)")
    w("    stop = tl.load(qoff_ptr + sm + 1)")
    w("    failed = sm * 0")
    w("    # this call's number and position come from the control block (written by the last call)")
    w(f"    epoch = tl.load(ctl_ptr + {CTL_CALLS}, volatile=True) + 1")
    w("    pos = pos_arg")
    w("    if pos_arg < 0:")
    w(f"        pos = tl.load(ctl_ptr + {CTL_POS}, volatile=True)")
    w("    if (pos < 0) | (pos >= MAX_SEQ):      # a device-side position outside the cache: run nothing")
    w("        failed = sm * 0 + 1")
    w(f"        _fail(status_ptr, sm, i, 0, -1, MAX_SEQ, pos, epoch, {FAIL_POSITION})")
    # the pool: qoff[nsm], qoff[nsm + 1] bound it, qoff[nsm + 2] is its ticket counter, which
    # advances by (pool length + SMs) per call: each SM takes one ticket past the end, then stops.
    # The bounds are reloaded at each ticket rather than held in registers across the loop.
    w("    in_pool = sm * 0")
    w("    if i >= stop:")
    w("        i, stop, in_pool = _ticket(qoff_ptr, cnt_ptr, epoch, i, stop, in_pool)")
    w("    while (i < stop) & (failed == 0):")
    w(f"        ins = tape_ptr + i * {WORDS}")
    w("        op = tl.load(ins)")
    w("        t_wait = _now(PROFILE)")
    for k in range(n_ops):
        w(f"        a{k} = tl.load(ins + {HEADER + k})")
    inside = [cls for cls in classes if cls.WAIT_INSIDE is not None]
    if tp:
        # a tensor-parallel kernel's waits are made by the kernel (peer counters, time bounds)
        for cls in inside:
            w(f"        tl.static_assert({cls.WAIT_INSIDE} == 0, \"{cls.NAME} cannot wait inside its device "
              f"function in a tensor-parallel kernel ({cls.WAIT_INSIDE})\")")
        inside = []
    _emit_waits(w, "        ", tp, interp, inside)
    w("        if failed == 0:")
    w("            t_exec = _now(PROFILE)")
    _emit_dispatch(w, classes, "            ")
    _emit_signal(w, classes, "            ", tp)
    w("            if PROFILE:")
    w("                t_end = _now(PROFILE)")
    w(f"                pp = prof_ptr + i * {PROF_WORDS}")
    w("                tl.store(pp, t_wait)")
    w("                tl.store(pp + 1, t_exec)")
    w("                tl.store(pp + 2, t_end)")
    w("                tl.store(pp + 3, sm.to(tl.int64))")
    w("        i += 1")
    w("        if ((in_pool == 1) | (i >= stop)) & (failed == 0):  # queue done: the next pool ticket")
    w("            i, stop, in_pool = _ticket(qoff_ptr, cnt_ptr, epoch, i, stop, in_pool)")
    w("    if in_pool == 2:")
    w("        _ticket_fail(qoff_ptr, cnt_ptr, status_ptr, sm, epoch)")
    w("    t_done = _now(PROFILE)")
    w("    _end_of_call(ctl_ptr, cnt_ptr, qoff_ptr, epoch, pos)")
    w("    if PROFILE:      # this SM's row after the tape's: [kernel entry, queue done, exit, sm]")
    w(f"        pe = prof_ptr + (tl.load(qoff_ptr + tl.num_programs(0) + 1) + sm) * {PROF_WORDS}")
    w("        tl.store(pe, t_entry)")
    w("        tl.store(pe + 1, t_done)")
    w("        tl.store(pe + 2, _now(PROFILE))")
    w("        tl.store(pe + 3, sm.to(tl.int64))")
    w("")
    return "\n".join(L) + "\n"


def cache_dir() -> pathlib.Path:
    root = os.environ.get("MEGATAPE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatape")
    p = pathlib.Path(root) / "kernels"
    p.mkdir(parents=True, exist_ok=True)
    return p


_LOADED: dict[str, object] = {}


def load_kernel(pointers: dict, constexprs, used=()):
    """Generate (if needed) and import the interpreter kernel of :func:`kernel_source`; returns
    its JITFunction."""
    src = kernel_source(pointers, constexprs, used)
    key = hashlib.sha256(src.encode()).hexdigest()[:16]
    if key in _LOADED:
        return _LOADED[key]
    path = cache_dir() / f"megakernel_{key}.py"
    if not path.exists() or path.read_text() != src:
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(src)
        os.replace(tmp, path)
    name = f"megatape_generated_{key}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    _LOADED[key] = mod.megakernel
    return mod.megakernel
