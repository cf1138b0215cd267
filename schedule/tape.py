"""The instruction tape: fixed-width int32 words per instruction, one queue per SM.

``words``   int32 [n_instructions, WORDS], the queues of SM 0, 1, ... one after another, then the pool
``offsets`` int32 [num_sms + 2]: SM s runs ``words[offsets[s]:offsets[s+1]]`` in order; the pool is
            ``words[offsets[num_sms]:offsets[num_sms+1]]``: an SM that has run its queue takes pool
            instructions one at a time, in order, by an atomic ticket on counter ``pool_counter``
            (which nothing waits on or signals; it advances by pool length + SMs per call)

Word layout (from :mod:`opcodes.base`): ``[opcode, wait_a, target_a, wait_b, target_b, signal,
operands...]``; unused words are 0, unused counters -1. Targets are per call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from opcodes import (BY_OPCODE, HEADER, MAX_WAITS, NO_COUNTER, WORDS, Instruction, Layout, layout_from_json,
                     scratch_buffers)

from .assign import Schedule


@dataclass
class Tape:
    lay: Layout
    num_sms: int
    words: torch.Tensor               # int32 [n, WORDS]
    offsets: torch.Tensor             # int32 [num_sms + 2] (the last range is the pool)
    counters: list[str]
    prog_index: list[int] = field(default_factory=list)   # tape slot -> program index (for messages)
    meta: dict = field(default_factory=dict)
    pool_counter: int = NO_COUNTER     # the ticket counter of the pool (NO_COUNTER: no pool)

    #: the pseudo-SM of pool instructions in messages and decoded slots
    POOL = -1

    @property
    def n_counters(self) -> int:
        return len(self.counters)

    def __len__(self) -> int:
        return int(self.words.shape[0])

    def sm_range(self, sm: int) -> range:
        return range(int(self.offsets[sm]), int(self.offsets[sm + 1]))

    def pool_range(self) -> range:
        return range(int(self.offsets[self.num_sms]), int(self.offsets[self.num_sms + 1]))

    @property
    def pool_len(self) -> int:
        return len(self.pool_range())

    def classes(self) -> list[type[Instruction]]:
        """The opcodes on the tape, by opcode number (what the interpreter kernel must dispatch)."""
        ops = sorted({int(o) for o in self.words[:, 0].unique().tolist()}) if len(self) else []
        unknown = [o for o in ops if o not in BY_OPCODE]
        if unknown:
            raise ValueError(f"tape: opcodes {unknown} are not registered (known: {sorted(BY_OPCODE)})")
        return [BY_OPCODE[o] for o in ops]

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The scratch buffers its opcodes write: name -> (shape, dtype)."""
        return scratch_buffers(self.lay, self.classes())

    def repeated_waits(self) -> tuple[int, int]:
        """(waits on the SM queues, those that an earlier instruction of the same queue already
        made on the same counter). Every wait on a counter has the same per-call target, so a
        repeated one is met before it is polled: an SM could skip its acquire (pool instructions
        run on any SM and are not counted)."""
        total = repeated = 0
        for s in range(self.num_sms):
            seen: set[int] = set()
            for k in self.sm_range(s):
                for c, _ in decode_slot(self, k, s).waits:
                    total += 1
                    repeated += c in seen
                    seen.add(c)
        return total, repeated

    def elide_repeated_waits(self) -> "Tape":
        """This tape without the waits :meth:`repeated_waits` counts: an SM runs its queue in order
        and a counter only grows during a call, so a wait on a counter that an earlier instruction
        of the same queue waited on is met before it is polled (its acquire is one L2 round trip
        for nothing). The data it guarded is visible: the earlier acquire was this SM's, and
        everything produced on other SMs is read through L2. Pool instructions keep their waits
        (any SM may run them). The verifier reasons with the same queue order."""
        words = self.words.clone()
        for s in range(self.num_sms):
            seen: set[int] = set()
            for k in self.sm_range(s):
                w = words[k].tolist()
                keep = [(w[1 + 2 * j], w[2 + 2 * j]) for j in range(MAX_WAITS) if w[1 + 2 * j] != NO_COUNTER]
                new = [(c, t) for c, t in keep if c not in seen]
                seen.update(c for c, _ in keep)
                for j in range(MAX_WAITS):
                    c, t = new[j] if j < len(new) else (NO_COUNTER, 0)
                    words[k, 1 + 2 * j] = c
                    words[k, 2 + 2 * j] = t
        meta = dict(self.meta, elided_waits=self.repeated_waits()[1])
        return Tape(self.lay, self.num_sms, words, self.offsets.clone(), list(self.counters), list(self.prog_index),
                    meta, self.pool_counter)

    def tickets_per_call(self) -> int:
        """How far the pool counter advances in one call: every pool instruction is one ticket,
        and every SM takes one more ticket, past the end, before it stops."""
        return self.pool_len + self.num_sms if self.pool_len else 0

    def sm_of_slot(self) -> list[int]:
        """The SM of each slot; pool slots: :attr:`POOL` (any SM may take them)."""
        out = [self.POOL] * len(self)
        for s in range(self.num_sms):
            for k in self.sm_range(s):
                out[k] = s
        return out

    @staticmethod
    def where(sm: int) -> str:
        return "pool" if sm == Tape.POOL else f"sm {sm}"

    def describe(self, slot: int) -> str:
        """'instruction 412 (attn_reduce layer=0 g=3, sm 17)' for error messages."""
        sm = self.sm_of_slot()[slot] if len(self) else -1
        op = int(self.words[slot, 0])
        cls = BY_OPCODE.get(op)
        if cls is None:
            return f"instruction {slot} (opcode {op}?, {self.where(sm)})"
        return f"instruction {slot} ({cls.decode(self.words[slot, HEADER:].tolist())}, {self.where(sm)})"

    def listing(self) -> str:
        lines = [f"# tape: {len(self)} instructions, {self.num_sms} SMs, {self.n_counters} counters"
                 + (f", a pool of {self.pool_len} taken by ticket ({self.counters[self.pool_counter]})"
                    if self.pool_len else "")]
        for s in list(range(self.num_sms)) + ([self.POOL] if self.pool_len else []):
            lines.append(f"{self.where(s)}:")
            for k in (self.pool_range() if s == self.POOL else self.sm_range(s)):
                d = decode_slot(self, k)
                waits = " ".join(f"wait {self.counters[c]}>={t}" for c, t in d.waits)
                sig = f"signal {self.counters[d.signal]}" if d.signal != NO_COUNTER else ""
                lines.append(f"  {k:6d}  {str(d.ins):42s} {waits:28s} {sig}")
        return "\n".join(lines)

    # ---- serialisation ------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "megatape-tape/2", "words_per_instruction": WORDS,
                "opcodes": {cls.NAME: op for op, cls in BY_OPCODE.items()},
                "layout": self.lay.to_json(),
                "num_sms": self.num_sms, "counters": self.counters,
                "offsets": self.offsets.tolist(), "words": self.words.tolist(),
                "prog_index": self.prog_index, "meta": self.meta, "pool_counter": self.pool_counter}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def from_json(cls, obj: dict) -> "Tape":
        fmt = obj.get("format")
        if fmt not in ("megatape-tape/1", "megatape-tape/2"):
            raise ValueError(f"not a megatape tape (format {fmt!r})")
        ops = {cls_.NAME: op for op, cls_ in BY_OPCODE.items()}
        if obj["opcodes"] != ops:
            raise ValueError(f"tape was written with opcodes {obj['opcodes']}, this build has {ops}")
        lay_obj = obj.get("layout")
        if not isinstance(lay_obj, dict):     # files before layouts serialised themselves
            if obj["tiling"].get("fold"):
                raise ValueError("tape: written with Tiling.fold = 1, which no longer exists; compile it again")
            lay_obj = {"kind": lay_obj or "Layout", "cfg": obj["cfg"], "cfg_name": obj.get("cfg_name", "custom"),
                       "tiling": {k: v for k, v in obj["tiling"].items() if k != "fold"},
                       "max_seq": obj["max_seq"], "extra": obj.get("layout_extra", {})}
        lay = layout_from_json(lay_obj)
        words = torch.tensor(obj["words"], dtype=torch.int32).reshape(-1, WORDS)
        offsets = list(obj["offsets"])
        if fmt == "megatape-tape/1":          # no pool: an empty pool range after the queues
            offsets.append(offsets[-1])
        return cls(lay, obj["num_sms"], words, torch.tensor(offsets, dtype=torch.int32),
                   list(obj["counters"]), list(obj.get("prog_index", [])), dict(obj.get("meta", {})),
                   int(obj.get("pool_counter", NO_COUNTER)))

    @classmethod
    def load(cls, path) -> "Tape":
        with open(path) as f:
            return cls.from_json(json.load(f))


