"""SM assignment: a cost model, list scheduling on the critical path, and round-robin.

Both policies produce per-SM queues that are sub-sequences of one global topological order, so
no interleaving of the SMs can deadlock: the earliest unfinished instruction in that order always
has its producers done and is at the head of its queue.

A schedule may also end in a *pool* (:func:`with_pool`): instructions that no SM owns in advance.
An SM that has run its queue takes the next pool instruction (one ticket from an atomic counter),
so SMs that ran faster than planned take more of the tail. The pool is in a topological order,
its instructions wait only on queued instructions or earlier pool instructions, and no queued
instruction waits on a pool instruction; then the queues finish on their own, and the lowest
unfinished ticket always has its producers done, so no interleaving deadlocks either.
"""
from __future__ import annotations

import heapq
import random
from dataclasses import dataclass, field

from opcodes import Timing

from .program import Program


@dataclass(frozen=True)
class CostModel:
    """Predicted time of one instruction on one SM (seconds).

    ``t = overhead + hbm_bytes / (hbm_bw / num_sms) + l2_bytes / l2_bw_sm``. Defaults are the
    H200's measured stream-copy bandwidth and a per-instruction overhead that
    :func:`calibrate` can refit from a measured run.
    """

    hbm_bw: float = 4.18e12         # bytes/s over the whole chip
    l2_bw_sm: float = 100e9         # bytes/s of L2 reads per SM
    overhead: float = 0.6e-6        # s per instruction (fetch, wait, epilogue, signal)
    # True: every instruction timed by its bytes as above. False: the opcodes' timing classes
    # (opcodes.base.Timing): latency-bound ones by their own H200 fit (attention splits by loaded
    # HBM round trips), fixed ones by their measured time ``FIXED_S``
    by_bytes: bool = False

    def time(self, prog: Program, i: int, num_sms: int) -> float:
        ins = prog.instrs[i]
        if not self.by_bytes:
            if ins.TIMING == Timing.LATENCY:
                return ins.latency_time(prog.lay)
            if ins.TIMING == Timing.FIXED and ins.FIXED_S is not None:
                return ins.FIXED_S
        c = ins.cost(prog.lay)
        return self.overhead + c.hbm_bytes / (self.hbm_bw / num_sms) + c.l2_bytes / self.l2_bw_sm

    @classmethod
    def bytes_only(cls) -> "CostModel":
        """Every instruction timed by its bytes (the model before the H200 fits)."""
        return cls(by_bytes=True)

    def lower_bound(self, prog: Program) -> float:
        """Bytes / bandwidth: no schedule on this chip can beat it."""
        return sum(ins.cost(prog.lay).hbm_bytes for ins in prog.instrs) / self.hbm_bw


@dataclass
class Schedule:
    prog: Program
    num_sms: int
    queues: list[list[int]]          # per SM: program indices in execution order
    policy: str
    start: list[float] | None = None  # predicted start/finish per program index
    finish: list[float] | None = None
    pool: list[int] = field(default_factory=list)      # taken at run time, in this order
    pool_sm: dict = field(default_factory=dict)        # pool index -> the SM the simulation gave it

    @property
    def makespan(self) -> float:
        return max(self.finish) if self.finish else float("nan")

    def sm_of(self) -> list[int]:
        """The SM of each program index (pool instructions: the SM the last simulation gave
        them, -1 before any)."""
        out = [0] * len(self.prog)
        for s, q in enumerate(self.queues):
            for i in q:
                out[i] = s
        for i in self.pool:
            out[i] = self.pool_sm.get(i, -1)
        return out

    def per_sm(self) -> list[list[int]]:
        """Each SM's instructions: its queue, then the pool instructions the last simulation gave it."""
        out = [list(q) for q in self.queues]
        for i in self.pool:
            s = self.pool_sm.get(i, -1)
            if 0 <= s < self.num_sms:
                out[s].append(i)
        return out

    def busy(self, model: CostModel) -> list[float]:
        return [sum(model.time(self.prog, i, self.num_sms) for i in q) for q in self.per_sm()]


