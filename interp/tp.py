"""Tensor-parallel runtime (2 ranks): one persistent kernel per rank, each walking its rank's tape
(``schedule.compile_model(cfg, num_sms, tp=2).tapes``), the ranks joined by TP_PUSH / TP_REDUCE (the
all-reduce of the O and down partials) and TP_ARGMAX_PUSH / TP_ARGMAX (the cross-rank greedy token).

    hs = build_tp_layers(rank_weights, rank_kv, cfg, max_seq_len)      # the layers alone
    outs = tp_layer_step(hs, x, pos)           # [rank 0's (1, d) output, rank 1's]: bitwise equal
    hd = build_tp_decoder(rank_weights, rank_kv, cfg, max_seq_len)     # the whole model
    logits = tp_decode_step(hd, token, pos)    # (1, vocab) fp32: the ranks' slices; next token: tokens(hd)
    new = tp_generate(hd, prompt, n_new)       # greedy
    tp_teardown(h)

``rank_weights[r]`` / ``rank_kv[r]``: rank r's shard (``opcodes.tp.shard_weights`` /
``shard_kv_cache`` of the full model, or ``interp.hf.load_hf_llama(..., tp_rank=r, tp_size=2)``);
``cfg`` the FULL model's config.

What makes a kernel tensor-parallel (``interp/codegen.py``, only in kernels of tapes that hold a
``SIGNALS_PEER`` opcode; single-GPU kernels are unchanged): the pointers into the peer's memory in
the address table (``PEER_POINTERS`` of the opcodes: the peer's ``tp_recv`` / ``tp_am_recv``; and
``peer_cnt_ptr``, the peer's counters), a ``SIGNALS_PEER`` instruction's signal on the peer's
counter (system-scope release), and waits on the counters the peer signals (``peer_sig_ptr``)
accepting a count past this call's target: the peer may be a call ahead
(``schedule.verify``: why two parity slots suffice). Such waits stay bounded (``spin_limit`` polls) and a
timeout raises :class:`interp.runtime.MegakernelError` naming the rank and the counter.

Where the ranks run:

* the CPU loopback (what exists and is tested): both ranks in this process under the Triton
  interpreter, each rank's launch in its own Python thread (both must run at once: each waits on
  counters the other signals), each rank's peer pointers the other rank's CPU tensors. The
  interpreter's launch (``triton.runtime.interpreter.GridExecutor``) patches ``triton.language``
  for the launch and restores it when that launch ends: two launches in two threads would unpatch
  each other (the second one to finish then runs unpatched: "Did you forget to add @triton.jit"),
  so :func:`_interpreter_launch_all` patches once around both threads. Its grid index is one global,
  so each rank is one program (``num_sms = 1``, a sequential tape), as every CPU tape is.
* two GPUs, one process per GPU (built, NOT yet run on a GPU): each process builds ITS rank with
  ``build_tp_layers(weights, kv, cfg, max_seq_len, tp_group=g)`` / ``build_tp_decoder(...,
  tp_group=g)`` (or ``interp.decoder.build_decoder(..., tp_group=g)``), ``weights`` / ``kv`` its own
  shard, ``g`` a ``torch.distributed`` group of the two ranks (NCCL or gloo), and gets a
  :class:`TPRankHandle`. The buffers the peer writes (the counters, ``tp_recv``, ``tp_am_recv``)
  are one allocation of PyTorch symmetric memory per rank (``torch.distributed._symmetric_memory``:
  ``empty`` + ``rendezvous``; the peer's is mapped into this GPU with ``get_buffer``); no multicast
  is used (set ``TORCH_SYMM_MEM_DISABLE_MULTICAST=1`` and ``NCCL_NVLS_ENABLE=0``). The steps
  (``tp_layer_step``, ``tp_decode_step``, ``tp_generate``) are collective: both processes call them;
  a host barrier (a gloo group, ``host_group``, with a timeout) precedes each launch and the ranks
  exchange their status after it, so a failure on either rank raises :class:`MegakernelError` on
  both and both reset their counters before either launches again. ``tp_launch`` / ``tp_check``
  are the unchecked launch and the collective check for timing loops. See bench/tp_bench.py.

Every wait of a tensor-parallel kernel is bounded in time as well as in polls: ``wait_s`` seconds
from its first unmet poll (``interp.sync.clock_ns``: the GPU's globaltimer; the host's clock under
the interpreter), :data:`DEFAULT_TP_WAIT_S` on GPUs; a rank whose peer never launches or died
raises within seconds, naming the counter (``set_wait`` changes the bound of a built handle).

The counters are never reset by the device in a tensor-parallel kernel (a rank zeroing its counters
after ``epoch_limit`` calls could lose a signal of a peer that is a call ahead): the host refuses a
step past that many calls (millions for small tapes); rebuild to go on. A failed step resets both
ranks' counters, status and call count together.
"""
from __future__ import annotations

import datetime
import hashlib
import inspect
import threading
from dataclasses import dataclass, field

import torch

from opcodes import ModelConfig
from opcodes.tp import TPDecoderLayout, TPLayout, check_tp, shard_config
from schedule import compile_model
from schedule.verify import verify_tp

from . import runtime
from .common import (TORCH_DTYPES, arg_error, check_model_tensors, check_open, check_pos, check_spin_limit,
                     check_step_args, describe, device_sms, epoch_limit, interpreter_mode, kernel_args, parse_cfg,
                     validate_inputs)
from .runtime import LayerHandle, MegakernelError