@dataclass(frozen=True)
class Decoded:
    slot: int
    sm: int
    ins: Instruction
    waits: tuple[tuple[int, int], ...]     # (counter, per-call target)
    signal: int


def encode(sched: Schedule) -> Tape:
    prog = sched.prog
    targets = prog.targets()
    rows, index = [], []
    offsets = [0]
    for q in list(sched.queues) + [sched.pool]:
        for i in q:
            ins = prog.instrs[i]
            w = [0] * WORDS
            w[0] = ins.OPCODE
            ws = prog.waits[i]
            if len(ws) > MAX_WAITS:
                raise ValueError(f"{ins} waits on {len(ws)} counters; the tape holds {MAX_WAITS}")
            for k in range(MAX_WAITS):
                w[1 + 2 * k] = ws[k] if k < len(ws) else NO_COUNTER
                w[2 + 2 * k] = targets[ws[k]] if k < len(ws) else 0
            w[5] = prog.signal[i]
            ops = ins.operands()
            w[HEADER:HEADER + len(ops)] = ops
            rows.append(w)
            index.append(i)
        offsets.append(len(rows))
    words = torch.tensor(rows, dtype=torch.int32).reshape(-1, WORDS)
    counters = list(prog.counters)
    pool_counter = NO_COUNTER
    if sched.pool:
        counters.append("pool")
        pool_counter = len(counters) - 1
    return Tape(prog.lay, sched.num_sms, words, torch.tensor(offsets, dtype=torch.int32),
                counters, index, {"policy": sched.policy}, pool_counter)


def decode_slot(tape: Tape, slot: int, sm: int = -1) -> Decoded:
    w = tape.words[slot].tolist()
    cls = BY_OPCODE.get(w[0])
    if cls is None:
        raise ValueError(f"instruction {slot} ({Tape.where(sm)}): unknown opcode {w[0]}")
    waits = tuple((w[1 + 2 * k], w[2 + 2 * k]) for k in range(MAX_WAITS) if w[1 + 2 * k] != NO_COUNTER)
    return Decoded(slot, sm, cls.decode(w[HEADER:]), waits, w[5])


def decode(tape: Tape) -> list[Decoded]:
    """Every slot in tape order; pool slots have ``sm == Tape.POOL``."""
    out = []
    for s in range(tape.num_sms):
        for k in tape.sm_range(s):
            out.append(decode_slot(tape, k, s))
    for k in tape.pool_range():
        out.append(decode_slot(tape, k, Tape.POOL))
    return out