def simulate(sched: Schedule, model: CostModel) -> Schedule:
    """Predicted start/finish of every instruction under ``model``: each SM runs its queue in order,
    an instruction starts when its SM is free and all producers of its counters have finished.
    Then the pool: each pool instruction in turn goes to the SM that frees up first (its ticket),
    and starts when its producers have finished (``sched.pool_sm`` records which SM)."""
    prog, n = sched.prog, len(sched.prog)
    producers = prog.producers()
    order = _queue_consistent_order(sched)
    start, finish = [0.0] * n, [0.0] * n
    sm_free = [0.0] * sched.num_sms
    sm = sched.sm_of()
    pooled = set(sched.pool)
    cdone = [0.0] * len(prog.counters)
    left = [len(p) for p in producers]

    def run(i: int, s_m: int) -> None:
        ready = max((cdone[c] for c in prog.waits[i]), default=0.0)
        for c in prog.waits[i]:
            if left[c]:
                raise RuntimeError(f"simulate: instruction {i} scheduled before the producers of counter {c}")
        s = max(sm_free[s_m], ready)
        f = s + model.time(prog, i, sched.num_sms)
        start[i], finish[i] = s, f
        sm_free[s_m] = f
        c = prog.signal[i]
        if c >= 0:
            cdone[c] = max(cdone[c], f)
            left[c] -= 1

    for i in order:                 # the queues never wait on the pool (check_pool)
        if i not in pooled:
            run(i, sm[i])
    free = [(sm_free[s], s) for s in range(sched.num_sms)]
    heapq.heapify(free)
    pool_sm = {}
    for i in sched.pool:
        _, s = heapq.heappop(free)
        run(i, s)
        pool_sm[i] = s
        heapq.heappush(free, (sm_free[s], s))
    sched.start, sched.finish, sched.pool_sm = start, finish, pool_sm
    return sched


def check_pool(sched: Schedule) -> None:
    """Raise ValueError unless the pool can be taken dynamically without deadlock: every program
    index in exactly one queue or the pool, no queued instruction waits on a counter that a pool
    instruction signals, and every pool instruction comes after the pool producers it waits on."""
    prog = sched.prog
    seen = [0] * len(prog)
    for q in sched.queues:
        for i in q:
            seen[i] += 1
    for i in sched.pool:
        seen[i] += 1
    bad = [i for i, k in enumerate(seen) if k != 1]
    if bad:
        raise ValueError(f"schedule: instruction {bad[0]} ({prog.instrs[bad[0]]}) is placed {seen[bad[0]]} times "
                         f"(queues + pool must hold every instruction once)")
    at = {i: k for k, i in enumerate(sched.pool)}
    pool_signals: dict[int, int] = {}
    for i in sched.pool:
        c = prog.signal[i]
        if c >= 0:
            pool_signals[c] = max(pool_signals.get(c, -1), at[i])
    for s, q in enumerate(sched.queues):
        for i in q:
            for c in prog.waits[i]:
                if c in pool_signals:
                    raise ValueError(f"schedule: queued instruction {i} ({prog.instrs[i]}, sm {s}) waits on counter "
                                     f"{prog.counters[c]}, which pool instructions signal: a queue may not wait on the pool")
    for i in sched.pool:
        for c in prog.waits[i]:
            if pool_signals.get(c, -1) >= at[i]:
                raise ValueError(f"schedule: pool instruction {i} ({prog.instrs[i]}) at pool position {at[i]} waits on "
                                 f"counter {prog.counters[c]}, signalled by a later pool instruction (the pool "
                                 f"must be in a topological order)")


