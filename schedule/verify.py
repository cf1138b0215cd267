"""The tape verifier: proves, before anything runs, that a tape is complete, satisfiable,
deadlock-free and race-free, and names the culprit when it is not.

Checks, in order:
  1. structure: offsets, opcodes, operand ranges, counter indices and targets;
  2. completeness: every instruction of the program appears exactly once (when given one);
  3. counters: every wait's per-call target equals the number of producers of that counter;
  4. outputs: every element of every scratch buffer is written exactly once per call;
  5. dependencies: every read is covered by writes of instructions it (transitively) waits for,
     or that an earlier instruction of its SM queue waited for (an SM runs its queue in order and
     counters only grow during a call: see ``Tape.elide_repeated_waits``);
  6. liveness: no interleaving of the SMs can deadlock (queue order + counters are acyclic); the
     pool (instructions taken by ticket at run time) is in a topological order, waits only on
     queued or earlier pool instructions, and no queue waits on it;
  7. optionally, sequential execution (the Triton interpreter runs programs one by one: SM 0's
     queue, then the whole pool, which SM 0 takes alone, then SM 1's queue, ...).

A tensor-parallel rank's tape alone (:func:`verify`) is checked as if its peer ran the same tape:
an instruction that signals the peer's counter (``SIGNALS_PEER``) or writes the peer's buffer
(``WRITES_PEER``) counts as signalling / writing the same counter / buffer here, which is exact when
both ranks run the same program in the same schedule. :func:`verify_tp` checks the real system: both
tapes, their 2 x num_sms queues and the cross-rank edges.
"""
from __future__ import annotations

import math

import bisect
from collections import Counter, defaultdict
from dataclasses import dataclass

from opcodes import BY_OPCODE, HEADER, MAX_WAITS, NO_COUNTER, Region

from .program import Program
from .tape import Decoded, Tape, decode


