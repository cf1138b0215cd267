"""The tape VM: runs a tape on the CPU in torch, simulating the SMs and their counters.

Each step picks, at random, one SM whose next instruction's waits are satisfied and runs that
instruction's torch semantics (``Instruction.run_torch``). An SM whose queue is done takes the
next pool instruction (its ticket) as the kernel does, and holds it until its waits are met.
Scratch buffers start as NaN, so an instruction that reads something nobody wrote yet poisons the
result instead of passing.
"""
from __future__ import annotations

import math
import random

import torch

from opcodes import Layout, scratch_buffers

from .tape import Tape, decode


class DeadlockError(RuntimeError):
    pass


class VMState:
    """Buffers of one call: the caller's weights, cache and x, plus the scratch buffers."""

    def __init__(self, lay: Layout, weights: dict, kv_cache: list, x: torch.Tensor, pos: int, classes=(),
                 state: dict | None = None):
        self.lay = lay
        self.model = weights          # the whole dict: a decoder's embed / final_norm / lm_head
        self.weights = weights["layers"]
        self.kv = kv_cache
        self.x = x.reshape(-1)
        self.pos = pos
        # device buffers that persist across calls, as the host wrote them (e.g. SAMPLE's parameters)
        self.state = dict(state or {})
        # the opcodes' build-time tables (e.g. RoPE's cos / sin), by kernel pointer name
        self.tables = {k: v for cls in classes for k, v in cls.tables(lay, "cpu").items()}
        dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
        self.buf = {name: torch.full((math.prod(shape),), float("nan"), dtype=dt[t])
                    for name, (shape, t) in scratch_buffers(lay, classes).items()}

    def layer_input(self, layer: int) -> torch.Tensor:
        if layer == 0:
            # a decoder's layer 0 reads the row its EMBED tiles gathered (the kernel's x_ptr there)
            return self.buf["x0"] if "x0" in self.buf else self.x
        d = self.lay.cfg.d
        return self.buf["xout"][(layer - 1) * d: layer * d]

    def output(self) -> torch.Tensor:
        d, L = self.lay.cfg.d, self.lay.cfg.layers
        return self.buf["xout"][(L - 1) * d:].reshape(1, d).clone()


def run_tape(tape: Tape, weights: dict, kv_cache: list, x: torch.Tensor, pos: int,
             seed: int | None = 0, return_state: bool = False, state: dict | None = None):
    """Run one call of ``tape``; KV rows at ``pos`` are written into ``kv_cache`` in place.
    ``seed`` picks the interleaving (None: SM 0 to the end, then SM 1, ...).

    Whole-model decoder tapes (``schedule.decoder_program``): ``weights`` is the whole-model dict,
    ``x`` the (1,) int token; ``return_state=True`` returns the :class:`VMState` instead of the
    output (``buf["logits"]``, ``next_token``; see ``schedule.decoder_program.run_decoder_vm``).
    ``state``: the STATE buffers the host writes before a call, by name (SAMPLE's parameters)."""
    if not 0 <= pos < tape.lay.max_seq:
        raise ValueError(f"pos must be in [0, {tape.lay.max_seq}), got {pos}")
    st = VMState(tape.lay, weights, kv_cache, x, pos, tape.classes(), state)
    queues: dict[int, list] = {s: [] for s in range(tape.num_sms)}
    pool: list = []
    for d in decode(tape):
        (pool if d.sm == Tape.POOL else queues[d.sm]).append(d)
    heads = {s: 0 for s in queues}
    held: dict[int, object] = {}          # SM -> the pool instruction whose ticket it took
    next_ticket = 0
    counters = [0] * tape.n_counters
    rng = random.Random(seed) if seed is not None else None
    remaining = len(tape)

    def current(s):
        nonlocal next_ticket
        q = queues[s]
        if heads[s] < len(q):
            return q[heads[s]]
        if s not in held and next_ticket < len(pool):     # queue done: take a ticket
            held[s] = pool[next_ticket]
            next_ticket += 1
        return held.get(s)

    while remaining:
        cur = {s: current(s) for s in queues}
        ready = [s for s, d in cur.items() if d is not None and all(counters[c] >= t for c, t in d.waits)]
        if not ready:
            stuck = [d for d in cur.values() if d is not None]
            raise DeadlockError("VM deadlock: " + "; ".join(
                f"{tape.describe(d.slot)} waits on {[(tape.counters[c], counters[c], t) for c, t in d.waits]}"
                for d in stuck[:4]))
        if rng is None:
            s = min(ready)
        else:
            s = rng.choice(ready)
        d = cur[s]
        d.ins.run_torch(tape.lay, st)
        if d.signal >= 0:
            counters[d.signal] += 1
        if heads[s] < len(queues[s]):
            heads[s] += 1
        else:
            del held[s]
        remaining -= 1
    return st if return_state else st.output()