def with_pool(sched: Schedule, model, tail_s: float) -> Schedule:
    """Move the last ``tail_s`` seconds of the plan into a pool taken at run time.

    The instructions the simulation (under ``model``) starts at or after ``makespan - tail_s``
    leave their queues (they are a suffix of each queue, and every instruction that depends on
    one starts later, so no queue waits on the pool) and form the pool, ordered by planned start
    (ties: program order, a topological order). ``tail_s <= 0`` returns ``sched`` unchanged.
    ``model``: a :class:`CostModel` or a ``schedule.fluid.FluidModel`` (times the result)."""
    if tail_s <= 0:
        return sched
    if sched.pool:
        raise ValueError("with_pool: the schedule already has a pool")
    if sched.start is None:
        sched = simulate(sched, model)
    cut = sched.makespan - tail_s
    queues = [[i for i in q if sched.start[i] < cut] for q in sched.queues]
    pool = sorted((i for q in sched.queues for i in q if sched.start[i] >= cut), key=lambda i: (sched.start[i], i))
    out = Schedule(sched.prog, sched.num_sms, queues, f"{sched.policy}+pool({tail_s * 1e6:.0f}us)", pool=pool)
    check_pool(out)
    sim = getattr(model, "simulate", None)        # a FluidModel simulates itself
    return sim(out) if sim is not None else simulate(out, model)


def _queue_consistent_order(sched: Schedule) -> list[int]:
    """A topological order of (dataflow + queue order); raises if the queues can deadlock. The
    pool counts as one more queue, taken in order (see :func:`check_pool` for the rest)."""
    prog = sched.prog
    producers = prog.producers()
    left = [len(p) for p in producers]
    queues = list(sched.queues) + ([sched.pool] if sched.pool else [])
    heads = [0] * len(queues)
    out: list[int] = []
    progress = True
    while progress:
        progress = False
        for s, q in enumerate(queues):
            while heads[s] < len(q):
                i = q[heads[s]]
                if any(left[c] for c in prog.waits[i]):
                    break
                out.append(i)
                heads[s] += 1
                progress = True
                c = prog.signal[i]
                if c >= 0:
                    left[c] -= 1
    if len(out) != len(prog):
        stuck = [(s, q[heads[s]]) for s, q in enumerate(queues) if heads[s] < len(q)]
        raise RuntimeError(f"schedule deadlocks: {len(stuck)} SMs stuck, e.g. sm {stuck[0][0]} "
                           f"at {prog.instrs[stuck[0][1]]}")
    return out


def bottom_levels(prog: Program, model: CostModel, num_sms: int) -> list[float]:
    """Longest path (predicted time) from each instruction to the end of the program."""
    n = len(prog)
    bl = [0.0] * n
    cbl = [0.0] * len(prog.counters)          # bottom level of a counter = max over its consumers
    for i in range(n - 1, -1, -1):           # prog order is topological
        c = prog.signal[i]
        bl[i] = model.time(prog, i, num_sms) + (cbl[c] if c >= 0 else 0.0)
        for w in prog.waits[i]:
            cbl[w] = max(cbl[w], bl[i])
    return bl


class Release:
    """Dependency bookkeeping shared by the schedulers: which instructions become runnable as
    others finish. ``initial`` are those with no waits; ``done(i)`` counts ``i``'s signal and
    returns the instructions it releases (all their counters complete), in program order of the
    counter's consumers."""

    def __init__(self, prog: Program):
        self.prog = prog
        self.consumers = prog.consumers()
        self.left_c = [len(p) for p in prog.producers()]
        self.left_i = [len(ws) for ws in prog.waits]
        self.initial = [i for i in range(len(prog)) if self.left_i[i] == 0]

    def done(self, i: int) -> list[int]:
        c = self.prog.signal[i]
        if c < 0:
            return []
        self.left_c[c] -= 1
        if self.left_c[c]:
            return []
        out = []
        for j in self.consumers[c]:
            self.left_i[j] -= 1
            if self.left_i[j] == 0:
                out.append(j)
        return out


