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
        self.epoch = 1                # the call's epoch (tensor parallel: its parity picks the receive slot)
        self.peer_buf: dict = {}      # tensor parallel: the peer's buffers that WRITES_PEER opcodes write
        # device buffers that persist across calls, as the host wrote them (e.g. SAMPLE's parameters)
        self.state = dict(state or {})
        # the opcodes' build-time tables (e.g. RoPE's cos / sin), by kernel pointer name
        self.tables = {k: v for cls in classes for k, v in cls.tables(lay, "cpu").items()}
        # scratch starts poisoned (NaN; integers: their most negative value), as nothing is read unwritten
        dt = {"fp32": (torch.float32, float("nan")), "bf16": (torch.bfloat16, float("nan")),
              "i32": (torch.int32, -2**31), "i64": (torch.int64, -2**63)}
        self.buf = {name: torch.full((math.prod(shape),), dt[t][1], dtype=dt[t][0])
                    for name, (shape, t) in scratch_buffers(lay, classes).items()}

    def layer_input(self, layer: int) -> torch.Tensor:
        if layer == 0:
            # a decoder's layer 0 reads the row its EMBED tiles gathered (the kernel's x_ptr there)
            return self.buf["x0"] if "x0" in self.buf else self.x
        d = self.lay.cfg.d
        if self.lay.folds_residual:      # RESIDUAL folded into this layer's readers: as it computes it
            n = self.lay.n_down_k
            y = self.buf["x1"][(layer - 1) * d: layer * d].clone()
            dp = self.buf["dpart"].view(self.lay.cfg.layers, n, d)
            for kc in range(n):
                y += dp[layer - 1, kc]
            return y.to(torch.bfloat16)
        return self.buf["xout"][(layer - 1) * d: layer * d]

    def output(self) -> torch.Tensor:
        d, r = self.lay.cfg.d, self.lay.xout_row(self.lay.cfg.layers - 1)
        return self.buf["xout"][r * d:(r + 1) * d].reshape(1, d).clone()


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


def run_tp(tapes: list[Tape], weights: dict, kv_cache: list, x: torch.Tensor, pos: int, seed: int | None = 0,
           calls: int = 1, return_all: bool = False):
    """Run a tensor-parallel step (``compile_model(cfg, ..., tp=2, decoder=False).tapes``) on the CPU:
    both ranks' tapes in one random interleaving (``seed``; None: the lowest ready (rank, SM) first) of
    all 2 x ``num_sms`` SMs, with the cross-rank edges (a ``SIGNALS_PEER`` instruction bumps the peer's
    counter, a ``WRITES_PEER`` one writes the peer's buffers, e.g. TP_PUSH into its ``tp_recv``).

    ``weights`` / ``kv_cache`` are the FULL model's (``cfg`` = the layouts' ``full_cfg``): each rank
    gets its shard (``opcodes.tp.shard_weights`` / ``shard_kv_cache``), and the K/V rows the ranks
    write are copied back into ``kv_cache`` (each rank its KV heads). ``x``: the (1, d) bf16 input.

    ``calls`` > 1 runs that many calls in a row, at positions ``pos, pos + 1, ...``, each call's input
    the previous call's output: counters are never reset (waits are for ``target * epoch``), the
    receive buffers persist and alternate parity slots, and a rank may start its next call as soon as
    its own previous call is done (so one rank can be a call ahead of the other, as on the GPUs).
    Returns the last call's output (1, d) (the ranks' outputs are asserted bitwise equal), or with
    ``return_all`` the list over calls of ``[rank 0's, rank 1's]`` outputs.
    Whole-model tapes (a :class:`opcodes.tp.TPDecoderLayout`): :func:`run_tp_decoder`."""
    if tapes and getattr(tapes[0].lay, "WHOLE_MODEL", False):
        raise ValueError("run_tp: these are whole-model decoder tapes (they embed a token); use run_tp_decoder")
    outputs = _run_tp(tapes, weights, kv_cache, x.reshape(1, -1), pos, seed, calls,
                      finish=lambda st: st.output(), feed=lambda out: out)
    for e, outs in enumerate(outputs):
        _same_residual(e, outs[0], outs[1])
    return outputs if return_all else outputs[-1][0]