#: polls before a wait gives up in the CPU loopback: both ranks share one interpreter (the GIL), so
#: a wait may poll while its peer interprets a whole stage (seconds); a poll is ~0.1-0.5 ms of
#: interpreted Python, so a peer that never signals is reported after some 10-30 s
INTERPRETER_TP_SPIN_LIMIT = 1 << 16
#: the time bound of every wait of a tensor-parallel kernel (seconds, from its first unmet poll): on
#: GPUs, and in the CPU loopback (where the poll bound above decides)
DEFAULT_TP_WAIT_S = 5.0
INTERPRETER_TP_WAIT_S = 600.0
#: polls before a wait gives up on GPUs: a backstop behind the time bound (2^26 polls: ~10-60 s)
GPU_TP_SPIN_LIMIT = 1 << 26
#: host-side collectives of the per-rank runtime (barriers, status exchange) give up after this
HOST_TIMEOUT_S = 120.0
_INT32_MAX = 2**31 - 1
_LAUNCH_LOCK = threading.Lock()       # one loopback step at a time in this process
_REWRITE_LOCK = threading.Lock()      # the interpreter's rewrite of a device function, one at a time


@dataclass
class TPHandle:
    """Both ranks of a tensor-parallel build: ``ranks[r]`` is rank r's kernel handle (its tape,
    counters, buffers, with the peer pointers bound to the other rank's buffers)."""

    ranks: list                     # [LayerHandle, LayerHandle]
    cfg: ModelConfig                # the full model's config
    loopback: bool                  # both ranks in this process under the Triton interpreter (CPU)
    epoch_limit: int                # calls before the counters would overflow int32 (the host refuses)
    calls: int = 0
    decoder: bool = False
    # the whole-model decoder, per rank: the token the next launch embeds, the predicted tokens, the
    # embedded row (x_ptr), the last layer's output (out_ptr), the rank's logits slice
    tok: list = field(default_factory=list, repr=False)
    toks: list = field(default_factory=list, repr=False)
    x0: list = field(default_factory=list, repr=False)
    hidden: list = field(default_factory=list, repr=False)
    logits: list = field(default_factory=list, repr=False)
    closed: bool = False

    @property
    def tapes(self):
        return [h.tape for h in self.ranks]

    @property
    def max_seq(self) -> int:
        return self.ranks[0].lay.max_seq


# ---- build -----------------------------------------------------------------------------------------
def _check_ranks(rank_weights, rank_kv, full: ModelConfig) -> None:
    """Both ranks' shards and caches are lists of two (the CPU loopback), each shard of its rank."""
    check_tp(full, 0, 2)
    for name, v in (("rank_weights", rank_weights), ("rank_kv", rank_kv)):
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise arg_error(TypeError, name, "a list of the 2 ranks' shards", describe(v))
    for r, w in enumerate(rank_weights):
        _check_shard(f"rank_weights[{r}]", w, r)


def _check_shard(arg: str, w, r: int) -> None:
    """``w`` (the argument ``arg``) is a shard of rank ``r`` of 2: a dict of its layers
    (``opcodes.tp.shard_weights``), whose ``tp`` entry, if any, names that rank."""
    if not isinstance(w, dict) or not isinstance(w.get("layers"), (list, tuple)) or not w["layers"]:
        raise arg_error(TypeError, arg, f"rank {r}'s shard: a dict with key 'layers' (opcodes.tp.shard_weights)",
                        describe(w))
    tp = w.get("tp")
    if tp is not None and (tp.get("rank"), tp.get("size")) != (r, 2):
        raise arg_error(ValueError, arg, f"the shard of rank {r} of 2 (weights['tp'])", tp)


