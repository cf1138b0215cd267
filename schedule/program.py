"""Lowering: a model config -> the tile instructions of every layer and the counters between them.

A :class:`Program` is the dataflow, before any SM assignment: instructions in one topological
order, the counters each waits on and the counter each signals. A counter completes when all of
its producers have signalled; the per-call wait target is therefore the number of producers.

Dependencies per layer ``l`` (one counter per arrow group):

    QKV(l, q heads of group g) --q[l,g]--> ATTN_PARTIAL(l, g, *)                  (the cache prefix)
    QKV(l, k/v head g) --kv[l,g]--> ATTN_PARTIAL(l, g, NS-1) (+ q[l,g])      (the key at pos)
    ATTN_PARTIAL(l, g, *) --part[l,g]--> ATTN_REDUCE(l, heads of g)
    (with Tiling.attn_splits 1 one ATTN_PARTIAL(l, g, 0) waits on q[l,g] and kv[l,g], attends to every key
    and signals attn[l] itself: no ATTN_REDUCE)
    (with Tiling.key_in_reduce there is no split NS-1: kv[l,g] --> ATTN_REDUCE(l, heads of g), + part[l,g])
    ATTN_REDUCE(l, *) --attn[l]--> OPROJ(l, *) --x1[l]--> GATE_UP(l, *)
    GATE_UP(l, rows in K chunk kc) --act[l,kc]--> DOWN(l, *, kc)
    DOWN(l, rows in block rb, *) --dpart[l,rb]--> RESIDUAL(l, rb) --out[l]--> QKV(l+1, *)

With ``Tiling.res_fold`` (:attr:`Layout.folds_residual`) layers but the last have no RESIDUAL:
``DOWN(l, *) --dpart[l]--> QKV(l+1, *)``, whose tiles (and layer l+1's O / O_REDUCE tiles, after
them) sum ``x1[l] + dpart[l]`` themselves; the last layer's RESIDUAL waits on ``dpart[L-1]``.

Tensor parallel (a :class:`opcodes.tp.TPLayout`: the program of one rank of two; both ranks have
the same program, on their own shards): the O projection always writes partials, and per row block
``rb`` of each all-reduced stage (O projection, down projection) O_REDUCE / RESIDUAL become

    OPROJ / DOWN (l, rows in rb, *) --opart[l,rb] / dpart[l,rb]--> TP_PUSH(l, stage, rb)
    TP_PUSH(l, stage, rb) on the PEER --recv_o[l,rb] / recv_d[l,rb]--> TP_REDUCE(l, stage, rb)
    (+ opart / dpart[l,rb])  TP_REDUCE(l, 0, rb) --x1[l]-->   TP_REDUCE(l, 1, rb) --out[l]-->

A TP_PUSH's signal is the counter of the same index in the peer's program (``SIGNALS_PEER``): the
program's producer count of ``recv_*`` is its own pushes, which equal the peer's.

"""
from __future__ import annotations

from dataclasses import dataclass, field

from opcodes import (QKV, AttnPartial, AttnReduce, Down, GateUp, Instruction, Layout, ModelConfig, OProj,
                     OReduce, Residual, Tiling, TPPush, TPReduce, cdiv)
from opcodes.base import NO_COUNTER, scratch_buffers