def run_tp_decoder(tapes: list[Tape], weights: dict, kv_cache: list, token, pos: int, seed: int | None = 0,
                   calls: int = 1, return_all: bool = False):
    """Run a tensor-parallel whole-model decode step (``compile_model(cfg, ..., tp=2).tapes`` of a config
    with a vocabulary: EMBED, the TP layers, LM_HEAD over each rank's vocabulary slice, TP_ARGMAX_PUSH /
    TP_ARGMAX) on the CPU, as :func:`run_tp` runs the layers: one random interleaving (``seed``) of both
    ranks' SMs, from the FULL ``weights`` (with ``embed``, ``final_norm``, ``lm_head``) and ``kv_cache``,
    sharded here; the K/V rows written are copied back into ``kv_cache``. ``token``: the first call's
    input token (an int).

    ``calls`` > 1 runs calls at ``pos, pos + 1, ...``, each rank's next call embedding the token ITS
    previous call produced (on the GPUs each rank's EMBED reads its own ``tok``); the receive buffers
    (``tp_recv``, ``tp_am_recv``) persist and alternate parity slots. Asserts, per call, that both
    ranks produced the same token and bitwise the same final residual stream.

    Returns ``(logits, token)`` of the last call: ``logits`` the ranks' fp32 logits slices
    ``[rank 0's (1, vocab / 2), rank 1's]`` (rank r's covers vocabulary ids ``[r * vocab / 2,
    (r + 1) * vocab / 2)``), ``token`` the greedy next token (an int); with ``return_all`` the list of
    those pairs over the calls."""
    if not (len(tapes) == 2 and all(getattr(t.lay, "WHOLE_MODEL", False) for t in tapes)):
        raise ValueError("run_tp_decoder takes the 2 ranks' whole-model decoder tapes (opcodes.tp.TPDecoderLayout); "
                         "for the layers alone use run_tp")
    tok = torch.as_tensor(token).reshape(1)

    def finish(st):
        return st.buf["logits"].reshape(1, -1).clone(), int(st.next_token), st.output()

    outputs = _run_tp(tapes, weights, kv_cache, tok, pos, seed, calls, finish=finish,
                      feed=lambda res: torch.tensor([res[1]]))
    out = []
    for e, (r0, r1) in enumerate(outputs):
        _same_residual(e, r0[2], r1[2])
        if r0[1] != r1[1]:
            raise AssertionError(f"call {e}: the ranks' tokens differ ({r0[1]} on rank 0, {r1[1]} on rank 1): the "
                                 "cross-rank argmax is not the same on both ranks")
        out.append(([r0[0], r1[0]], r0[1]))
    return out if return_all else out[-1]


def _same_residual(e: int, a: torch.Tensor, b: torch.Tensor) -> None:
    if not torch.equal(a, b):
        raise AssertionError(f"call {e}: the ranks' outputs differ (max |diff| "
                             f"{(a.float() - b.float()).abs().max():.3e}): the all-reduce is not "
                             "bitwise identical on both ranks")