def list_schedule(prog: Program, num_sms: int, model: CostModel | None = None, backfill: bool = False) -> Schedule:
    """Critical-path list scheduling: repeatedly take the released instruction with the longest
    bottom level and put it on the SM that frees up first.

    ``backfill``: of the released instructions, take the longest bottom level among those that can start at once on
    that SM (their producers planned to be done by then); the longest overall only where none can. Without it, an
    instruction whose producers finish later is placed anyway and its SM idles until then, holding back the
    instructions queued after it (the 8B's 1024-row chunk: DOWN tiles of the first K chunk placed mid-GATE_UP, 141 of
    its 4,174 ms-SM planned idle; bench/notes/s51.md v188)."""
    _check_sms(num_sms)
    model = model or CostModel()
    n = len(prog)
    bl = bottom_levels(prog, model, num_sms)
    rel = Release(prog)
    cdone = [0.0] * len(prog.counters)
    released = [(-bl[i], i) for i in rel.initial]
    heapq.heapify(released)
    # backfill: the released instructions by the time their producers are planned done (pending) and, once the
    # SM that frees first has reached that time, by bottom level (ready); ``released`` holds them all (lazy
    # deletion: ``taken``). The SMs free up in nondecreasing time, so an instruction moves to ready once.
    pending: list[tuple[float, int]] = []
    ready: list[tuple[float, int]] = []
    taken = [False] * n
    if backfill:
        pending = [(0.0, i) for i in rel.initial]
        heapq.heapify(pending)
    sms = [(0.0, s) for s in range(num_sms)]
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    start, finish = [0.0] * n, [0.0] * n
    while released:
        free, s = heapq.heappop(sms)
        if backfill:
            while pending and pending[0][0] <= free:
                _, j = heapq.heappop(pending)
                heapq.heappush(ready, (-bl[j], j))
            while ready and taken[ready[0][1]]:
                heapq.heappop(ready)
            _, i = heapq.heappop(ready if ready else released)     # ``released``'s top is never taken (below)
            taken[i] = True
            while released and taken[released[0][1]]:
                heapq.heappop(released)
        else:
            _, i = heapq.heappop(released)
        # released: every counter it waits on has all its producers placed
        st = max([free] + [cdone[w] for w in prog.waits[i]])
        f = st + model.time(prog, i, num_sms)
        start[i], finish[i] = st, f
        queues[s].append(i)
        heapq.heappush(sms, (f, s))
        c = prog.signal[i]
        if c >= 0:
            cdone[c] = max(cdone[c], f)
        for j in rel.done(i):
            heapq.heappush(released, (-bl[j], j))
            if backfill:
                heapq.heappush(pending, (max([0.0] + [cdone[w] for w in prog.waits[j]]), j))
    if sum(map(len, queues)) != n:
        raise RuntimeError("list_schedule: some instructions were never released (a counter has no producers?)")
    return Schedule(prog, num_sms, queues, "cost", start, finish)


def round_robin(prog: Program, num_sms: int) -> Schedule:
    """Instruction i of the program order goes to SM i mod num_sms (the baseline)."""
    _check_sms(num_sms)
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    for i in range(len(prog)):
        queues[i % num_sms].append(i)
    return Schedule(prog, num_sms, queues, "round-robin")


def random_schedule(prog: Program, num_sms: int, seed: int) -> Schedule:
    """A random valid schedule: a random topological order (random choice among released
    instructions), each instruction on a random SM. For race tests."""
    _check_sms(num_sms)
    rng = random.Random(seed)
    rel = Release(prog)
    released = list(rel.initial)
    queues: list[list[int]] = [[] for _ in range(num_sms)]
    while released:
        k = rng.randrange(len(released))
        released[k], released[-1] = released[-1], released[k]
        i = released.pop()
        queues[rng.randrange(num_sms)].append(i)
        released.extend(rel.done(i))
    return Schedule(prog, num_sms, queues, f"random({seed})")


def _check_sms(num_sms) -> None:
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms <= 0:
        raise ValueError(f"num_sms must be a positive int, got {num_sms!r}")
