"""One call from a config to a verified tape: lower -> schedule -> encode -> verify."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from opcodes import Layout, ModelConfig, Tiling

from .assign import CostModel, Schedule, list_schedule, random_schedule, round_robin, simulate, with_pool
from .fluid import FluidModel, expected_makespan
from .program import Program, lower
from .tape import Tape, encode
from .verify import Report, verify, verify_tp

POLICIES = ("cost", "round-robin")
#: microseconds of the plan's tail taken by ticket at run time (the 70B layer on the H200: 60 us measured
#: 425.7 us against 431.8 for static queues; 30 / 120 / 250 us: 427.3 / 426.3 / 428.1)
DEFAULT_POOL_US = 60.0


@dataclass
class Compiled:
    prog: Program
    sched: Schedule
    tape: Tape
    report: Report
    model: CostModel
    seconds: float
    _expected: dict = field(default_factory=dict, repr=False)      # draws -> seconds

    def expected_makespan(self, draws: int | None = None) -> float:
        """Seconds the H200 shared-bandwidth model (:meth:`FluidModel.h200` for this tiling, with
        its run-to-run jitter and ticket cost) expects this schedule to take: the mean of ``draws``
        deterministic noisy draws (default 3, 1 above 20000 instructions); computed once per
        ``draws``."""
        if draws is None:
            draws = 3 if len(self.prog) <= 20000 else 1
        if draws not in self._expected:
            self._expected[draws] = expected_makespan(self.sched, FluidModel.h200(self.prog.lay), draws)
        return self._expected[draws]

    @staticmethod
    def expected_lower_bound(prog: Program) -> float:
        """Bytes over the chip bandwidth of :meth:`FluidModel.h200`: no schedule beats it there."""
        return FluidModel.h200().lower_bound(prog)


def default_max_seq(cfg: ModelConfig) -> int:
    """The KV cache length a tape is compiled for when none is given: 4224 for d >= 1024, else 256."""
    return 4224 if cfg.d >= 1024 else 256


def compile_model(cfg: ModelConfig, num_sms: int, max_seq: int | None = None, tiling: Tiling | None = None,
                  policy: str = "cost", model: CostModel | None = None, seed: int = 0,
                  sequential: bool = False, lowering=None, pool_us: float | None = None,
                  decoder: bool | None = None, elide_waits: bool = True, tp: int | None = None):
    """Compile ``cfg`` for ``num_sms`` SMs. ``policy``: 'cost' (list scheduling), 'round-robin' or
    'random' (a random valid schedule drawn with ``seed``).
    ``lowering``: a function Layout -> Program to use instead of :func:`lower` (e.g. a whole decoder
    around the layers); when given it wins over ``decoder``.
    ``elide_waits``: drop the waits an earlier instruction of the same SM already made
    (:meth:`Tape.elide_repeated_waits`; the default: on the H200 the 1B decoder
    1146.6 -> 1096.6 us, the 70B layer 427.9 -> 424.6 us).
    ``decoder``: True for the whole-model lowering of :mod:`schedule.decoder_program` (embedding,
    the layers, final norm, LM head, argmax; needs ``cfg.vocab``), False for the layers alone, None
    (default): the whole model iff ``cfg.vocab > 0``.
    ``pool_us``: the last ``pool_us`` microseconds of the plan go to a pool that SMs take from at
    run time as they finish their queues (:func:`schedule.assign.with_pool`); 0: queues only;
    None: :data:`DEFAULT_POOL_US` for 'cost', 0 for the round-robin and random baselines.
    ``tp``: None or 1: one GPU (a :class:`Compiled`); 2: tensor parallel over two GPUs, a
    :class:`CompiledTP` with one tape per rank (``.tapes``), each of the rank's
    :class:`opcodes.tp.TPLayout` (``cfg`` is the full model's), every rank's tape verified alone and both
    together (:func:`schedule.verify.verify_tp`); ``decoder`` as for one GPU: the whole model (the rank's
    :class:`opcodes.tp.TPDecoderLayout`: EMBED, the TP layers, LM_HEAD over the rank's vocabulary slice,
    the cross-rank argmax TP_ARGMAX_PUSH / TP_ARGMAX) iff ``cfg.vocab > 0`` unless given."""
    if tp not in (None, 1):
        return _compile_tp(cfg, num_sms, max_seq, tiling, policy, model, seed, sequential, lowering, pool_us,
                           decoder, elide_waits, tp)
    if lowering is None and (cfg.vocab > 0 if decoder is None else decoder):
        from .decoder_program import decoder_lowering
        lowering = decoder_lowering()
    t0 = time.perf_counter()
    if max_seq is None:
        max_seq = default_max_seq(cfg)
    lay = Layout(cfg, tiling or Tiling.for_config(cfg, max_seq=max_seq), max_seq)
    return _compile_layout(lay, num_sms, policy, model, seed, sequential, lowering, pool_us, elide_waits, t0)


def _best_list_schedule(prog, num_sms: int, queue_model: CostModel, model: CostModel) -> Schedule:
    """List scheduling under ``queue_model``, with and without backfilling (``list_schedule``), timed under
    ``model``: the backfilled plan where it is shorter, else the plain one (so a tape the plain plan already
    runs well keeps its queues: of the benches' tapes only the 1024-row buckets' differ with backfilling, and only
    the 8B's is shorter, 31.6 -> 29.9 ms planned; bench/notes/s51.md v188)."""
    plain = simulate(list_schedule(prog, num_sms, queue_model), model)
    filled = simulate(list_schedule(prog, num_sms, queue_model, backfill=True), model)
    return filled if filled.makespan < plain.makespan else plain


def _compile_layout(lay: Layout, num_sms: int, policy: str, model: CostModel | None, seed: int, sequential: bool,
                    lowering, pool_us: float | None, elide_waits: bool, t0: float) -> Compiled:
    if pool_us is None:
        pool_us = DEFAULT_POOL_US if policy == "cost" else 0.0
    if isinstance(pool_us, bool) or not isinstance(pool_us, (int, float)) or not pool_us >= 0:
        raise ValueError(f"pool_us must be a number >= 0 (microseconds), got {pool_us!r}")
    prog = (lowering or lower)(lay)
    if policy == "cost":
        if model is None:
            # NOTE: queues from the bytes-only model (the schedule every H200 measurement of the
            # default build used: it measured as fast as or faster than scheduling with the
            # round-trip attention model), times predicted with the
            # H200-calibrated model (attention by round trips), which is within ~6% of them.
            model = CostModel()
            sched = _best_list_schedule(prog, num_sms, CostModel.bytes_only(), model)
        else:
            sched = _best_list_schedule(prog, num_sms, model, model)
    elif policy == "round-robin":
        model = model or CostModel()
        sched = simulate(round_robin(prog, num_sms), model)
    elif policy == "random":
        model = model or CostModel()
        sched = simulate(random_schedule(prog, num_sms, seed), model)
    else:
        raise ValueError(f"policy must be one of {POLICIES + ('random',)}, got {policy!r}")
    sched = with_pool(sched, model, pool_us * 1e-6)
    tape = encode(sched)
    if elide_waits:
        tape = tape.elide_repeated_waits()
    report = verify(tape, prog, sequential=sequential)
    return Compiled(prog, sched, tape, report, model, time.perf_counter() - t0)


@dataclass
class CompiledTP:
    """A tensor-parallel compilation: ``ranks[r]`` rank r's :class:`Compiled` (its program, schedule,
    tape and per-rank report), ``report`` the cross-rank verification of both tapes together."""

    ranks: list[Compiled]
    report: Report
    seconds: float

    @property
    def tapes(self) -> list[Tape]:
        return [c.tape for c in self.ranks]


def _compile_tp(cfg, num_sms, max_seq, tiling, policy, model, seed, sequential, lowering, pool_us, decoder,
                elide_waits, tp) -> CompiledTP:
    from opcodes.tp import TPLayout, shard_config
    if isinstance(tp, bool) or tp != 2:
        raise ValueError(f"tp must be None, 1 or 2 (tensor-parallel tapes exist for two ranks), got {tp!r}")
    if lowering is None and (cfg.vocab > 0 if decoder is None else decoder):
        from .decoder_program import decoder_lowering
        lowering = decoder_lowering()
    t0 = time.perf_counter()
    if max_seq is None:
        max_seq = default_max_seq(cfg)
    sc = shard_config(cfg, 0, tp)
    tiling = tiling or TPLayout.default_tiling(sc)
    ranks = [_compile_layout(TPLayout(shard_config(cfg, r, tp), tiling, max_seq, r, tp), num_sms, policy, model,
                             seed, sequential, lowering, pool_us, elide_waits, time.perf_counter())
             for r in range(tp)]
    report = verify_tp([c.tape for c in ranks])
    return CompiledTP(ranks, report, time.perf_counter() - t0)