def _run_tp(tapes: list[Tape], weights: dict, kv_cache: list, inp: torch.Tensor, pos: int, seed: int | None,
            calls: int, finish, feed) -> list[list]:
    """Both ranks' tapes for ``calls`` calls (see :func:`run_tp`): ``inp`` is the first call's input of
    both ranks (VMState.x), ``finish(state)`` a rank's result of a call, ``feed(result)`` its next
    call's input. Returns the results, ``[call][rank]``."""
    from opcodes.tp import shard_kv_cache, shard_weights
    R = len(tapes)
    if R != 2:
        raise ValueError(f"run_tp takes the tapes of 2 ranks, got {R}")
    lays = [t.lay for t in tapes]
    for r, lay in enumerate(lays):
        if getattr(lay, "tp_rank", None) != r or getattr(lay, "tp_size", None) != R:
            raise ValueError(f"tapes[{r}] is not rank {r} of a tensor-parallel compilation (layout "
                             f"{type(lay).__name__})")
    full = lays[0].full_cfg
    if isinstance(calls, bool) or not isinstance(calls, int) or calls < 1:
        raise ValueError(f"calls must be an int >= 1, got {calls!r}")
    if not (0 <= pos and pos + calls <= lays[0].max_seq):
        raise ValueError(f"pos .. pos + calls - 1 must be in [0, {lays[0].max_seq}), got {pos} and calls={calls}")
    shards = [shard_weights(weights, full, r, R) for r in range(R)]
    caches = [shard_kv_cache(kv_cache, full, r, R) for r in range(R)]
    classes = [t.classes() for t in tapes]
    # buffers that persist across calls: those with parity slots (the receive buffers)
    persist = []
    for r in range(R):
        bufs = scratch_buffers(lays[r], classes[r])
        persist.append({n: torch.full((math.prod(bufs[n][0]),), float("nan"), dtype=torch.float32)
                        for cls in classes[r] for n in cls.PARITY_SLOTS})
    rng = random.Random(seed) if seed is not None else None
    counters = [[0] * t.n_counters for t in tapes]
    outputs: list[list] = [[None] * R for _ in range(calls)]

    class Rank:
        def __init__(self, r):
            self.r, self.tape, self.call = r, tapes[r], -1
            self.queues = {s: [] for s in range(self.tape.num_sms)}
            self.pool = []
            for d in decode(self.tape):
                (self.pool if d.sm == Tape.POOL else self.queues[d.sm]).append(d)
            self.start(inp)

        def start(self, xin):
            self.call += 1
            self.st = VMState(lays[self.r], shards[self.r], caches[self.r], xin, pos + self.call, classes[self.r])
            self.st.buf.update(persist[self.r])
            self.st.peer_buf = persist[1 - self.r]
            self.st.epoch = self.call + 1          # the kernel's epoch: 1 for the first call
            self.heads = {s: 0 for s in self.queues}
            self.held, self.ticket, self.remaining = {}, 0, len(self.tape)

        def current(self, s):
            q = self.queues[s]
            if self.heads[s] < len(q):
                return q[self.heads[s]]
            if s not in self.held and self.ticket < len(self.pool):
                self.held[s] = self.pool[self.ticket]
                self.ticket += 1
            return self.held.get(s)

    ranks = [Rank(r) for r in range(R)]
    while any(k.call < calls for k in ranks):
        ready, stuck = [], []
        for k in ranks:
            if k.call >= calls:
                continue
            for s in k.queues:
                d = k.current(s)
                if d is None:
                    continue
                if all(counters[k.r][c] >= t * k.st.epoch for c, t in d.waits):
                    ready.append((k, s, d))
                else:
                    stuck.append((k, d))
        if not ready:
            raise DeadlockError("VM deadlock across ranks: " + "; ".join(
                f"rank {k.r} call {k.call} {k.tape.describe(d.slot)} waits on "
                f"{[(k.tape.counters[c], counters[k.r][c], t * k.st.epoch) for c, t in d.waits]}"
                for k, d in stuck[:4]))
        k, s, d = rng.choice(ready) if rng is not None else ready[0]
        d.ins.run_torch(k.tape.lay, k.st)
        if d.signal >= 0:
            counters[1 - k.r if type(d.ins).SIGNALS_PEER else k.r][d.signal] += 1
        if k.heads[s] < len(k.queues[s]):
            k.heads[s] += 1
        else:
            del k.held[s]
        k.remaining -= 1
        if k.remaining == 0:                       # the rank's call is done: the next may start
            res = finish(k.st)
            outputs[k.call][k.r] = res
            if k.call + 1 < calls:
                k.start(feed(res))
            else:
                k.call += 1
    # the K/V rows the ranks wrote, back into the full caches (each rank its KV heads)
    for r in range(R):
        a = r * full.n_kv // R
        b = a + full.n_kv // R
        for l, (kc, vc) in enumerate(caches[r]):
            kv_cache[l][0][:, a:b, pos:pos + calls] = kc[:, :, pos:pos + calls]
            kv_cache[l][1][:, a:b, pos:pos + calls] = vc[:, :, pos:pos + calls]
    return outputs