@dataclass
class Program:
    lay: Layout
    instrs: list[Instruction] = field(default_factory=list)
    waits: list[tuple[int, ...]] = field(default_factory=list)
    signal: list[int] = field(default_factory=list)
    counters: list[str] = field(default_factory=list)

    def add(self, ins: Instruction, waits=(), signal: int = NO_COUNTER) -> int:
        self.instrs.append(ins)
        self.waits.append(tuple(waits))
        self.signal.append(signal)
        return len(self.instrs) - 1

    def counter(self, name: str) -> int:
        self.counters.append(name)
        return len(self.counters) - 1

    def __len__(self) -> int:
        return len(self.instrs)

    def producers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.counters]
        for i, c in enumerate(self.signal):
            if c != NO_COUNTER:
                out[c].append(i)
        return out

    def targets(self) -> list[int]:
        return [len(p) for p in self.producers()]

    def classes(self) -> list[type[Instruction]]:
        """The opcodes the program uses, by opcode number."""
        return sorted({type(ins) for ins in self.instrs}, key=lambda c: c.OPCODE)

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """The scratch buffers its opcodes write: name -> (shape, dtype)."""
        return scratch_buffers(self.lay, self.classes())

    def consumers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.counters]
        for i, ws in enumerate(self.waits):
            for c in ws:
                out[c].append(i)
        return out


def check_layout(lay: Layout) -> None:
    t = lay.tiling
    if t.down_res and not lay.DOWN_RES:
        raise ValueError(f"Tiling.down_res = 1 is a rows program's (opcodes.rows_down_res), not a "
                         f"{type(lay).__name__}'s")
    if t.down_k % t.gu_rows and t.down_k < lay.cfg.ffn:
        raise ValueError(f"Tiling.down_k = {t.down_k} must be a multiple of gu_rows = {t.gu_rows} "
                         "(a gate/up tile signals the counter of one K chunk)")
    if lay.o_partial and t.red_rows % t.o_rows and t.red_rows < lay.cfg.d:
        raise ValueError(f"Tiling.red_rows = {t.red_rows} must be a multiple of o_rows = {t.o_rows} "
                         "(a split O tile signals the counter of one O_REDUCE block)")
    if lay.attn_merged and lay.n_o_k > 1 and lay.o_k % (lay.cfg.group * lay.cfg.hd):
        raise ValueError(f"Tiling.attn_splits = 1 needs whole KV groups in each O K chunk: o_k = {t.o_k} is not a "
                         f"multiple of group * hd = {lay.cfg.group * lay.cfg.hd} (an attention instruction signals "
                         "the counter of one chunk)")
    if t.red_rows % t.down_rows and t.red_rows < lay.cfg.d:
        raise ValueError(f"Tiling.red_rows = {t.red_rows} must be a multiple of down_rows = {t.down_rows} "
                         "(a down tile signals the counter of one residual block)")


