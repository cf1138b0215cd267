"""The instruction tape: fixed-width int32 words per instruction, one queue per SM.

``words``   int32 [n_instructions, WORDS], the queues of SM 0, 1, ... one after another
``offsets`` int32 [num_sms + 1]: SM s runs ``words[offsets[s]:offsets[s+1]]`` in order

Word layout (from :mod:`opcodes.base`): ``[opcode, wait_a, target_a, wait_b, target_b, signal,
operands...]``; unused words are 0, unused counters -1. Targets are per call.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch

from opcodes import BY_OPCODE, HEADER, MAX_WAITS, NO_COUNTER, WORDS, Instruction, Layout, ModelConfig, Tiling

from .assign import Schedule


@dataclass
class Tape:
    lay: Layout
    num_sms: int
    words: torch.Tensor               # int32 [n, WORDS]
    offsets: torch.Tensor             # int32 [num_sms + 1]
    counters: list[str]
    prog_index: list[int] = field(default_factory=list)   # tape slot -> program index (for messages)
    meta: dict = field(default_factory=dict)

    @property
    def n_counters(self) -> int:
        return len(self.counters)

    def __len__(self) -> int:
        return int(self.words.shape[0])

    def sm_range(self, sm: int) -> range:
        return range(int(self.offsets[sm]), int(self.offsets[sm + 1]))

    def sm_of_slot(self) -> list[int]:
        out = [0] * len(self)
        for s in range(self.num_sms):
            for k in self.sm_range(s):
                out[k] = s
        return out

    def describe(self, slot: int) -> str:
        """'instruction 412 (attn_reduce layer=0 g=3, sm 17)' for error messages."""
        sm = self.sm_of_slot()[slot] if len(self) else -1
        op = int(self.words[slot, 0])
        cls = BY_OPCODE.get(op)
        if cls is None:
            return f"instruction {slot} (opcode {op}?, sm {sm})"
        return f"instruction {slot} ({cls.decode(self.words[slot, HEADER:].tolist())}, sm {sm})"

    def listing(self) -> str:
        lines = [f"# tape: {len(self)} instructions, {self.num_sms} SMs, {self.n_counters} counters"]
        for s in range(self.num_sms):
            lines.append(f"sm {s}:")
            for k in self.sm_range(s):
                d = decode_slot(self, k)
                waits = " ".join(f"wait {self.counters[c]}>={t}" for c, t in d.waits)
                sig = f"signal {self.counters[d.signal]}" if d.signal != NO_COUNTER else ""
                lines.append(f"  {k:6d}  {str(d.ins):42s} {waits:28s} {sig}")
        return "\n".join(lines)

    # ---- serialisation ------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"format": "megatape-tape/1", "words_per_instruction": WORDS,
                "opcodes": {cls.NAME: op for op, cls in BY_OPCODE.items()},
                "cfg": self.lay.cfg.to_dict(), "cfg_name": self.lay.cfg.name,
                "tiling": self.lay.tiling.__dict__, "max_seq": self.lay.max_seq,
                "layout": type(self.lay).__name__,
                "layout_extra": {k: getattr(self.lay, k) for k in ("lm_rows", "emb_cols") if hasattr(self.lay, k)},
                "num_sms": self.num_sms, "counters": self.counters,
                "offsets": self.offsets.tolist(), "words": self.words.tolist(),
                "prog_index": self.prog_index, "meta": self.meta}

    def save(self, path) -> None:
        with open(path, "w") as f:
            json.dump(self.to_json(), f)

    @classmethod
    def from_json(cls, obj: dict) -> "Tape":
        if obj.get("format") != "megatape-tape/1":
            raise ValueError(f"not a megatape tape (format {obj.get('format')!r})")
        ops = {cls_.NAME: op for op, cls_ in BY_OPCODE.items()}
        if obj["opcodes"] != ops:
            raise ValueError(f"tape was written with opcodes {obj['opcodes']}, this build has {ops}")
        cfg = ModelConfig.from_dict(obj["cfg"], name=obj.get("cfg_name", "custom"))
        kind = obj.get("layout", "Layout")
        if kind == "DecoderLayout":          # a whole model: embedding and LM head buffers too
            from opcodes.decoder import DecoderLayout
            lay = DecoderLayout(cfg, Tiling(**obj["tiling"]), obj["max_seq"], **obj.get("layout_extra", {}))
        elif kind == "Layout":
            lay = Layout(cfg, Tiling(**obj["tiling"]), obj["max_seq"])
        else:
            raise ValueError(f"tape: unknown layout kind {kind!r}")
        words = torch.tensor(obj["words"], dtype=torch.int32).reshape(-1, WORDS)
        return cls(lay, obj["num_sms"], words, torch.tensor(obj["offsets"], dtype=torch.int32),
                   list(obj["counters"]), list(obj.get("prog_index", [])), dict(obj.get("meta", {})))

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
    for q in sched.queues:
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
    return Tape(prog.lay, sched.num_sms, words, torch.tensor(offsets, dtype=torch.int32),
                list(prog.counters), index, {"policy": sched.policy})


def decode_slot(tape: Tape, slot: int, sm: int = -1) -> Decoded:
    w = tape.words[slot].tolist()
    cls = BY_OPCODE.get(w[0])
    if cls is None:
        raise ValueError(f"instruction {slot} (sm {sm}): unknown opcode {w[0]}")
    waits = tuple((w[1 + 2 * k], w[2 + 2 * k]) for k in range(MAX_WAITS) if w[1 + 2 * k] != NO_COUNTER)
    return Decoded(slot, sm, cls.decode(w[HEADER:]), waits, w[5])


def decode(tape: Tape) -> list[Decoded]:
    out = []
    for s in range(tape.num_sms):
        for k in tape.sm_range(s):
            out.append(decode_slot(tape, k, s))
    return out