class TapeError(ValueError):
    """A tape failed verification. ``problems`` holds every message; str() shows the first few."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        super().__init__(f"tape verification failed ({len(problems)} problem(s)):\n  " +
                         "\n  ".join(problems[:8]) + more)


@dataclass
class Report:
    n_instructions: int
    n_counters: int
    n_sms: int
    n_regions_checked: int

    def __str__(self) -> str:
        return (f"verified: {self.n_instructions} instructions on {self.n_sms} SMs, {self.n_counters} counters, "
                f"{self.n_regions_checked} read regions proven covered")


def _name(tape: Tape, d: Decoded) -> str:
    return f"instruction {d.slot} ({d.ins.NAME}, {Tape.where(d.sm)})"


def _cname(tape: Tape, c: int) -> str:
    return f"counter {c} ({tape.counters[c]})" if 0 <= c < tape.n_counters else f"counter {c}"


def verify(tape: Tape, prog: Program | None = None, sequential: bool = False) -> Report:
    """Raise :class:`TapeError` naming every problem found, or return a :class:`Report`."""
    lay = tape.lay
    problems: list[str] = []
    n = len(tape)
    # -- 1. structure -------------------------------------------------------------------
    off = [int(v) for v in tape.offsets.tolist()]
    if len(off) != tape.num_sms + 2 or off[0] != 0 or off[-1] != n or any(a > b for a, b in zip(off, off[1:])):
        raise TapeError([f"offsets {off[:6]}... do not split {n} instructions into {tape.num_sms} queues and a pool "
                         f"(want {tape.num_sms + 2} non-decreasing offsets from 0 to {n})"])
    pool_len = off[-1] - off[-2]
    pc = tape.pool_counter
    if pool_len and not 0 <= pc < tape.n_counters:
        raise TapeError([f"the pool holds {pool_len} instructions but its ticket counter is {pc} "
                         f"(the tape has {tape.n_counters} counters)"])
    decoded: list[Decoded] = []
    for s in list(range(tape.num_sms)) + [Tape.POOL]:
        lo, hi = (off[-2], off[-1]) if s == Tape.POOL else (off[s], off[s + 1])
        for k in range(lo, hi):
            w = tape.words[k].tolist()
            cls = BY_OPCODE.get(w[0])
            if cls is None:
                problems.append(f"instruction {k} (sm {s}): unknown opcode {w[0]}")
                continue
            ins = cls.decode(w[HEADER:])
            waits = tuple((w[1 + 2 * j], w[2 + 2 * j]) for j in range(MAX_WAITS) if w[1 + 2 * j] != NO_COUNTER)
            d = Decoded(k, s, ins, waits, w[5])
            for msg in ins.check_operands(lay):
                problems.append(f"{_name(tape, d)}: operand out of range: {msg}")
            for c, t in waits:
                if not 0 <= c < tape.n_counters:
                    problems.append(f"{_name(tape, d)}: waits on {_cname(tape, c)}, but the tape has "
                                    f"{tape.n_counters} counters")
                if t <= 0:
                    problems.append(f"{_name(tape, d)}: waits on {_cname(tape, c)} for {t} (targets must be >= 1)")
            if d.signal != NO_COUNTER and not 0 <= d.signal < tape.n_counters:
                problems.append(f"{_name(tape, d)}: signals {_cname(tape, d.signal)}, but the tape has "
                                f"{tape.n_counters} counters")
            if pc != NO_COUNTER and (d.signal == pc or any(c == pc for c, _ in waits)):
                problems.append(f"{_name(tape, d)}: uses {_cname(tape, pc)}, the pool's ticket counter "
                                f"(only the pool's tickets may move it)")
            decoded.append(d)
    if problems:
        raise TapeError(problems)
    # -- 2. completeness ----------------------------------------------------------------
    if prog is not None:
        want = Counter(prog.instrs)
        have = Counter(d.ins for d in decoded)
        for ins, k in (want - have).items():
            problems.append(f"{ins} is missing from the tape ({k} of {want[ins]} absent)")
        for ins, k in (have - want).items():
            where = [d for d in decoded if d.ins == ins]
            problems.append(f"{_name(tape, where[-1])}: {ins} appears {have[ins]} times, "
                            f"the program has it {want.get(ins, 0)} times")
    # -- 3. counters --------------------------------------------------------------------
    producers: dict[int, list[Decoded]] = defaultdict(list)
    for d in decoded:
        if d.signal != NO_COUNTER:
            producers[d.signal].append(d)
    for d in decoded:
        for c, t in d.waits:
            have = len(producers.get(c, []))
            if have != t:
                problems.append(f"{_name(tape, d)}: waits on {_cname(tape, c)} for {t}, "
                                f"but it has {have} producer(s)")
    # -- 4. outputs written exactly once ------------------------------------------------
    writes: dict[str, list[tuple[int, int, Decoded]]] = defaultdict(list)
    for d in decoded:
        for r in d.ins.writes(lay):
            writes[r.buf].append((r.lo, r.hi, d))
    bufs = tape.buffers()
    slots = _parity_slots(tape.classes())
    for b in writes:
        if b not in bufs:
            problems.append(f"{_name(tape, writes[b][0][2])}: writes unknown buffer {b!r}")
    for b in bufs:
        ws = sorted(writes.get(b, []), key=lambda t: (t[0], t[1]))
        pos = 0
        for lo, hi, d in ws:
            if lo < pos:
                problems.append(f"{_name(tape, d)}: writes {b}[{lo}:{hi}], overlapping an earlier write "
                                f"(every element must be written exactly once per call)")
            elif lo > pos:
                problems.append(f"{b}[{pos}:{lo}] is never written (the instruction writing it is missing?)")
            pos = max(pos, hi)
        numel = math.prod(bufs[b][0]) // slots.get(b, 1)      # a call writes one slot of a parity buffer
        if pos < numel:
            problems.append(f"{b}[{pos}:{numel}] is never written (the instruction writing it is missing?)")
    if problems:
        raise TapeError(problems)
    # -- 5. reads covered by (transitive) producers -------------------------------------
    eff = _queue_waits(tape, decoded)
    anc = _counter_closure(tape, decoded, producers, eff)
    sorted_w = {b: sorted(ws, key=lambda t: t[0]) for b, ws in writes.items()}
    starts = {b: [w[0] for w in ws] for b, ws in sorted_w.items()}
    memo: dict[Region, tuple[frozenset, list]] = {}
    n_regions = 0
    for d in decoded:
        waited = 0
        for c in eff[d.slot]:
            waited |= anc.get(c, 0)
        for r in d.ins.reads(lay):
            n_regions += 1
            if r not in memo:
                memo[r] = _writers_of(r, sorted_w.get(r.buf, []), starts.get(r.buf, []))
            sigs, uncovered = memo[r]
            if uncovered:
                problems.append(f"{_name(tape, d)}: reads {r.buf}[{uncovered[0][0]}:{uncovered[0][1]}] "
                                f"which no instruction writes")
            for c, w in sigs:
                if c == NO_COUNTER or not (waited >> c) & 1:
                    why = "signals no counter" if c == NO_COUNTER else f"signals {_cname(tape, c)}"
                    problems.append(f"{_name(tape, d)}: reads {r.buf}[{r.lo}:{r.hi}] written by "
                                    f"{_name(tape, w)}, which it does not wait for ({why})")
                    break
    # -- 6. liveness --------------------------------------------------------------------
    problems += _pool_order(tape, decoded)
    problems += _deadlocks(tape, decoded, producers, sequential=False)
    if sequential and not problems:
        problems += _deadlocks(tape, decoded, producers, sequential=True)
    if problems:
        raise TapeError(problems)
    return Report(n, tape.n_counters, tape.num_sms, n_regions)


def _parity_slots(classes) -> dict[str, int]:
    """Buffers allocated as several slots, one per call parity (``Instruction.PARITY_SLOTS``)."""
    return {b: n for cls in classes for b, n in cls.PARITY_SLOTS.items()}


def _writers_of(r: Region, ws, starts) -> tuple[list, list]:
    """(distinct (signal counter, a writer) pairs of the writes overlapping r, uncovered ranges)."""
    k = max(0, bisect.bisect_right(starts, r.lo) - 1)
    sigs: dict[int, Decoded] = {}
    pos, uncovered = r.lo, []
    while k < len(ws) and ws[k][0] < r.hi:
        lo, hi, d = ws[k]
        if hi > r.lo:
            if lo > pos:
                uncovered.append((pos, lo))
            sigs.setdefault(d.signal, d)
            pos = max(pos, hi)
        k += 1
    if pos < r.hi:
        uncovered.append((pos, r.hi))
    return list(sigs.items()), uncovered


def _queue_waits(tape: Tape, decoded) -> dict[int, frozenset]:
    """Per slot, the counters complete when the instruction starts: its own waits and those of
    every earlier instruction of its SM queue (pool instructions: their own waits only)."""
    out: dict[int, frozenset] = {}
    acc: dict[int, frozenset] = {}
    for d in decoded:                                   # queues in order, then the pool
        own = frozenset(c for c, _ in d.waits)
        if d.sm == Tape.POOL:
            out[d.slot] = own
        else:
            acc[d.sm] = acc.get(d.sm, frozenset()) | own
            out[d.slot] = acc[d.sm]
    return out


def _counter_closure(tape: Tape, decoded, producers, eff: dict[int, frozenset]) -> dict[int, int]:
    """For each counter, the bitset of counters that must have completed when it completes."""
    memo: dict[int, int] = {}
    on_stack: set[int] = set()

    def closure(c: int) -> int:
        stack = [(c, False)]
        while stack:
            x, done = stack.pop()
            if done:
                bits = 1 << x
                for p in producers.get(x, []):
                    for w in eff[p.slot]:
                        bits |= memo.get(w, 0)
                memo[x] = bits
                on_stack.discard(x)
                continue
            if x in memo or x in on_stack:
                continue
            on_stack.add(x)
            stack.append((x, True))
            for p in producers.get(x, []):
                for w in eff[p.slot]:
                    if w not in memo and w not in on_stack:
                        stack.append((w, False))
        return memo[c]

    for c in range(tape.n_counters):
        closure(c)
    return memo


def _pool_order(tape: Tape, decoded) -> list[str]:
    """The pool may be taken in any interleaving only if no queued instruction waits on a counter
    a pool instruction signals, and each pool instruction's pool producers come before it."""
    out = []
    pool = [d for d in decoded if d.sm == Tape.POOL]
    pos = {d.slot: k for k, d in enumerate(pool)}
    first: dict[int, Decoded] = {}       # counter -> its first pool producer
    last: dict[int, Decoded] = {}        # counter -> its last pool producer
    for d in pool:
        if d.signal != NO_COUNTER:
            first.setdefault(d.signal, d)
            last[d.signal] = d
    for d in decoded:
        for c, _ in d.waits:
            if c not in first:
                continue
            if d.sm != Tape.POOL:
                out.append(f"{_name(tape, d)}: waits on {_cname(tape, c)}, which pool {_name(tape, first[c])} "
                           f"signals: a queue may not wait on the pool (every SM could be in its queue)")
            elif pos[last[c].slot] >= pos[d.slot]:
                late = next(p for p in pool[pos[d.slot]:] if p.signal == c)
                out.append(f"{_name(tape, d)}: waits on {_cname(tape, c)}, which {_name(tape, late)} signals "
                           f"later in the pool (the pool must be in a topological order)")
    return out