def lower(lay: Layout, prog: Program | None = None, input_counter: int = NO_COUNTER,
          signal_last: bool = False) -> Program:
    """All layers of ``lay.cfg``, in a topological order (layer by layer, stage by stage).

    Extension points for programs that wrap the layers (e.g. a whole decoder): ``prog`` to append
    to, ``input_counter`` that layer 0's QKV tiles wait on (whoever writes layer 0's input x),
    ``signal_last`` to give the last layer's RESIDUAL tiles a counter too (``out[L-1]``), for
    instructions that consume the final residual stream.
    """
    check_layout(lay)
    tp = getattr(lay, "tp_size", 1) > 1
    c, t = lay.cfg, lay.tiling
    p = prog if prog is not None else Program(lay)
    prev_out = input_counter
    n_rb = cdiv(c.d, t.red_rows)
    for l in range(c.layers):
        cq = [p.counter(f"q[{l},{g}]") for g in range(c.n_kv)]
        ckv = [p.counter(f"kv[{l},{g}]") for g in range(c.n_kv)]
        cp = [] if lay.attn_merged else [p.counter(f"part[{l},{g}]") for g in range(c.n_kv)]
        n_oc = lay.n_o_k
        ca = [p.counter(f"attn[{l},{oc}]" if n_oc > 1 else f"attn[{l}]") for oc in range(n_oc)]
        cx = p.counter(f"x1[{l}]")
        cact = [p.counter(f"act[{l},{kc}]") for kc in range(lay.n_down_k)]
        last = l + 1 == c.layers
        fold = lay.folds_residual and not last       # no RESIDUAL: the next layer sums x1 + dpart itself
        if fold or (lay.folds_residual and last):
            cd = [p.counter(f"dpart[{l}]")] * n_rb  # the next layer (or the last RESIDUAL) reads every row
        else:
            cd = [p.counter(f"dpart[{l},{rb}]") for rb in range(n_rb)]
        cout = p.counter(f"out[{l}]") if (not last or signal_last) and not fold else NO_COUNTER
        w_in = (prev_out,) if prev_out != NO_COUNTER else ()
        # Q tiles first, grouped by KV head: a group's prefix attention starts when its Q is done
        for g in range(c.n_kv):
            for h in range(g * c.group, (g + 1) * c.group):
                for j in range(lay.n_tiles_per_head(0)):
                    p.add(QKV(l, 0, h, j), w_in, cq[g])
        for g in range(c.n_kv):
            for sec in (1, 2):
                for j in range(lay.n_tiles_per_head(sec)):
                    p.add(QKV(l, sec, g, j), w_in, ckv[g])
        if lay.attn_merged:         # one instruction a KV head, over every key, writing the merged output
            for g in range(c.n_kv):
                p.add(AttnPartial(l, g, 0), (cq[g], ckv[g]), ca[(g * c.group * c.hd) // lay.o_k])
        else:
            for g in range(c.n_kv):
                for s in range(lay.attn_instr_splits):
                    last = s == t.attn_splits - 1
                    p.add(AttnPartial(l, g, s), (cq[g], ckv[g]) if last else (cq[g],), cp[g])
            for h in range(c.n_q):
                g = h // c.group
                p.add(AttnReduce(l, h), (cp[g], ckv[g]) if t.key_in_reduce else (cp[g],), ca[(h * c.hd) // lay.o_k])
        if not lay.o_partial:
            for r in range(0, c.d, t.o_rows):
                p.add(OProj(l, r, 0), (ca[0],), cx)
        else:
            co = [p.counter(f"opart[{l},{rb}]") for rb in range(n_rb)]
            for oc in range(n_oc):
                for r in range(0, c.d, t.o_rows):
                    p.add(OProj(l, r, oc), (ca[oc],), co[r // t.red_rows])
            if tp:
                _all_reduce(p, l, 0, co, cx, n_rb, t.red_rows)
            else:
                for rb in range(n_rb):
                    p.add(OReduce(l, rb * t.red_rows), (co[rb],), cx)
        for r, n in GateUp.spans(lay):
            p.add(GateUp(l, r, n), (cx,), cact[r // t.down_k])
        for kc in range(lay.n_down_k):
            for r in range(0, c.d, t.down_rows):
                p.add(Down(l, r, kc), (cact[kc],), cd[r // t.red_rows])
        if tp:
            _all_reduce(p, l, 1, cd, cout, n_rb, t.red_rows)
        elif not fold:
            for rb in range(n_rb):
                p.add(Residual(l, rb * t.red_rows), (cd[rb],), cout)
        prev_out = cd[0] if fold else cout
    return p


def _all_reduce(p: Program, l: int, stage: int, cpart: list[int], cdone: int, n_rb: int, red_rows: int) -> None:
    """Tensor parallel: per row block, TP_PUSH of this rank's partial to the peer (signalling the
    peer's ``recv`` counter) and TP_REDUCE (rank 0 + rank 1 + the residual), pushes first."""
    crecv = [p.counter(f"recv_{'od'[stage]}[{l},{rb}]") for rb in range(n_rb)]
    for rb in range(n_rb):
        p.add(TPPush(l, stage, rb * red_rows), (cpart[rb],), crecv[rb])
    for rb in range(n_rb):
        p.add(TPReduce(l, stage, rb * red_rows), (cpart[rb], crecv[rb]), cdone)


def make_layout(cfg: ModelConfig, max_seq: int, tiling: Tiling | None = None) -> Layout:
    return Layout(cfg, tiling or Tiling.for_config(cfg, max_seq=max_seq), max_seq)
