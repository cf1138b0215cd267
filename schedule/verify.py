"""The tape verifier: proves, before anything runs, that a system of tapes (one per GPU) is complete,
satisfiable, deadlock-free and race-free, and names the culprit when it is not.

One GPU's tape is the system of one tape (:func:`verify`); a tensor-parallel step is the system of its
two ranks' tapes (:func:`verify_tp`), whose queues run at once and signal and write each other:
:func:`verify_system` checks either. Checks, in order:

  1. the system (two tapes): ranks 0 and 1 of one :class:`opcodes.tp.TPLayout` model with the same
     layout kind (the layers, or whole-model decoders: :class:`opcodes.tp.TPDecoderLayout`), the same
     counters, shard config and tiling;
  2. structure: offsets, opcodes, operand ranges, counter indices and targets;
  3. completeness: every instruction of the program appears exactly once (when given one);
  4. counters: every wait's per-call target equals the number of producers of that counter;
  5. outputs: every element of every scratch buffer is written exactly once per call, by its own tape
     or, for a buffer the peer writes, by the peer's (a buffer the peer writes has two parity slots);
     with two tapes, each waits on at least one counter the other signals (double buffering, below);
  6. dependencies: every read is covered by writes of instructions it (transitively, across tapes)
     waits for, or that an earlier instruction of its SM queue waited for (an SM runs its queue in
     order and counters only grow during a call: see ``Tape.elide_repeated_waits``);
  7. liveness: no interleaving of the SMs (of every tape) can deadlock (queue order + counters are
     acyclic); each pool (instructions taken by ticket at run time) is in a topological order, waits
     only on queued or earlier pool instructions, and no queue waits on a pool;
  8. optionally (one tape), sequential execution (the Triton interpreter runs programs one by one:
     SM 0's queue, then the whole pool, which SM 0 takes alone, then SM 1's queue, ...).

An instruction whose class has ``SIGNALS_PEER`` signals the counter of that index on the other tape;
one with ``WRITES_PEER`` writes the other tape's buffers. A tensor-parallel rank's tape alone is
checked as if its peer ran the same tape: such an instruction counts as signalling / writing the same
counter / buffer of its own tape, which is exact when both ranks run the same program in the same
schedule.

Why two parity slots suffice (5): calls of one rank run one after another (a kernel launch ends when
its queues are done), and call ``e`` writes and reads slot ``e % 2``. Rank r in call ``e + 2`` has
finished call ``e + 1``, which waited on a counter the peer signals in call ``e + 1`` (counters reach
``target * epoch`` only with that call's signals, and the peer's call ``e + 1`` starts after its call
``e`` ends): so the peer has finished call ``e``, every read of slot ``e % 2`` included, before rank r
writes that slot again. A rank is never more than one call ahead of its peer.
"""
from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from dataclasses import dataclass

from opcodes import BY_OPCODE, HEADER, MAX_WAITS, NO_COUNTER

from .program import Program
from .tape import Decoded, Tape