def _check_rank_inputs(arg: str, weights, kv, full: ModelConfig, r: int, max_seq_len: int,
                       decoder: bool) -> torch.device:
    """Rank r's shard and cache (``arg``: how the caller names the shard), checked as ``build_layer``
    checks its inputs, against the shard's config; with ``decoder`` the whole-model tensors too (the
    replicated ``embed`` and ``final_norm``, the rank's ``lm_head`` slice). Returns their device."""
    device = validate_inputs(weights, kv, shard_config(full, r, 2), max_seq_len)
    if decoder:
        shapes = {"embed": (full.vocab, full.d), "final_norm": (full.d,), "lm_head": (full.vocab // 2, full.d)}
        check_model_tensors(arg, weights, shapes, kv, device)
    return device


def _build_rank(weights, kv, device: torch.device, tape, spin_limit, sync_check, wait_ns: int, place=None,
                profile: bool = False) -> LayerHandle:
    """The kernel handle of a rank's ``tape`` (its shard and cache checked on ``device``:
    :func:`_check_rank_inputs`): ``build_layer``'s steps for a given TP tape (the peer pointers are
    placeholders until :func:`wire_peer`). ``place(h)``, if given, runs before the kernel is compiled:
    it may move the buffers the peer writes (:func:`_peer_written`) elsewhere (symmetric memory)."""
    cfg = tape.lay.cfg                  # the rank's shard config (_check_tapes: of the model given)
    if device.type == "cpu" and tape.num_sms != 1:
        raise ValueError("num_sms: the CPU loopback runs each rank as one program (the Triton interpreter), "
                         f"got a tape of {tape.num_sms} SMs")
    b = runtime.bind_buffers(tape, weights, kv, device)
    h = LayerHandle(cfg=cfg, lay=tape.lay, tape=tape, device=device, num_sms=tape.num_sms, spin_limit=spin_limit,
                    sync_check=(device.type == "cpu") if sync_check is None else bool(sync_check),
                    weights=weights, kv_cache=kv, bindings=b)
    runtime.make_control(h, profile)
    h.qoff_dev[-1] = _INT32_MAX         # no device-side counter reset (module docstring)
    _set_wait_ns(h, wait_ns)
    if place is not None:
        place(h)
    runtime.compile_kernel(h, profile, True)
    return h


def _set_wait_ns(k: LayerHandle, wait_ns: int) -> None:
    k.buffers["tp_wait_ptr"].fill_(int(wait_ns))
    k.wait_ns = int(wait_ns)


def _wait_ns(wait_s) -> int:
    if isinstance(wait_s, bool) or not isinstance(wait_s, (int, float)) or not 0 < wait_s <= 3600:
        raise arg_error(ValueError, "wait_s", "a number of seconds in (0, 3600]", wait_s)
    return int(wait_s * 1e9)


def set_wait(h, wait_s: float) -> None:
    """Set the time bound of every wait of the handle's kernel(s) (seconds; a device write, so it
    holds from the next launch on)."""
    ns = _wait_ns(wait_s)
    for k in (h.ranks if isinstance(h, TPHandle) else [h.layer]):
        _set_wait_ns(k, ns)


def _peer_written(h: LayerHandle) -> dict:
    """The buffers of rank ``h`` its peer's kernel writes or signals: buffer name -> (tensor, the
    pointer names of the PEER's kernel that point at it). ``counters``: its counters."""
    out = {"counters": (h.counters, ["peer_cnt_ptr"])}
    for cls in h.tape.classes():
        for p, buf in cls.PEER_POINTERS.items():
            t = h.scratch[buf] if buf in h.scratch else h.state[buf]
            if buf in out:
                out[buf][1].append(p)
            else:
                out[buf] = (t, [p])
    return out


def _peer_tensors(h: LayerHandle, device: torch.device) -> dict:
    """The tensors of rank ``h`` that its peer's kernel writes or signals (kernel pointer name of the
    PEER's kernel -> tensor), as the peer on ``device`` addresses them. The CPU loopback: ``h``'s own
    tensors. (Two GPUs: each process holds one rank and maps its peer's buffers from symmetric
    memory, :func:`_place_symmetric`.)"""
    out = {p: t for t, ps in _peer_written(h).values() for p in ps}
    if device.type == "cpu" and h.device.type == "cpu":
        return out
    raise NotImplementedError(
        "tensor parallelism over two GPUs runs one rank per process: build each rank with "
        "build_tp_layers / build_tp_decoder(..., tp_group=...) (both ranks in one call is the CPU loopback only)")


def wire_peer(h: LayerHandle, peer: dict) -> None:
    """Bind ``h``'s pointers into the peer's memory (``runtime.peer_pointers``) to ``peer``'s tensors
    (pointer name -> tensor, addressable from ``h``'s device) and rewrite its address table in place."""
    from opcodes import kernel_pointers
    b = h.bindings
    types = kernel_pointers(h.lay, h.tape.classes())
    for name in runtime.peer_pointers(h.tape.classes()):
        t = peer.get(name)
        if t is None:
            raise ValueError(f"{name}: the peer provides no buffer for it")
        if t.dtype != TORCH_DTYPES[types[name]]:
            raise TypeError(f"{name}: the kernel reads {types[name]}, the peer's buffer is {t.dtype}")
        b.pointers[name] = t
    b.table.copy_(torch.tensor([t.data_ptr() for t in b.pointers.values()], dtype=torch.int64))


def _compile_tp(full: ModelConfig, max_seq_len, device, num_sms, tiling, policy, seed, pool_us, elide_waits,
                lowering, decoder: bool):
    if num_sms is None:
        num_sms = device_sms(device)
    c = compile_model(full, num_sms, max_seq=max_seq_len, tiling=tiling, policy=policy, seed=seed,
                      sequential=(device.type == "cpu"), lowering=lowering, pool_us=pool_us, decoder=decoder,
                      elide_waits=elide_waits, tp=2)
    return c.tapes


def _check_tapes(tapes, full: ModelConfig, max_seq_len: int, decoder: bool) -> None:
    """Both ranks' tapes are of the kind asked for (layers or whole model), for ``full`` and
    ``max_seq_len``."""
    want = TPDecoderLayout if decoder else TPLayout
    for r, t in enumerate(tapes):
        if not isinstance(t.lay, want) or (decoder != isinstance(t.lay, TPDecoderLayout)):
            raise arg_error(ValueError, f"tapes[{r}]", f"a {want.__name__} tape", type(t.lay).__name__)
        if t.lay.full_cfg.to_dict() != full.to_dict() or t.lay.max_seq != max_seq_len:
            raise ValueError(f"tapes[{r}]: compiled for a different cfg or max_seq_len than the one given")


def _build(rank_weights, rank_kv, full: ModelConfig, max_seq_len, tapes, num_sms, tiling, policy, seed, pool_us,
           elide_waits, spin_limit, sync_check, lowering, decoder, wait_s=None) -> TPHandle:
    """Both ranks in this process (the CPU loopback) of the model ``full`` (parsed once by the caller)."""
    _check_ranks(rank_weights, rank_kv, full)
    devices = [_check_rank_inputs(f"rank_weights[{r}]", rank_weights[r], rank_kv[r], full, r, max_seq_len, decoder)
               for r in range(2)]
    device = devices[0]
    loopback = device.type == "cpu"
    if devices[1] != device and loopback:
        raise ValueError("rank_weights: the CPU loopback needs both ranks' tensors on the CPU")
    if spin_limit is None:
        spin_limit = INTERPRETER_TP_SPIN_LIMIT if loopback else GPU_TP_SPIN_LIMIT
    check_spin_limit(spin_limit)
    wait_ns = _wait_ns(wait_s if wait_s is not None else INTERPRETER_TP_WAIT_S if loopback else DEFAULT_TP_WAIT_S)
    if tapes is None:
        tapes = _compile_tp(full, max_seq_len, device, num_sms, tiling, policy, seed, pool_us, elide_waits, lowering,
                            decoder)
    elif not isinstance(tapes, _Verified):
        verify_tp(list(tapes))
    _check_tapes(tapes, full, max_seq_len, decoder)
    hs = []
    try:
        for r in range(2):
            hs.append(_build_rank(rank_weights[r], rank_kv[r], devices[r], tapes[r], spin_limit, sync_check, wait_ns))
        for r in range(2):
            wire_peer(hs[r], _peer_tensors(hs[1 - r], hs[r].device))
    except BaseException:
        for h in hs:
            runtime.teardown(h)
        raise
    return TPHandle(ranks=hs, cfg=full, loopback=loopback, epoch_limit=epoch_limit(tapes), decoder=decoder)


def build_tp_layers(rank_weights, rank_kv, cfg, max_seq_len, *, num_sms: int | None = None, tiling=None,
                    policy: str = "cost", tapes=None, seed: int = 0, pool_us: float | None = None,
                    elide_waits: bool = True, spin_limit: int | None = None, sync_check: bool | None = None,
                    wait_s: float | None = None, tp_group=None, host_group=None, verify_tapes: bool = True):
    """Prepare the layers of the full model ``cfg`` as 2 ranks for :func:`tp_layer_step`. Untimed.

    rank_weights : [rank 0's, rank 1's] ``{"layers": [...]}`` shards (``opcodes.tp.shard_weights``)
    rank_kv      : [rank 0's, rank 1's] KV caches (``opcodes.tp.shard_kv_cache``), written in place
    ``tapes``: both ranks' precompiled tapes (verified with ``verify_tp`` unless ``verify_tapes=False``:
    tapes ``compile_model`` made were verified there); otherwise compiled here
    (``compile_model(cfg, num_sms, tp=2, decoder=False)``; on the CPU one SM per rank, sequential).
    ``spin_limit``: polls before a wait gives up (default: :data:`INTERPRETER_TP_SPIN_LIMIT` on the CPU,
    :data:`GPU_TP_SPIN_LIMIT` on GPUs); ``wait_s``: every wait's time bound in seconds (default
    :data:`DEFAULT_TP_WAIT_S` on GPUs).

    ``tp_group`` (a ``torch.distributed`` group of 2 processes): build THIS process's rank only, on
    its GPU: ``rank_weights`` / ``rank_kv`` are then this rank's shard and cache (not lists of both),
    the rank is ``tp_group``'s; returns a :class:`TPRankHandle`. Collective: both processes call it.
    ``host_group``: a gloo group of the same two processes for the host-side barriers and status
    exchanges (made here with ``dist.new_group`` if not given, which every process of the default
    group must then call too).
    """
    full = parse_cfg(cfg)
    if tp_group is not None:
        return _build_rank_gpu(rank_weights, rank_kv, full, max_seq_len, tp_group, host_group, tapes, num_sms, tiling,
                               policy, seed, pool_us, elide_waits, spin_limit, sync_check, wait_s, None, False,
                               verify_tapes)
    if host_group is not None:
        raise ValueError("host_group: only with tp_group (one rank per process)")
    return _build(rank_weights, rank_kv, full, max_seq_len, _verified(tapes, verify_tapes), num_sms,
                  tiling, policy, seed, pool_us, elide_waits, spin_limit, sync_check, None, False, wait_s)


def build_tp_decoder(rank_weights, rank_kv, cfg, max_seq_len, *, lm_rows: int = 0, emb_cols: int = 0,
                     num_sms: int | None = None, tiling=None, policy: str = "cost", tapes=None, seed: int = 0,
                     pool_us: float | None = None, elide_waits: bool = True, spin_limit: int | None = None,
                     sync_check: bool | None = None, wait_s: float | None = None, tp_group=None, host_group=None,
                     verify_tapes: bool = True, profile: bool = False):
    """Prepare the whole model ``cfg`` (with ``vocab``) as 2 ranks for :func:`tp_decode_step` /
    :func:`tp_generate` (greedy: the tapes end in TP_ARGMAX_PUSH / TP_ARGMAX). ``rank_weights[r]``:
    rank r's shard with ``embed``, ``final_norm`` (replicated) and its ``lm_head`` slice
    (``(vocab / 2, d)``). Options as :func:`build_tp_layers` (``tp_group``: this process's rank only,
    ``rank_weights`` its shard), ``lm_rows`` / ``emb_cols`` as ``interp.decoder.build_decoder``'s.
    ``profile``: the profiling kernel (``interp.runtime.profile_records(h.layer)`` after a step; GPUs,
    one rank per process, only)."""
    from schedule.decoder_program import decoder_lowering
    full = parse_cfg(cfg, decoder=True)
    if profile and tp_group is None:
        raise arg_error(ValueError, "profile", "False without tp_group (profile records come from a GPU, one rank per "
                        "process)", profile)
    if tp_group is not None:
        return _build_rank_gpu(rank_weights, rank_kv, full, max_seq_len, tp_group, host_group, tapes, num_sms, tiling,
                               policy, seed, pool_us, elide_waits, spin_limit, sync_check, wait_s,
                               decoder_lowering(lm_rows, emb_cols), True, verify_tapes, bool(profile))
    if host_group is not None:
        raise ValueError("host_group: only with tp_group (one rank per process)")
    h = _build(rank_weights, rank_kv, full, max_seq_len, _verified(tapes, verify_tapes), num_sms, tiling,
               policy, seed, pool_us, elide_waits, spin_limit, sync_check, decoder_lowering(lm_rows, emb_cols), True,
               wait_s)
    for k in h.ranks:
        h.tok.append(k.state["tok"])
        h.toks.append(k.state["toks"])
        h.x0.append(k.scratch["x0"].view(1, full.d))
        h.hidden.append(torch.empty(1, full.d, dtype=torch.bfloat16, device=k.device))
        h.logits.append(k.scratch["logits"].view(1, -1))
    return h


class _Verified(list):
    """Tapes the caller has verified (``verify_tapes=False``): :func:`_build` skips ``verify_tp``."""


def _verified(tapes, verify_tapes: bool):
    return _Verified(tapes) if tapes is not None and not verify_tapes else tapes


# ---- one rank per process (two GPUs) ------------------------------------------------------------
@dataclass
class TPRankHandle:
    """This process's rank of a tensor-parallel build on GPUs (``build_tp_* (..., tp_group=g)``):
    ``layer`` its kernel handle (its counters, ``tp_recv`` and ``tp_am_recv`` in symmetric memory,
    its peer pointers bound to the peer's, mapped into this GPU). Steps are collective."""

    layer: LayerHandle
    cfg: ModelConfig                # the full model's config
    rank: int
    group: object                   # the torch.distributed group of the two ranks (symmetric memory)
    host_group: object              # a gloo group of the same ranks (barriers, status exchanges)
    epoch_limit: int
    symm: tuple = field(default=(), repr=False)     # (the symmetric allocation, its handle, the peer's views)
    calls: int = 0
    decoder: bool = False
    tok: torch.Tensor = field(default=None, repr=False)
    toks: torch.Tensor = field(default=None, repr=False)
    x0: torch.Tensor = field(default=None, repr=False)
    hidden: torch.Tensor = field(default=None, repr=False)
    logits: torch.Tensor = field(default=None, repr=False)     # this rank's slice (1, vocab / 2) fp32
    closed: bool = False

    @property
    def tape(self):
        return self.layer.tape

    @property
    def device(self) -> torch.device:
        return self.layer.device

    @property
    def max_seq(self) -> int:
        return self.layer.lay.max_seq


def _dist():
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("tp_group: torch.distributed is not initialised (dist.init_process_group first)")
    return dist


def make_host_group(tp_group, timeout_s: float = HOST_TIMEOUT_S):
    """A gloo group of ``tp_group``'s processes for the host-side barriers and status exchanges (a
    collective of the default group: every process of it must call this, in the same order)."""
    dist = _dist()
    return dist.new_group(ranks=dist.get_process_group_ranks(tp_group), backend="gloo",
                          timeout=datetime.timedelta(seconds=timeout_s))


def _gather(hg, obj) -> list:
    dist = _dist()
    out = [None] * dist.get_world_size(hg)
    dist.all_gather_object(out, obj, group=hg)
    return out


def _agree(hg, obj, what: str) -> None:
    got = _gather(hg, obj)
    if any(g != got[0] for g in got):
        raise ValueError(f"the ranks disagree on {what}: " + "; ".join(f"rank {r}: {g!r}"[:300] for r, g in enumerate(got)))


def _barrier(hg) -> None:
    dist = _dist()
    try:
        dist.monitored_barrier(group=hg, timeout=datetime.timedelta(seconds=HOST_TIMEOUT_S))
    except (AttributeError, NotImplementedError):        # a host group that is not gloo
        dist.barrier(group=hg)


def _tape_digest(tapes) -> str:
    hs = hashlib.sha256()
    for t in tapes:
        hs.update(t.words.contiguous().numpy().tobytes())
        hs.update(t.offsets.contiguous().numpy().tobytes())
        hs.update(repr(t.lay).encode())
    return hs.hexdigest()[:24]


def _rendezvous(t: torch.Tensor, group):
    """``symm_mem.rendezvous`` by group name (every torch with symmetric memory takes a name); a
    torch that needs the group enabled first (``enable_symm_mem_for_group``, deprecated later) gets it."""
    import warnings

    import torch.distributed._symmetric_memory as symm_mem
    name = group.group_name
    try:
        return symm_mem.rendezvous(t, name)
    except RuntimeError as e:
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is None or "group" not in str(e).lower():
            raise
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            enable(name)
        return symm_mem.rendezvous(t, name)


def _symm_mem_alloc(total: int, device: torch.device, rank: int, group, hg) -> tuple:
    """(this rank's symmetric allocation of ``total`` bytes, the peer's mapped into this GPU, what
    keeps them alive): ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous`` by group
    name + ``get_buffer``). Collective. No multicast object is asked for or used."""
    import torch.distributed._symmetric_memory as symm_mem
    raw = symm_mem.empty(total, dtype=torch.uint8, device=device)
    hdl = _rendezvous(raw, group)
    peer_raw = hdl.get_buffer(1 - rank, [total], torch.uint8)
    return raw, peer_raw, hdl


#: how :func:`_place_symmetric` allocates (tests substitute shared files for a CPU rehearsal of the
#: per-process path under the interpreter: tests/test_tp_bench.py)
_SYMMETRIC_ALLOC = _symm_mem_alloc


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _place_symmetric(h: LayerHandle, rank: int, group, hg) -> tuple:
    """Move the buffers of ``h`` its peer writes (:func:`_peer_written`) into one symmetric-memory
    allocation of this rank (zeroed) and map the peer's: returns (the allocation, what keeps it and
    the mapping alive, the peer's tensors by the pointer names of this rank's kernel). Collective."""
    items = _peer_written(h)
    layout, off = [], 0
    for name, (t, ptrs) in items.items():
        nbytes = t.numel() * t.element_size()
        layout.append((name, off, t.numel(), str(t.dtype)))
        off += -(-nbytes // 256) * 256
    total = max(off, 256)
    _agree(hg, layout, "the layout of the buffers the peer writes (counters, receive buffers)")
    raw, peer_raw, keep = _SYMMETRIC_ALLOC(total, h.device, rank, group, hg)
    for what, t in (("this rank's", raw), ("the peer's", peer_raw)):
        if t.numel() < total or t.dtype != torch.uint8 or t.device != h.device or t.data_ptr() % 256:
            raise RuntimeError(f"symmetric memory: {what} buffer is not {total} bytes on {h.device}, 256-byte "
                               f"aligned: {describe(t)} at {t.data_ptr():#x}")
    raw.zero_()
    b = h.bindings
    peer = {}
    for name, off, n, _ in layout:
        t, ptrs = items[name]
        nb = n * t.element_size()
        mine = raw[off:off + nb].view(t.dtype)
        theirs = peer_raw[off:off + nb].view(t.dtype)
        if name == "counters":
            h.counters = mine
        else:
            store = h.scratch if name in h.scratch else h.state
            store[name] = mine
            if f"{name}_ptr" in b.pointers:
                b.pointers[f"{name}_ptr"] = mine
        for p in ptrs:
            peer[p] = theirs
    b.table.copy_(torch.tensor([t.data_ptr() for t in b.pointers.values()], dtype=torch.int64))
    _sync(h.device)
    return raw, keep, peer


def _build_rank_gpu(weights, kv, full: ModelConfig, max_seq_len, tp_group, host_group, tapes, num_sms, tiling,
                    policy, seed, pool_us, elide_waits, spin_limit, sync_check, wait_s, lowering, decoder: bool,
                    verify_tapes, profile: bool = False) -> TPRankHandle:
    dist = _dist()
    if dist.get_world_size(tp_group) != 2:
        raise arg_error(ValueError, "tp_group", "a group of 2 processes (tensor-parallel tapes exist for two ranks)",
                        f"{dist.get_world_size(tp_group)} processes")
    r = dist.get_rank(tp_group)
    check_tp(full, r, 2)
    _check_shard("weights", weights, r)
    first = weights["layers"][0].get("q") if isinstance(weights["layers"][0], dict) else None
    # (CPU tensors under the Triton interpreter: the CPU rehearsal of this path, tests/test_tp_bench.py)
    if not isinstance(first, torch.Tensor) or (first.device.type != "cuda" and not interpreter_mode()):
        raise arg_error(ValueError, "weights", "tensors on this process's GPU (tp_group: one rank per GPU)",
                        describe(first))
    device = _check_rank_inputs("weights", weights, kv, full, r, max_seq_len, decoder)
    if spin_limit is None:
        spin_limit = GPU_TP_SPIN_LIMIT
    check_spin_limit(spin_limit)
    wait_ns = _wait_ns(DEFAULT_TP_WAIT_S if wait_s is None else wait_s)
    hg = host_group if host_group is not None else make_host_group(tp_group)
    if tapes is None:
        tapes = _compile_tp(full, max_seq_len, device, num_sms, tiling, policy, seed, pool_us, elide_waits, lowering,
                            decoder)
    else:
        if not isinstance(tapes, (list, tuple)) or len(tapes) != 2:
            raise arg_error(TypeError, "tapes", "both ranks' tapes (compile_model(..., tp=2).tapes)", describe(tapes))
        if verify_tapes:
            verify_tp(list(tapes))
    _check_tapes(tapes, full, max_seq_len, decoder)
    tape = tapes[r]
    dev_sms = device_sms(device)
    if tape.num_sms > dev_sms:
        raise arg_error(ValueError, "tapes", f"at most {dev_sms} SM queues (this GPU's SMs)", tape.num_sms)
    # both processes must run the same program: a rank of another compile would wait forever
    _agree(hg, (_tape_digest(tapes), tape.num_sms, max_seq_len, full.to_dict()), "the tapes")
    box = {}

    def place(k):
        box["symm"] = _place_symmetric(k, r, tp_group, hg)

    k = _build_rank(weights, kv, device, tape, spin_limit, sync_check, wait_ns, place, profile)
    try:
        wire_peer(k, box["symm"][2])
        _sync(device)
        _barrier(hg)                      # both ranks built: their counters are zero, the peer's are mapped
    except BaseException:
        runtime.teardown(k)
        raise
    h = TPRankHandle(layer=k, cfg=full, rank=r, group=tp_group, host_group=hg, epoch_limit=epoch_limit(tapes),
                     symm=box["symm"], decoder=decoder)
    if decoder:
        h.tok, h.toks = k.state["tok"], k.state["toks"]
        h.x0 = k.scratch["x0"].view(1, full.d)
        h.hidden = torch.empty(1, full.d, dtype=torch.bfloat16, device=device)
        h.logits = k.scratch["logits"].view(1, -1)
    return h


def _reset_rank(h: TPRankHandle) -> None:
    """After a failed step on either rank: zero this rank's counters, status and call count once
    both kernels have ended (each rank synchronised its GPU before the status exchange, so the peer
    signals nothing any more), then wait until the peer has done the same."""
    _sync(h.layer.device)
    runtime.reset_counters(h.layer)
    _sync(h.layer.device)
    h.calls = 0
    _barrier(h.host_group)


def tp_check(h: TPRankHandle) -> None:
    """Collective: wait for this rank's kernel, exchange both ranks' status; if either stopped on a
    wait, both reset (:func:`_reset_rank`) and both raise :class:`MegakernelError` naming the rank,
    the instruction and the counter."""
    k = h.layer
    mine = None
    try:
        k.check(sync=True)              # synchronises; resets this rank's counters if it failed
    except MegakernelError as e:
        mine = (str(e), [tuple(x) for x in e.stuck])
    got = _gather(h.host_group, mine)
    if any(g is not None for g in got):
        _reset_rank(h)
        lines = [f"rank {q}: {g[0]}" for q, g in enumerate(got) if g is not None]
        stuck = [(q, *row) for q, g in enumerate(got) if g is not None for row in g[1]]
        raise MegakernelError("tensor-parallel step failed (both ranks' counters were reset):\n" + "\n".join(lines),
                              stuck)


def tp_launch(h: TPRankHandle, pos, x=None, out=None) -> None:
    """One launch of this rank's kernel, unchecked and without a barrier (timing loops: both
    processes launch their steps back to back, then call :func:`tp_check`). ``pos``: an int, or None
    for the position the device holds; the decoder's ``x`` / ``out`` default to its own buffers."""
    k = h.layer
    p = check_pos(k, pos)
    _check_calls(h)
    h.calls += 1
    k.last_pos = p
    _launch_one(k, h.x0 if x is None else x, p, h.hidden if out is None else out)


def _launch_one(k: LayerHandle, x, pos: int, out) -> None:
    if k.device.type == "cuda":
        with torch.cuda.device(k.device):
            runtime.launch(k, x, pos, out)
    else:       # the CPU rehearsal: no host copies of the arguments (the interpreter's own launch copies
        # them back at its end, over a peer's signal)
        _interpreter_launch_all([(k.kernel, *kernel_args(k, x, pos, out))])


def _check_calls(h) -> None:
    """One more call of ``h`` (a :class:`TPHandle` or :class:`TPRankHandle`) stays in its counters'
    int32 range (the device never resets them, see the module docstring)."""
    if h.calls + 1 > h.epoch_limit:
        raise RuntimeError(f"handle: {h.calls} calls, the counters' int32 range; build the handles again")


def _rank_step(h: TPRankHandle, x, pos: int, out, launch: bool = True) -> None:
    check_open(h, "tp_teardown")
    _check_calls(h)
    k = h.layer
    if not k.lock.acquire(blocking=False):
        raise RuntimeError("handle: stepped from two threads at once")
    try:
        k.last_pos = pos
        _barrier(h.host_group)            # both kernels start within about a millisecond
        h.calls += 1
        if launch:
            _launch_one(k, x, pos, out)
        tp_check(h)
    finally:
        k.lock.release()


# ---- launch ----------------------------------------------------------------------------------------
def _interpreter_launch_all(launches) -> None:
    """Run several one-program launches of interpreted kernels at once, each in its own thread, under
    ONE patch of ``triton.language`` (see the module docstring: the interpreter's own launch patches
    and restores it per launch, which two concurrent launches would undo for each other). All tensors
    must be CPU tensors (the interpreter's host copies are skipped: a CPU tensor is its own copy)."""
    from triton.runtime import interpreter as ti
    prepared = []
    for kernel, args, kwargs in launches:
        fn = kernel.rewrite()
        ge = ti.GridExecutor(fn, kernel.arg_names, (1,))
        spec = inspect.getfullargspec(fn)
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor) and a.device.type != "cpu":
                raise ValueError("the CPU loopback takes CPU tensors only")
        call = inspect.getcallargs(fn, *args, **{k: v for k, v in kwargs.items() if k in spec.args})
        prepared.append((fn, {n: v if n in ge.constexprs else ti._implicit_cvt(v) for n, v in call.items()}))
    errors: list = [None] * len(prepared)

    def run(k, fn, call):
        try:
            fn(**call)
        except BaseException as e:           # reported by the caller
            errors[k] = e

    with _LAUNCH_LOCK:
        scope = ti._patch_lang(launches[0][0].fn)
        # the interpreter rewrites (ast.parse) each device function at its first call: two threads
        # doing so at once trip CPython 3.11's AST recursion-depth check ("AST constructor recursion
        # depth mismatch"), so the rewrites are serialised for the threads' lifetime
        rewrite = ti.InterpretedFunction.rewrite

        def locked_rewrite(self):
            with _REWRITE_LOCK:
                return rewrite(self)

        ti.InterpretedFunction.rewrite = locked_rewrite
        try:
            ti.interpreter_builder.set_grid_dim(1, 1, 1)
            ti.interpreter_builder.set_grid_idx(0, 0, 0)     # one program per launch: the same index for all
            threads = [threading.Thread(target=run, args=(k, fn, call), name=f"megatape-tp-rank{k}", daemon=True)
                       for k, (fn, call) in enumerate(prepared)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        finally:
            ti.InterpretedFunction.rewrite = rewrite
            scope.restore()
    for k, e in enumerate(errors):
        if e is not None:
            raise ti.InterpreterError(f"rank {k}: {e!r}") from e


def _launch_ranks(h: TPHandle, xs, pos: int, outs, ranks=(0, 1)) -> None:
    # both ranks in one process is the CPU loopback only (_peer_tensors refuses GPUs): on GPUs each
    # process holds one rank and steps it collectively
    assert h.loopback, "a TPHandle of both ranks exists only as the CPU loopback"
    _interpreter_launch_all([(h.ranks[r].kernel, *kernel_args(h.ranks[r], xs[r], pos, outs[r])) for r in ranks])


def check(h: TPHandle) -> None:
    """Raise :class:`MegakernelError` if either rank's last launch stopped on a wait; then both
    ranks' counters, status and call count are reset together (the next step starts clean)."""
    msgs, stuck = [], []
    for r, k in enumerate(h.ranks):
        try:
            k.check(sync=True)
        except MegakernelError as e:
            msgs.append(f"rank {r}: {e}")
            stuck += [(r, *row) for row in e.stuck]
    if msgs:
        for k in h.ranks:
            runtime.reset_counters(k)
        h.calls = 0
        raise MegakernelError("tensor-parallel step failed (both ranks' counters were reset):\n" + "\n".join(msgs),
                              stuck)


def _step(h: TPHandle, xs, pos: int, outs, ranks=(0, 1)) -> None:
    check_open(h, "tp_teardown")
    _check_calls(h)
    holds = []
    try:
        for r in ranks:
            k = h.ranks[r]
            if not k.lock.acquire(blocking=False):
                raise RuntimeError("handle: stepped from two threads at once")
            holds.append(k)
            k.last_pos = pos
        h.calls += 1
        _launch_ranks(h, xs, pos, outs, ranks)
        check(h)
    finally:
        for k in holds:
            k.lock.release()


def tp_layer_step(h, x: torch.Tensor, pos: int, *, ranks=(0, 1), launch: bool = True):
    """Run the layers as 2 ranks on the residual ``x`` (1, d) bf16 at ``pos`` (each rank appends its
    KV heads' rows into its cache). Returns ``[rank 0's output, rank 1's]``, fresh (1, d) bf16
    tensors (bitwise equal: both ranks add the same partials in the same order).
    ``ranks``: for tests, launch only these ranks (a rank whose peer never launches times out on the
    peer's counters: MegakernelError).
    A :class:`TPRankHandle` (one rank per process): collective; ``x`` on this rank's GPU; returns
    this rank's output (1, d); ``launch=False`` (tests) takes part in the step without launching."""
    if isinstance(h, TPRankHandle):
        if h.decoder:
            raise ValueError("handle: a whole-model decoder (build_tp_decoder); use tp_decode_step")
        pos = check_step_args(h.layer, x, check_pos(h.layer, pos, held=False))
        out = torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=h.device)
        _rank_step(h, x, pos, out, launch=bool(launch))
        return out
    if h.decoder:
        raise ValueError("handle: a whole-model decoder (build_tp_decoder); use tp_decode_step")
    pos = check_pos(h.ranks[0], pos, held=False)
    for k in h.ranks:
        check_step_args(k, x, pos)
    outs = [torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=k.device) for k in h.ranks]
    if not (tuple(ranks) in ((0, 1), (0,), (1,))):
        raise arg_error(ValueError, "ranks", "(0, 1), (0,) or (1,)", ranks)
    _step(h, [x, x], pos, outs, tuple(ranks))
    return outs


def tp_decode_step(h, token: int, pos: int, *, launch: bool = True) -> torch.Tensor:
    """One whole-model decode step as 2 ranks: both embed ``token`` (an int), run the layers at
    ``pos``, the final norm, their LM head slices and the cross-rank argmax. Returns the fp32
    logits (1, vocab) (rank 0's slice, then rank 1's); the greedy next token each rank computed
    is left in its ``tok`` (:func:`tokens`).
    A :class:`TPRankHandle`: collective; the logits are both ranks' slices gathered (over the host
    group), on this rank's GPU; ``launch=False`` as for :func:`tp_layer_step`."""
    k0 = h.layer if isinstance(h, TPRankHandle) else h.ranks[0]
    if not h.decoder:
        raise ValueError("handle: the layers alone (build_tp_layers); use tp_layer_step")
    pos = check_pos(k0, pos, held=False)
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < h.cfg.vocab:
        raise arg_error(ValueError, "token", f"an int in [0, vocab={h.cfg.vocab})", token)
    if isinstance(h, TPRankHandle):
        h.tok.fill_(token)
        _rank_step(h, h.x0, pos, h.hidden, launch=bool(launch))
        return gather_logits(h)
    for t in h.tok:
        t.fill_(token)
    _step(h, h.x0, pos, h.hidden)
    return torch.cat([lg.clone() for lg in h.logits], dim=-1)


def gather_logits(h: TPRankHandle) -> torch.Tensor:
    """Collective: both ranks' logits slices of the last step, (1, vocab) fp32 on this rank's GPU."""
    mine = h.logits.detach().to("cpu", copy=True)
    parts = _gather(h.host_group, mine)
    return torch.cat(parts, dim=-1).to(h.device)


def tokens(h) -> list[int]:
    """The greedy next token each rank left on its device: ``[rank 0's, rank 1's]`` (equal).
    A :class:`TPRankHandle`: collective (gathered over the host group)."""
    if isinstance(h, TPRankHandle):
        return [int(t) for t in _gather(h.host_group, int(h.tok.item()))]
    return [int(t.item()) for t in h.tok]


def tp_generate(h, prompt_tokens, n_new: int, start_pos: int = 0) -> list[int]:
    """Greedy generation as 2 ranks: the prompt at ``start_pos, ...``, then ``n_new`` tokens, each
    launch's EMBED reading the token its rank's previous TP_ARGMAX left (no host round trip).
    Returns the new tokens (checked equal on both ranks). Collective for a :class:`TPRankHandle`."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise arg_error(ValueError, "prompt_tokens", "a non-empty list of token ids", prompt)
    last = start_pos + len(prompt) - 1 + max(0, n_new - 1)
    if last >= h.max_seq:
        raise arg_error(ValueError, "prompt_tokens / n_new", f"positions up to {h.max_seq - 1}", last)
    for i, t in enumerate(prompt):
        tp_decode_step(h, t, start_pos + i)
    out = []
    pos = start_pos + len(prompt)
    for i in range(n_new):
        toks = tokens(h)
        if toks[0] != toks[1]:
            raise AssertionError(f"the ranks' tokens differ: {toks}")
        out.append(toks[0])
        if i + 1 < n_new:
            if isinstance(h, TPRankHandle):
                _rank_step(h, h.x0, pos + i, h.hidden)
            else:
                _step(h, h.x0, pos + i, h.hidden)       # EMBED reads each rank's own tok
    return out


def tp_teardown(h) -> None:
    """Release both ranks' buffers (idempotent). A :class:`TPRankHandle`: this rank's, its
    symmetric memory included (both processes should tear down at the same point: the symmetric
    pool expects the same allocations on every rank)."""
    if h.closed:
        return
    if isinstance(h, TPRankHandle):
        runtime.teardown(h.layer)
        h.layer.counters = None          # the last references into the symmetric allocation
        h.symm = ()
        h.tok = h.toks = h.x0 = h.hidden = h.logits = None
        h.closed = True
        return
    for k in h.ranks:
        runtime.teardown(k)
    h.closed = True