def _deadlocks(tape: Tape, decoded, producers, sequential: bool) -> list[str]:
    """Greedy execution with monotone counters: it gets stuck iff some interleaving deadlocks
    (or, with ``sequential``, iff running SM 0 to the end, then the pool, then SM 1, ... gets
    stuck). The pool runs as one more queue, in order, after the SMs: given :func:`_pool_order`,
    the queues never need it, and the lowest unfinished ticket is the one to run."""
    by_sm: dict[int, list[Decoded]] = defaultdict(list)
    for d in decoded:
        by_sm[d.sm].append(d)
    done = Counter()
    heads = {s: 0 for s in by_sm}
    sms = sorted(s for s in by_sm if s != Tape.POOL)
    pool = [Tape.POOL] if Tape.POOL in by_sm else []
    order = sms[:1] + pool + sms[1:] if sequential else sms + pool
    progress = True
    while progress:
        progress = False
        for s in order:
            q = by_sm[s]
            while heads[s] < len(q):
                d = q[heads[s]]
                if any(done[c] < t for c, t in d.waits):
                    break
                heads[s] += 1
                progress = True
                if d.signal != NO_COUNTER:
                    done[d.signal] += 1
            if sequential and heads[s] < len(q):
                d = q[heads[s]]
                c, t = next((c, t) for c, t in d.waits if done[c] < t)
                return [f"{_name(tape, d)}: under sequential execution (Triton interpreter) waits on "
                        f"{_cname(tape, c)} for {t} but only {done[c]} producers ran before it"]
    out = []
    for s in order:
        q = by_sm[s]
        if heads[s] < len(q):
            d = q[heads[s]]
            c, t = next((c, t) for c, t in d.waits if done[c] < t)
            blocked = [p for p in producers.get(c, []) if heads[p.sm] <= by_sm[p.sm].index(p)]
            why = (f"; e.g. producer {_name(tape, blocked[0])} never gets to run (it is queued behind a "
                   f"blocked instruction of {Tape.where(blocked[0].sm)})") if blocked else ""
            out.append(f"deadlock: {_name(tape, d)} waits on {_cname(tape, c)} for {t}, "
                       f"only {done[c]} producers can ever finish{why}")
    return out