class TapeError(ValueError):
    """A tape failed verification. ``problems`` holds every message; str() shows the first few."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        more = f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else ""
        super().__init__(f"tape verification failed ({len(problems)} problem(s)):\n  " +
                         "\n  ".join(problems[:8]) + more)


@dataclass
class Report:
    n_instructions: int         # of every tape
    n_counters: int             # per tape
    n_sms: int                  # per tape
    n_regions_checked: int
    n_ranks: int = 1            # tapes in the system
    n_cross_edges: int = 0      # waits on counters the other tape signals

    def __str__(self) -> str:
        if self.n_ranks == 1:
            return (f"verified: {self.n_instructions} instructions on {self.n_sms} SMs, {self.n_counters} counters, "
                    f"{self.n_regions_checked} read regions proven covered")
        return (f"verified across {self.n_ranks} ranks: {self.n_instructions} instructions on {self.n_ranks} x "
                f"{self.n_sms} SMs, {self.n_cross_edges} cross-rank waits, {self.n_regions_checked} read regions "
                f"proven covered, no deadlock under any interleaving")


def verify(tape: Tape, prog: Program | None = None, sequential: bool = False) -> Report:
    """One GPU's tape (or a tensor-parallel rank's alone, as if its peer ran the same tape): the
    system of one tape, :func:`verify_system`. ``prog``: the program it must hold exactly."""
    return verify_system([tape], None if prog is None else [prog], sequential=sequential)


def verify_tp(tapes: list[Tape]) -> Report:
    """The tapes of a tensor-parallel step (``compile_model(..., tp=2).tapes``) as one system: the
    2 x ``num_sms`` queues (and each rank's pool) with the cross-rank edges (:func:`verify_system`)."""
    if len(tapes) != 2:
        raise TapeError([f"verify_tp takes the tapes of 2 ranks, got {len(tapes)}"])
    return verify_system(list(tapes))


class _System:
    """The tapes of a system, the names its messages use and its global counter ids: counter ``c`` of
    tape ``r`` is ``r * n_counters + c``; a ``SIGNALS_PEER`` / ``WRITES_PEER`` instruction's signal /
    buffers are the other tape's (with one tape: its own)."""

    def __init__(self, tapes: list[Tape]):
        self.tapes = tapes
        self.R = len(tapes)
        self.n_c = tapes[0].n_counters

    def peer(self, r: int) -> int:
        return 1 - r if self.R == 2 else r

    def gid(self, r: int, c: int) -> int:
        return r * self.n_c + c

    def signal_gid(self, r: int, d: Decoded) -> int:
        """The global counter ``d`` (of tape ``r``) signals, or NO_COUNTER."""
        if d.signal == NO_COUNTER:
            return NO_COUNTER
        return self.gid(self.peer(r) if type(d.ins).SIGNALS_PEER else r, d.signal)

    def rank(self, r: int) -> str:
        return "" if self.R == 1 else f"rank {r} "

    def name(self, r: int, d: Decoded) -> str:
        return f"{self.rank(r)}instruction {d.slot} ({d.ins.NAME}, {Tape.where(d.sm)})"

    def cname(self, r: int, c: int) -> str:
        t = self.tapes[r]
        own = f"counter {c} ({t.counters[c]})" if 0 <= c < t.n_counters else f"counter {c}"
        return own if self.R == 1 else f"rank {r}'s {own}"

    def gname(self, g: int) -> str:
        return self.cname(g // self.n_c, g % self.n_c)

    def bname(self, r: int, b: str) -> str:
        return b if self.R == 1 else f"rank {r}'s {b}"

    def where(self, r: int, sm: int) -> str:
        return f"{self.rank(r)}{Tape.where(sm)}"


def verify_system(tapes: list[Tape], progs: list[Program | None] | None = None, sequential: bool = False) -> Report:
    """Verify a system of tapes, one per GPU: one tape (one GPU, or a tensor-parallel rank alone), or
    the two ranks' tapes of a tensor-parallel step. Raises :class:`TapeError` naming every problem
    found (with two tapes, each instruction by its rank, SM and slot), or returns a :class:`Report`.
    ``progs``: per tape, the program it must hold exactly (or None). ``sequential``: also check the
    Triton interpreter's order (one tape only: the CPU loopback runs two ranks at once)."""
    R = len(tapes)
    if R not in (1, 2):
        raise TapeError([f"a system of {R} tapes: one GPU's tape, or the 2 ranks' of a tensor-parallel step"])
    if sequential and R != 1:
        raise ValueError("sequential: the Triton interpreter's order is one tape's (the CPU loopback runs the "
                         "ranks at once)")
    if R == 2:
        _check_ranks(tapes)
    s = _System(tapes)
    dec = [_decode(s, r) for r in range(R)]
    if progs is not None:
        problems = [m for r in range(R) if progs[r] is not None for m in _completeness(s, r, dec[r], progs[r])]
    else:
        problems = []
    producers, n_cross, counter_problems = _counters(s, dec)
    problems += counter_problems
    writes, write_problems = _outputs(s, dec)
    problems += write_problems
    if problems:
        raise TapeError(problems)
    read_problems, n_regions = _reads(s, dec, writes, producers)
    problems += read_problems
    problems += _pool_order(s, dec, producers)
    problems += _deadlocks(s, dec, producers, sequential=False)
    if sequential and not problems:
        problems += _deadlocks(s, dec, producers, sequential=True)
    if problems:
        raise TapeError(problems)
    return Report(sum(len(t) for t in tapes), tapes[0].n_counters, tapes[0].num_sms, n_regions, R, n_cross)


def _check_ranks(tapes: list[Tape]) -> None:
    """1. Two tapes are ranks 0 and 1 of one tensor-parallel model, alike but for the rank."""
    R = len(tapes)
    problems = []
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


def _decode(s: _System, r: int) -> list[Decoded]:
    """2. Tape ``r``'s instructions, queues in order then the pool, with every structural problem."""
    tape, lay, pre = s.tapes[r], s.tapes[r].lay, ("" if s.R == 1 else f"rank {r}: ")
    problems: list[str] = []
    n = len(tape)
    off = [int(v) for v in tape.offsets.tolist()]
    if len(off) != tape.num_sms + 2 or off[0] != 0 or off[-1] != n or any(a > b for a, b in zip(off, off[1:])):
        raise TapeError([f"{pre}offsets {off[:6]}... do not split {n} instructions into {tape.num_sms} queues and "
                         f"a pool (want {tape.num_sms + 2} non-decreasing offsets from 0 to {n})"])
    pool_len = off[-1] - off[-2]
    pc = tape.pool_counter
    if pool_len and not 0 <= pc < tape.n_counters:
        raise TapeError([f"{pre}the pool holds {pool_len} instructions but its ticket counter is {pc} "
                         f"(the tape has {tape.n_counters} counters)"])
    decoded: list[Decoded] = []
    for sm in list(range(tape.num_sms)) + [Tape.POOL]:
        lo, hi = (off[-2], off[-1]) if sm == Tape.POOL else (off[sm], off[sm + 1])
        for k in range(lo, hi):
            w = tape.words[k].tolist()
            cls = BY_OPCODE.get(w[0])
            if cls is None:
                problems.append(f"{s.rank(r)}instruction {k} (sm {sm}): unknown opcode {w[0]}")
                continue
            ins = cls.decode(w[HEADER:])
            waits = tuple((w[1 + 2 * j], w[2 + 2 * j]) for j in range(MAX_WAITS) if w[1 + 2 * j] != NO_COUNTER)
            d = Decoded(k, sm, ins, waits, w[5])
            name = s.name(r, d)
            for msg in ins.check_operands(lay):
                problems.append(f"{name}: operand out of range: {msg}")
            for c, t in waits:
                if not 0 <= c < tape.n_counters:
                    problems.append(f"{name}: waits on {s.cname(r, c)}, but the tape has {tape.n_counters} counters")
                if t <= 0:
                    problems.append(f"{name}: waits on {s.cname(r, c)} for {t} (targets must be >= 1)")
            if d.signal != NO_COUNTER and not 0 <= d.signal < tape.n_counters:
                problems.append(f"{name}: signals {s.cname(r, d.signal)}, but the tape has {tape.n_counters} counters")
            if pc != NO_COUNTER and (d.signal == pc or any(c == pc for c, _ in waits)):
                problems.append(f"{name}: uses {s.cname(r, pc)}, the pool's ticket counter "
                                f"(only the pool's tickets may move it)")
            decoded.append(d)
    if problems:
        raise TapeError(problems)
    return decoded


def _completeness(s: _System, r: int, decoded: list[Decoded], prog: Program) -> list[str]:
    """3. Tape ``r`` holds every instruction of ``prog`` exactly once."""
    out = []
    want = Counter(prog.instrs)
    have = Counter(d.ins for d in decoded)
    for ins, k in (want - have).items():
        out.append(f"{s.rank(r)}{ins} is missing from the tape ({k} of {want[ins]} absent)")
    for ins, k in (have - want).items():
        where = [d for d in decoded if d.ins == ins]
        out.append(f"{s.name(r, where[-1])}: {ins} appears {have[ins]} times, "
                   f"the program has it {want.get(ins, 0)} times")
    return out


def _counters(s: _System, dec) -> tuple[dict, int, list[str]]:
    """4. Every wait's target is its counter's number of producers (across the tapes). Returns the
    producers of each global counter ((tape, instruction) pairs), the waits on counters another tape
    signals, and the problems."""
    producers: dict[int, list[tuple[int, Decoded]]] = defaultdict(list)
    for r in range(s.R):
        for d in dec[r]:
            g = s.signal_gid(r, d)
            if g != NO_COUNTER:
                producers[g].append((r, d))
    out = []
    n_cross = 0
    ranks = {g: {pr for pr, _ in ps} for g, ps in producers.items()} if s.R > 1 else {}
    for r in range(s.R):
        for d in dec[r]:
            for c, t in d.waits:
                g = s.gid(r, c)
                ps = producers.get(g, [])
                if ranks.get(g, set()) - {r}:
                    n_cross += 1
                if len(ps) == t:
                    continue
                src = sorted({pr for pr, _ in ps})
                if s.R == 1:
                    out.append(f"{s.name(r, d)}: waits on {s.cname(r, c)} for {t}, but it has {len(ps)} producer(s)")
                else:
                    out.append(f"{s.name(r, d)}: waits on {s.cname(r, c)} for {t}, but {len(ps)} instruction(s)"
                               f"{' of rank(s) ' + str(src) if src else ''} signal it")
    return producers, n_cross, out


def _outputs(s: _System, dec) -> tuple[list[dict], list[str]]:
    """5. Every element of every buffer of every tape written exactly once per call; a buffer the peer
    writes is double-buffered, and with two tapes each waits on the other. Returns the writes into
    each tape's buffers (buffer -> [(lo, hi, writing tape, instruction)]) and the problems."""
    out = []
    writes: list[dict[str, list]] = [defaultdict(list) for _ in range(s.R)]
    for r in range(s.R):
        for d in dec[r]:
            cls = type(d.ins)
            dst = s.peer(r) if cls.WRITES_PEER else r
            for reg in d.ins.writes(s.tapes[r].lay):
                writes[dst][reg.buf].append((reg.lo, reg.hi, r, d))
                if cls.WRITES_PEER and cls.PARITY_SLOTS.get(reg.buf, 1) != 2:
                    out.append(f"{s.name(r, d)}: writes {s.bname(dst, reg.buf)}, which is not double-buffered "
                               f"(PARITY_SLOTS: 2 slots, one per call parity)")
    for r in range(s.R):
        bufs = s.tapes[r].buffers()
        slots = _parity_slots(s.tapes[r].classes())
        why = ("(the instruction writing it is missing?)" if s.R == 1 else
               f"(a missing instruction, or a missing push from rank {s.peer(r)}?)")
        for b, ws in writes[r].items():
            if b not in bufs:
                out.append(f"{s.name(ws[0][2], ws[0][3])}: writes unknown buffer {b!r}"
                           f"{'' if s.R == 1 else f' of rank {r}'}")
        for b in bufs:
            pos = 0
            for lo, hi, wr, d in sorted(writes[r].get(b, []), key=lambda w: (w[0], w[1])):
                if lo < pos:
                    out.append(f"{s.name(wr, d)}: writes {s.bname(r, b)}[{lo}:{hi}], overlapping an earlier write "
                               f"(every element must be written exactly once per call)")
                elif lo > pos:
                    out.append(f"{s.bname(r, b)}[{pos}:{lo}] is never written {why}")
                pos = max(pos, hi)
            numel = math.prod(bufs[b][0]) // slots.get(b, 1)      # a call writes one slot of a parity buffer
            if pos < numel:
                out.append(f"{s.bname(r, b)}[{pos}:{numel}] is never written {why}")
    if s.R > 1:
        out += [f"rank {r} waits on no counter that rank {s.peer(r)} signals: it could run two calls ahead and "
                f"overwrite a parity slot its peer has not read" for r in range(s.R) if not _waits_peer(s, dec, r)]
    return writes, out


def _waits_peer(s: _System, dec, r: int) -> bool:
    """Whether tape ``r`` waits on a counter that another tape signals."""
    theirs = {s.signal_gid(pr, d) for pr in range(s.R) if pr != r for d in dec[pr]}
    return any(s.gid(r, c) in theirs for d in dec[r] for c, _ in d.waits)


def _parity_slots(classes) -> dict[str, int]:
    """Buffers allocated as several slots, one per call parity (``Instruction.PARITY_SLOTS``)."""
    return {b: n for cls in classes for b, n in cls.PARITY_SLOTS.items()}


def _queue_waits(s: _System, dec) -> dict[tuple[int, int], frozenset]:
    """Per (tape, slot), the global counters complete when the instruction starts: its own waits and
    those of every earlier instruction of its SM queue (pool instructions: their own waits only)."""
    out: dict[tuple[int, int], frozenset] = {}
    for r in range(s.R):
        acc: dict[int, frozenset] = {}
        for d in dec[r]:                                   # queues in order, then the pool
            own = frozenset(s.gid(r, c) for c, _ in d.waits)
            if d.sm == Tape.POOL:
                out[(r, d.slot)] = own
            else:
                acc[d.sm] = acc.get(d.sm, frozenset()) | own
                out[(r, d.slot)] = acc[d.sm]
    return out


def _closure(producers, eff):
    """``closure(g)``: the bitset of global counters that must have completed when ``g`` completes."""
    memo: dict[int, int] = {}
    on_stack: set[int] = set()

    def closure(g0: int) -> int:
        if g0 in memo:
            return memo[g0]
        stack = [(g0, False)]
        while stack:
            g, done = stack.pop()
            if done:
                bits = 1 << g
                for pr, p in producers.get(g, []):
                    for w in eff[(pr, p.slot)]:
                        bits |= memo.get(w, 0)
                memo[g] = bits
                on_stack.discard(g)
                continue
            if g in memo or g in on_stack:
                continue
            on_stack.add(g)
            stack.append((g, True))
            for pr, p in producers.get(g, []):
                for w in eff[(pr, p.slot)]:
                    if w not in memo and w not in on_stack:
                        stack.append((w, False))
        return memo[g0]

    return closure


def _reads(s: _System, dec, writes, producers) -> tuple[list[str], int]:
    """6. Every read covered by writes whose signals the reader (transitively, across tapes) waits for.
    Returns the problems and the number of read regions checked."""
    out = []
    eff = _queue_waits(s, dec)
    closure = _closure(producers, eff)
    n_regions = 0
    for r in range(s.R):
        ws_sorted = {b: sorted(ws, key=lambda w: w[0]) for b, ws in writes[r].items()}
        # The writes of a buffer do not overlap (5), so in order of their starts their ends are in order
        # too. Adjacent writes whose signals are the same counter are one run (e.g. the GATE_UP tiles of a
        # layer, each DOWN tile's read spans hundreds of them): a read looks up its first overlapping run
        # by bisection, and the writers of a region are found once for all the instructions reading it.
        runs: dict[str, list] = {}
        for b, ws in ws_sorted.items():
            rs = runs[b] = []
            for k, (lo, hi, wr, w) in enumerate(ws):
                g = s.signal_gid(wr, w)
                if rs and rs[-1][2] == g and rs[-1][1] == lo:
                    rs[-1][1] = hi
                else:
                    rs.append([lo, hi, g, k])
        run_ends = {b: [x[1] for x in rs] for b, rs in runs.items()}
        regions: dict[tuple, tuple] = {}

        def writers(buf: str, lo: int, hi: int) -> tuple:
            """(the first range of [lo, hi) no write covers or None, [(global counter, a writer)] of the
            writes overlapping it, a counter once, in order)."""
            rs, ws, sigs = runs.get(buf, []), ws_sorted.get(buf, []), {}
            pos, uncovered = lo, None
            for j in range(bisect.bisect_right(run_ends.get(buf, []), lo), len(rs)):
                run_lo, run_hi, g, k = rs[j]
                if run_lo >= hi:
                    break
                if run_lo > pos and uncovered is None:
                    uncovered = (pos, run_lo)
                pos = max(pos, run_hi)
                if g not in sigs:
                    while ws[k][1] <= lo:         # the run's first write that overlaps the read
                        k += 1
                    sigs[g] = ws[k]
            if pos < hi and uncovered is None:
                uncovered = (pos, hi)
            return uncovered, list(sigs.items())

        wcache: dict[frozenset, int] = {}       # the tiles of a stage wait on the same counters
        for d in dec[r]:
            wkey = eff[(r, d.slot)]
            waited = wcache.get(wkey)
            if waited is None:
                waited = 0
                for g in wkey:
                    waited |= closure(g)
                wcache[wkey] = waited
            for reg in d.ins.reads(s.tapes[r].lay):
                n_regions += 1
                key = (reg.buf, reg.lo, reg.hi)
                if key not in regions:
                    regions[key] = writers(*key)
                uncovered, sigs = regions[key]
                if uncovered:
                    out.append(f"{s.name(r, d)}: reads {s.bname(r, reg.buf)}[{uncovered[0]}:{uncovered[1]}] "
                               f"which no instruction writes")
                for g, (_, _, wr, w) in sigs:
                    if g == NO_COUNTER or not (waited >> g) & 1:
                        why = "signals no counter" if g == NO_COUNTER else f"signals {s.gname(g)}"
                        out.append(f"{s.name(r, d)}: reads {s.bname(r, reg.buf)}[{reg.lo}:{reg.hi}] written by "
                                   f"{s.name(wr, w)}, which it does not wait for ({why})")
                        break
    return out, n_regions


def _pool_order(s: _System, dec, producers) -> list[str]:
    """7. A pool may be taken in any interleaving only if no queued instruction (of any tape) waits on
    a counter a pool instruction signals, and each pool instruction's producers in its own pool come
    before it."""
    out = []
    pooled_by_g = {g: [(pr, p) for pr, p in ps if p.sm == Tape.POOL] for g, ps in producers.items()}
    for r in range(s.R):
        pool = [d for d in dec[r] if d.sm == Tape.POOL]
        pos = {d.slot: k for k, d in enumerate(pool)}
        for d in dec[r]:
            for c, _ in d.waits:
                pooled = pooled_by_g.get(s.gid(r, c))
                if not pooled:
                    continue
                if d.sm != Tape.POOL:
                    pr, p = pooled[0]
                    out.append(f"{s.name(r, d)}: waits on {s.cname(r, c)}, which pool {s.name(pr, p)} "
                               f"signals: a queue may not wait on the pool (every SM could be in its queue)")
                    continue
                late = [p for pr, p in pooled if pr == r and pos[p.slot] >= pos[d.slot]]
                if late:
                    out.append(f"{s.name(r, d)}: waits on {s.cname(r, c)}, which {s.name(r, late[0])} signals "
                               f"later in the pool (the pool must be in a topological order)")
    return out


def _deadlocks(s: _System, dec, producers, sequential: bool) -> list[str]:
    """7. Greedy execution with monotone counters: it gets stuck iff some interleaving deadlocks
    (or, with ``sequential``, iff running SM 0 to the end, then the pool, then SM 1, ... gets stuck).
    A pool runs as one more queue, in order, after the SMs: given :func:`_pool_order`, the queues
    never need it, and the lowest unfinished ticket is the one to run."""
    by_q: dict[tuple[int, int], list[Decoded]] = defaultdict(list)
    for r in range(s.R):
        for d in dec[r]:
            by_q[(r, d.sm)].append(d)
    sms = sorted(q for q in by_q if q[1] != Tape.POOL)
    pools = sorted(q for q in by_q if q[1] == Tape.POOL)
    order = sms[:1] + pools + sms[1:] if sequential else sms + pools
    done = Counter()
    heads = {q: 0 for q in by_q}
    progress = True
    while progress:
        progress = False
        for q in order:
            r, lst = q[0], by_q[q]
            while heads[q] < len(lst):
                d = lst[heads[q]]
                if any(done[s.gid(r, c)] < t for c, t in d.waits):
                    break
                heads[q] += 1
                progress = True
                g = s.signal_gid(r, d)
                if g != NO_COUNTER:
                    done[g] += 1
            if sequential and heads[q] < len(lst):
                d = lst[heads[q]]
                c, t = next((c, t) for c, t in d.waits if done[s.gid(r, c)] < t)
                return [f"{s.name(r, d)}: under sequential execution (Triton interpreter) waits on "
                        f"{s.cname(r, c)} for {t} but only {done[s.gid(r, c)]} producers ran before it"]
    out = []
    for q in order:
        r, lst = q[0], by_q[q]
        if heads[q] < len(lst):
            d = lst[heads[q]]
            c, t = next((c, t) for c, t in d.waits if done[s.gid(r, c)] < t)
            g = s.gid(r, c)
            blocked = [(pr, p) for pr, p in producers.get(g, []) if heads[(pr, p.sm)] <= by_q[(pr, p.sm)].index(p)]
            why = ""
            if blocked:
                pr, p = blocked[0]
                why = (f"; e.g. producer {s.name(pr, p)} never gets to run (it is queued behind a blocked "
                       f"instruction of {s.where(pr, p.sm)})")
            out.append(f"deadlock: {s.name(r, d)} waits on {s.cname(r, c)} for {t}, only {done[g]} producers can "
                       f"ever finish{why}")
    return out
