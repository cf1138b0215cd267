"""A shared-bandwidth ("fluid") cost model of the H200 and its simulator: the predictor of a tape's makespan.

The per-SM model of :mod:`schedule.assign` gives every SM a fixed share of the HBM bandwidth
(``hbm_bw / num_sms``). The H200 profiles say otherwise: one SM streams at most
~37-45 GB/s (the bytes it keeps in flight over the loaded latency), 132 streaming SMs together
get the chip's ~4.2 TB/s (~32 GB/s each), and a latency-bound instruction (an attention split)
leaves the bandwidth it does not use to the SMs that stream. So an SM that runs attention
while ~95 others stream weights costs the chip nothing; the per-SM model charges it a full SM.

Model: every running instruction first spends a fixed time (per-instruction overhead, L2 reads,
or a measured constant for latency-bound opcodes), then streams its HBM bytes at a rate that is
at most its opcode's per-SM cap; the running instructions share ``hbm_bw`` by water-filling
(each gets ``min(cap, equal share of what the capped ones leave)``).
(A list scheduler driven by this model measured slower on the H200 than the per-SM cost
model's queues and was removed.)
"""
from __future__ import annotations

import copy
import heapq
import random
from dataclasses import dataclass, field, replace

from opcodes import REGISTRY, Timing

from .assign import Schedule, _queue_consistent_order
from .program import Program

_EPS = 1e-12


@dataclass(frozen=True)
class FluidModel:
    """Shared-bandwidth timing of the instructions (seconds, bytes/s).

    ``cap``: opcode class -> the most bytes/s one SM streams it at (default ``sm_bw``). Fixed-time
    opcodes (``Timing.FIXED`` with a measured ``FIXED_S``) take that time instead of ``overhead`` +
    L2 time; latency-bound ones (``Timing.LATENCY``, attention splits) their own H200 fit, all
    fixed time (their K/V bytes are left out of the shared bandwidth).
    Defaults: fitted to the H200 profiles of the 70B layer: the default build
    measured 436.3 us, the model says 438.0; 12.3 / 7.4 us attention splits for 64-key blocks
    unpipelined / 128-key blocks 3 stages. (Read-only streaming reaches ~4.2-4.3 TB/s, a little
    over the stream-copy figure, which counts a write for every read.)
    """

    hbm_bw: float = 4.3e12
    sm_bw: float = 37e9
    overhead: float = 0.3e-6
    l2_bw_sm: float = 100e9
    cap: dict = field(default_factory=dict)
    # run-to-run jitter: each instruction's bytes and fixed time are scaled by 1 + N(0, noise) in
    # a noisy draw (H200: sd/median of mid-phase gate/up and down tile times ~0.06), and
    # each pool instruction pays ``ticket`` seconds for its atomic ticket
    noise: float = 0.0
    ticket: float = 0.0

    @classmethod
    def h200(cls, lay=None) -> "FluidModel":
        """Fitted to the H200 measurements of the 70B layer:
        static queues and pools of 30-250 us, GEMV pipelines 4-6 deep, within -0.6..+0.1% by 3 noisy
        draws. ``lay``'s tiling sets each opcode's streaming cap (:meth:`for_layout`)."""
        m = cls(hbm_bw=4.3e12, sm_bw=37e9, overhead=0.3e-6, noise=0.06, ticket=0.5e-6)
        return m.for_layout(lay) if lay is not None else m

    #: an SM streaming with ``x`` bytes in flight waits ``SM_LATENCY + x / SM_FILL`` per round trip,
    #: so it streams at most ``x / (SM_LATENCY + x / SM_FILL)`` bytes/s (H200 fit: GEMV
    #: pipelines of 3, 4 and 5 blocks of 32 KB in flight behave as 41.5, 45 and 48 GB/s caps)
    SM_LATENCY = 0.81e-6
    SM_FILL = 64e9

    @classmethod
    def sm_cap(cls, inflight_bytes: float) -> float:
        return inflight_bytes / (cls.SM_LATENCY + inflight_bytes / cls.SM_FILL)

    def for_layout(self, lay) -> "FluidModel":
        """This model with per-opcode streaming caps from ``lay``'s tiling: (stages - 1) blocks of
        (rows x columns) bf16 weights in flight per SM (:meth:`sm_cap`), each streaming opcode's
        :meth:`~opcodes.base.Instruction.stream_rows` x :meth:`~opcodes.base.Instruction.stream_width`."""
        stages = max(1, lay.tiling.stages - 1)
        cap = {cls: self.sm_cap(cls.stream_rows(lay) * cls.stream_width(lay) * 2 * stages) for cls in REGISTRY.values()
               if cls.applies(lay) and cls.stream_rows(lay) > 0}
        cap.update(self.cap)
        return replace(self, cap=cap)

    def parts(self, prog: Program, i: int) -> tuple[float, float, float]:
        """(fixed seconds, HBM bytes, per-SM cap) of instruction ``i``. Latency-bound opcodes
        (attention splits) are all fixed time (their ~16 MB of K/V is left out of the shared
        bandwidth)."""
        ins = prog.instrs[i]
        if ins.TIMING == Timing.LATENCY:
            return ins.latency_time(prog.lay), 0.0, self.sm_bw
        c = ins.cost(prog.lay)
        if ins.TIMING == Timing.FIXED and ins.FIXED_S is not None:
            f = ins.FIXED_S
        else:
            f = self.overhead + c.l2_bytes / self.l2_bw_sm
        return f, float(c.hbm_bytes), self.cap.get(type(ins), self.sm_bw)

    def lower_bound(self, prog: Program) -> float:
        return sum(ins.cost(prog.lay).hbm_bytes for ins in prog.instrs) / self.hbm_bw

    def simulate(self, sched: Schedule) -> Schedule:
        return simulate_fluid(sched, self)