# ---- tensor parallel: both ranks' tapes together ------------------------------------------------------
@dataclass
class TPReport:
    n_ranks: int
    n_instructions: int
    n_sms: int
    n_cross_edges: int          # waits on counters the peer signals
    n_regions_checked: int

    def __str__(self) -> str:
        return (f"verified across {self.n_ranks} ranks: {self.n_instructions} instructions on {self.n_ranks} x "
                f"{self.n_sms} SMs, {self.n_cross_edges} cross-rank waits, {self.n_regions_checked} read regions "
                f"proven covered, no deadlock under any interleaving")


def verify_tp(tapes: list[Tape]) -> TPReport:
    """Verify the tapes of a tensor-parallel step (``compile_model(..., tp=2).tapes``) as one system:
    the 2 x ``num_sms`` queues (and each rank's pool) with the cross-rank edges. An instruction whose
    class has ``SIGNALS_PEER`` signals the counter of that index on the other rank; one with
    ``WRITES_PEER`` writes the other rank's buffers. Raises :class:`TapeError` naming the rank, the
    instruction and its SM, or returns a :class:`TPReport`. Checks:

    1. the tapes are ranks 0 and 1 of one :class:`opcodes.tp.TPLayout` model with the same counters
       (both the layers, or both whole-model decoders: :class:`opcodes.tp.TPDecoderLayout`);
    2. every wait's per-call target equals the number of its producers on both ranks;
    3. every element of every buffer of every rank is written exactly once per call (a buffer of
       ``PARITY_SLOTS``: one slot), by its own rank or, for the buffers the peer writes, by the peer;
       a buffer the peer writes must have two parity slots;
    4. every read is covered by writes that it (transitively, across ranks) waits for;
    5. no interleaving of the 2 x ``num_sms`` SMs deadlocks (greedy execution with monotone counters);
    6. double buffering is safe: each rank waits on at least one counter its peer signals.

    Why two slots suffice (6): calls of one rank run one after another (a kernel launch ends when its
    queues are done), and call ``e`` writes and reads slot ``e % 2``. Rank r in call ``e + 2`` has
    finished call ``e + 1``, which waited on a counter the peer signals in call ``e + 1`` (counters
    reach ``target * epoch`` only with that call's signals, and the peer's call ``e + 1`` starts after
    its call ``e`` ends): so the peer has finished call ``e``, every read of slot ``e % 2`` included,
    before rank r writes that slot again. A rank is never more than one call ahead of its peer.
    """
    problems: list[str] = []
    R = len(tapes)
    if R != 2:
        raise TapeError([f"verify_tp takes the tapes of 2 ranks, got {R}"])
    for r, t in enumerate(tapes):
        lay = t.lay
        if getattr(lay, "tp_size", None) != R or getattr(lay, "tp_rank", None) != r:
            problems.append(f"tape {r} has layout {type(lay).__name__} (tp_rank={getattr(lay, 'tp_rank', None)}, "
                            f"tp_size={getattr(lay, 'tp_size', None)}), not rank {r} of {R}")
    if problems:
        raise TapeError(problems)
    if type(tapes[0].lay) is not type(tapes[1].lay):
        raise TapeError([f"the ranks' tapes are of different layouts ({type(tapes[0].lay).__name__} and "
                         f"{type(tapes[1].lay).__name__}): both whole-model decoders or both the layers only"])
    if tapes[0].counters != tapes[1].counters:
        raise TapeError([f"the ranks' tapes have different counters ({tapes[0].n_counters} vs {tapes[1].n_counters}"
                         "): a peer's signal names the counter of the same index"])
    if tapes[0].lay.cfg.to_dict() != tapes[1].lay.cfg.to_dict() or tapes[0].lay.tiling != tapes[1].lay.tiling:
        raise TapeError(["the ranks' tapes are of different shard configs or tilings"])
    n_c = tapes[0].n_counters
    dec = []
    for t in tapes:
        try:
            dec.append(decode(t))
        except ValueError as e:
            raise TapeError([str(e)]) from None

    def name(r: int, d: Decoded) -> str:
        return f"rank {r} {_name(tapes[r], d)}"

    def cname(r: int, c: int) -> str:
        return f"rank {r}'s {_cname(tapes[r], c)}"

    def gid(r: int, c: int) -> int:
        return r * n_c + c

    # -- 2. counters across ranks --------------------------------------------------------------
    producers: dict[int, list[tuple[int, Decoded]]] = defaultdict(list)
    for r in range(R):
        for d in dec[r]:
            if d.signal != NO_COUNTER:
                producers[gid(1 - r if type(d.ins).SIGNALS_PEER else r, d.signal)].append((r, d))
    n_cross = 0
    waits_peer = [False] * R
    prod_ranks = {g: {pr for pr, _ in ps} for g, ps in producers.items()}     # which ranks signal g
    for r in range(R):
        for d in dec[r]:
            for c, t in d.waits:
                ps = producers.get(gid(r, c), [])
                if prod_ranks.get(gid(r, c), set()) - {r}:
                    n_cross += 1
                    waits_peer[r] = True
                if len(ps) != t:
                    src = sorted({pr for pr, _ in ps})
                    problems.append(f"{name(r, d)}: waits on {cname(r, c)} for {t}, but {len(ps)} instruction(s)"
                                    f"{' of rank(s) ' + str(src) if src else ''} signal it")
    # -- 3. every buffer element written once per call, by its rank or its peer ------------------
    writes: list[dict[str, list]] = [defaultdict(list) for _ in range(R)]
    for r in range(R):
        for d in dec[r]:
            cls = type(d.ins)
            dst = 1 - r if cls.WRITES_PEER else r
            for reg in d.ins.writes(tapes[r].lay):
                writes[dst][reg.buf].append((reg.lo, reg.hi, r, d))
                if cls.WRITES_PEER and cls.PARITY_SLOTS.get(reg.buf, 1) != 2:
                    problems.append(f"{name(r, d)}: writes rank {dst}'s {reg.buf}, which is not double-buffered "
                                    f"(PARITY_SLOTS: 2 slots, one per call parity)")
    for r in range(R):
        bufs = tapes[r].buffers()
        slots = _parity_slots(tapes[r].classes())
        for b, ws in writes[r].items():
            if b not in bufs:
                problems.append(f"{name(ws[0][2], ws[0][3])}: writes unknown buffer {b!r} of rank {r}")
        for b in bufs:
            pos = 0
            for lo, hi, wr, d in sorted(writes[r].get(b, []), key=lambda w: (w[0], w[1])):
                if lo < pos:
                    problems.append(f"{name(wr, d)}: writes rank {r}'s {b}[{lo}:{hi}], overlapping an earlier write "
                                    f"(every element must be written exactly once per call)")
                elif lo > pos:
                    problems.append(f"rank {r}'s {b}[{pos}:{lo}] is never written (a missing instruction, or a "
                                    f"missing push from rank {1 - r}?)")
                pos = max(pos, hi)
            numel = math.prod(bufs[b][0]) // slots.get(b, 1)
            if pos < numel:
                problems.append(f"rank {r}'s {b}[{pos}:{numel}] is never written (a missing instruction, or a "
                                f"missing push from rank {1 - r}?)")
    for r in range(R):
        if not waits_peer[r]:
            problems.append(f"rank {r} waits on no counter that rank {1 - r} signals: it could run two calls ahead "
                            f"and overwrite a parity slot its peer has not read")
    if problems:
        raise TapeError(problems)
    # -- 4. reads covered, with the cross-rank edges -------------------------------------------------
    eff = {}
    for r in range(R):
        for slot, cs in _queue_waits(tapes[r], dec[r]).items():
            eff[(r, slot)] = [gid(r, c) for c in cs]
    memo: dict[int, int] = {}

    def closure(g0: int) -> int:
        stack = [(g0, False)]
        seen = set()
        while stack:
            g, done = stack.pop()
            if done:
                bits = 1 << g
                for pr, p in producers.get(g, []):
                    for w in eff[(pr, p.slot)]:
                        bits |= memo.get(w, 0)
                memo[g] = bits
                continue
            if g in memo or g in seen:
                continue
            seen.add(g)
            stack.append((g, True))
            for pr, p in producers.get(g, []):
                for w in eff[(pr, p.slot)]:
                    if w not in memo and w not in seen:
                        stack.append((w, False))
        return memo[g0]

    n_regions = 0
    for r in range(R):
        ws_sorted = {b: sorted(ws, key=lambda w: w[0]) for b, ws in writes[r].items()}
        # The writes of a buffer do not overlap (point 3), so in order of their starts their ends are
        # in order too. Adjacent writes whose signals are the same counter are one run (e.g. the
        # GATE_UP tiles of a layer, each DOWN tile's read spans hundreds of them): a read looks up its
        # first overlapping run by bisection and tests each counter once (a scan over every write of
        # the buffer per read made this check take minutes for 16 layers of the 70B shape).
        runs: dict[str, list] = {}
        for b, ws in ws_sorted.items():
            rs = runs[b] = []
            for k, (lo, hi, wr, w) in enumerate(ws):
                g = NO_COUNTER if w.signal == NO_COUNTER else gid(1 - wr if type(w.ins).SIGNALS_PEER else wr,
                                                                  w.signal)
                if rs and rs[-1][2] == g and rs[-1][1] == lo:
                    rs[-1][1] = hi
                else:
                    rs.append([lo, hi, g, k])
        run_ends = {b: [x[1] for x in rs] for b, rs in runs.items()}
        wcache: dict[tuple, int] = {}       # the tiles of a stage wait on the same counters
        for d in dec[r]:
            wkey = tuple(eff[(r, d.slot)])
            waited = wcache.get(wkey)
            if waited is None:
                waited = 0
                for g in wkey:
                    waited |= closure(g)
                wcache[wkey] = waited
            for reg in d.ins.reads(tapes[r].lay):
                n_regions += 1
                rs, ws, checked = runs.get(reg.buf, []), ws_sorted.get(reg.buf, []), set()
                for j in range(bisect.bisect_right(run_ends.get(reg.buf, []), reg.lo), len(rs)):
                    run_lo, _, g, k = rs[j]
                    if run_lo >= reg.hi:
                        break
                    if g in checked:
                        continue
                    checked.add(g)
                    if g == NO_COUNTER or not (waited >> g) & 1:
                        while ws[k][1] <= reg.lo:       # the run's first write that overlaps the read
                            k += 1
                        lo, hi, wr, w = ws[k]
                        why = "signals no counter" if g == NO_COUNTER else f"signals {cname(g // n_c, g % n_c)}"
                        problems.append(f"{name(r, d)}: reads rank {r}'s {reg.buf}[{reg.lo}:{reg.hi}] written by "
                                        f"{name(wr, w)}, which it does not wait for ({why})")
                        break
    if problems:
        raise TapeError(problems)
    # -- 5. liveness of the 2 x num_sms queues (and each rank's pool, in ticket order) -----------------
    by_q: dict[tuple[int, int], list[Decoded]] = defaultdict(list)
    for r in range(R):
        for d in dec[r]:
            by_q[(r, d.sm)].append(d)
    order = sorted(by_q, key=lambda q: (q[1] == Tape.POOL, q))
    done = Counter()
    heads = {q: 0 for q in by_q}
    progress = True
    while progress:
        progress = False
        for q in order:
            r, lst = q[0], by_q[q]
            while heads[q] < len(lst):
                d = lst[heads[q]]
                if any(done[gid(r, c)] < t for c, t in d.waits):
                    break
                heads[q] += 1
                progress = True
                if d.signal != NO_COUNTER:
                    done[gid(1 - r if type(d.ins).SIGNALS_PEER else r, d.signal)] += 1
    for q in order:
        r, lst = q[0], by_q[q]
        if heads[q] < len(lst):
            d = lst[heads[q]]
            c, t = next((c, t) for c, t in d.waits if done[gid(r, c)] < t)
            blocked = [(pr, p) for pr, p in producers.get(gid(r, c), [])
                       if heads[(pr, p.sm)] <= by_q[(pr, p.sm)].index(p)]
            why = ""
            if blocked:
                pr, p = blocked[0]
                why = (f"; e.g. producer {name(pr, p)} never gets to run (it is queued behind a blocked instruction "
                       f"of rank {pr} {Tape.where(p.sm)})")
            problems.append(f"deadlock: {name(r, d)} waits on {cname(r, c)} for {t}, only {done[gid(r, c)]} "
                            f"producers can ever finish{why}")
    if problems:
        raise TapeError(problems)
    return TPReport(R, sum(len(t) for t in tapes), tapes[0].num_sms, n_cross, n_regions)