class _Engine:
    """The event loop shared by the simulator and the scheduler."""

    def __init__(self, prog: Program, num_sms: int, model: FluidModel):
        self.prog, self.model, self.num_sms = prog, model, num_sms
        self.parts = [model.parts(prog, i) for i in range(len(prog))]
        self.t = 0.0
        self.fixed_heap: list = []                 # (t_end, i)
        self.classes: dict = {}                    # cap -> [V served, rate, heap of (V_end, i)]
        self.sm_of: dict = {}
        self.start = [0.0] * len(prog)
        self.finish = [0.0] * len(prog)

    def begin(self, i: int, sm: int) -> None:
        f = self.parts[i][0]
        self.start[i] = self.t
        self.sm_of[i] = sm
        heapq.heappush(self.fixed_heap, (self.t + f, i))

    def _rates(self) -> None:
        caps = sorted(k for k, c in self.classes.items() if c[2])
        left = self.model.hbm_bw
        n = sum(len(self.classes[k][2]) for k in caps)
        for k in caps:
            c = self.classes[k]
            share = left / n if n else 0.0
            c[1] = min(k, share)
            left -= c[1] * len(c[2])
            n -= len(c[2])

    def step(self) -> list[int]:
        """Advance to the next completion; returns the instructions that finished then."""
        self._rates()
        nxt = self.fixed_heap[0][0] if self.fixed_heap else float("inf")
        for c in self.classes.values():
            if c[2] and c[1] > 0:
                nxt = min(nxt, self.t + (c[2][0][0] - c[0]) / c[1])
        if nxt == float("inf"):
            return []
        dt = max(0.0, nxt - self.t)
        for c in self.classes.values():
            c[0] += c[1] * dt
        self.t = nxt
        done = []
        while self.fixed_heap and self.fixed_heap[0][0] <= self.t + _EPS:
            _, i = heapq.heappop(self.fixed_heap)
            _, b, cap = self.parts[i]
            if b > 0:
                c = self.classes.setdefault(cap, [0.0, 0.0, []])
                heapq.heappush(c[2], (c[0] + b, i))
            else:
                done.append(i)
        for c in self.classes.values():
            while c[2] and c[2][0][0] <= c[0] + 1e-3:       # within a thousandth of a byte
                done.append(heapq.heappop(c[2])[1])
        for i in done:
            self.finish[i] = self.t
        return done

    def busy(self) -> bool:
        return bool(self.fixed_heap) or any(c[2] for c in self.classes.values())


def simulate_fluid(sched: Schedule, model: FluidModel | None = None, seed: int | None = None) -> Schedule:
    """Predicted start/finish of every instruction of ``sched`` under the fluid model: each SM
    runs its queue in order; an instruction starts when its SM is free and its producers are done.
    An SM whose queue is done takes the next pool instruction and holds it until it can start.
    ``seed``: a noisy draw (``model.noise``); pool instructions pay ``model.ticket`` either way."""
    model = model or FluidModel()
    prog = sched.prog
    _queue_consistent_order(sched)                 # raises if the queues can deadlock
    eng = _Engine(prog, sched.num_sms, model)
    if model.ticket:
        for i in sched.pool:
            f, b, cap = eng.parts[i]
            eng.parts[i] = (f + model.ticket, b, cap)
    if seed is not None and model.noise > 0:
        rng = random.Random(seed)
        eng.parts = [(f * max(0.0, 1 + rng.gauss(0, model.noise)), b * max(0.0, 1 + rng.gauss(0, model.noise)), cap)
                     for f, b, cap in eng.parts]
    left_c = [len(p) for p in prog.producers()]
    head = [0] * sched.num_sms
    idle = set(range(sched.num_sms))
    held: dict[int, int] = {}
    ticket = 0

    def dispatch():
        nonlocal ticket
        for s in sorted(idle):
            q = sched.queues[s]
            if head[s] < len(q):
                i = q[head[s]]
            else:
                if s not in held and ticket < len(sched.pool):
                    held[s] = sched.pool[ticket]
                    ticket += 1
                i = held.get(s)
                if i is None:
                    continue
            if all(left_c[c] == 0 for c in prog.waits[i]):
                if head[s] < len(q):
                    head[s] += 1
                else:
                    del held[s]
                idle.discard(s)
                eng.begin(i, s)

    dispatch()
    while eng.busy():
        for i in eng.step():
            idle.add(eng.sm_of[i])
            c = prog.signal[i]
            if c >= 0:
                left_c[c] -= 1
        dispatch()
    if any(head[s] < len(q) for s, q in enumerate(sched.queues)) or held or ticket < len(sched.pool):
        raise RuntimeError("simulate_fluid: some queue or pool instruction never finished")
    sched.start, sched.finish = eng.start, eng.finish
    sched.pool_sm = {i: eng.sm_of[i] for i in sched.pool}
    return sched


def expected_makespan(sched: Schedule, model: FluidModel | None = None, draws: int = 3) -> float:
    """Mean makespan (seconds) of ``draws`` noisy fluid simulations of ``sched`` (seeds 0, 1, ...;
    deterministic). With ``model.noise == 0`` one draw is the exact fluid prediction. ``sched``
    itself is not modified."""
    model = model or FluidModel.h200(sched.prog.lay)
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")
    n = draws if model.noise > 0 else 1
    out = []
    for k in range(n):
        s = copy.copy(sched)
        simulate_fluid(s, model, seed=k if model.noise > 0 else None)
        out.append(s.makespan)
    return sum(out) / len(out)
