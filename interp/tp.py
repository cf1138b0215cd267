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
(``schedule.verify.verify_tp`` point 6). Such waits stay bounded (``spin_limit`` polls) and a
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
* two GPUs (NOT built, never run): the same handles, each rank's kernel launched on its own GPU,
  with the peer pointers bound to the peer's buffers mapped into this GPU (e.g. symmetric memory);
  only :func:`_peer_tensors` differs. See bench/NOTES.md "Issue 14 runtime".

The counters are never reset by the device in a tensor-parallel kernel (a rank zeroing its counters
after ``epoch_limit`` calls could lose a signal of a peer that is a call ahead): the host refuses a
step past that many calls (millions for small tapes); rebuild to go on. A failed step resets both
ranks' counters, status and call count together.
"""
from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch

from opcodes import ModelConfig
from opcodes.tp import TPDecoderLayout, TPLayout, check_tp, shard_config
from schedule import compile_model
from schedule.verify import verify_tp

from . import runtime
from .runtime import LayerHandle, MegakernelError, _check_tensor, _desc, _err

#: polls before a wait gives up in the CPU loopback: both ranks share one interpreter (the GIL), so
#: a wait may poll while its peer interprets a whole stage (seconds); a poll is ~0.1-0.5 ms of
#: interpreted Python, so a peer that never signals is reported after some 10-30 s
INTERPRETER_TP_SPIN_LIMIT = 1 << 16
_INT32_MAX = 2**31 - 1
_LAUNCH_LOCK = threading.Lock()       # one loopback step at a time in this process


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
def _check_ranks(rank_weights, rank_kv, cfg) -> ModelConfig:
    full, _ = check_tp(cfg, 0, 2)
    for name, v in (("rank_weights", rank_weights), ("rank_kv", rank_kv)):
        if not isinstance(v, (list, tuple)) or len(v) != 2:
            raise _err(TypeError, name, "a list of the 2 ranks' shards", _desc(v))
    for r, w in enumerate(rank_weights):
        if not isinstance(w, dict) or not isinstance(w.get("layers"), (list, tuple)) or not w["layers"]:
            raise _err(TypeError, f"rank_weights[{r}]", "a dict with key 'layers' (opcodes.tp.shard_weights)", _desc(w))
        tp = w.get("tp")
        if tp is not None and (tp.get("rank"), tp.get("size")) != (r, 2):
            raise _err(ValueError, f"rank_weights[{r}]", f"rank {r} of 2 (weights['tp'])", tp)
    return full


def _build_rank(weights, kv, full: ModelConfig, r: int, tape, max_seq_len: int, spin_limit, sync_check) -> LayerHandle:
    """Rank r's kernel handle: ``build_layer``'s steps for a given TP tape (the peer pointers are
    placeholders until :func:`wire_peer`)."""
    sc = shard_config(full, r, 2)
    cfg, device = runtime.validate_inputs(weights, kv, sc, max_seq_len)
    if device.type == "cpu" and tape.num_sms != 1:
        raise ValueError("num_sms: the CPU loopback runs each rank as one program (the Triton interpreter), "
                         f"got a tape of {tape.num_sms} SMs")
    b = runtime.bind_buffers(tape, weights, kv, device)
    h = LayerHandle(cfg=cfg, lay=tape.lay, tape=tape, device=device, num_sms=tape.num_sms, spin_limit=spin_limit,
                    sync_check=(device.type == "cpu") if sync_check is None else bool(sync_check),
                    weights=weights, kv_cache=kv, bindings=b)
    runtime._make_control(h, False)
    h.qoff_dev[-1] = _INT32_MAX         # no device-side counter reset (module docstring)
    runtime._compile_kernel(h, False, True)
    return h


def _peer_tensors(h: LayerHandle, device: torch.device) -> dict:
    """The tensors of rank ``h`` that its peer's kernel writes or signals (kernel pointer name of the
    PEER's kernel -> tensor), as the peer on ``device`` addresses them. The CPU loopback: ``h``'s own
    tensors. Two GPUs: they would be ``h``'s buffers mapped into ``device`` (not built)."""
    out = {"peer_cnt_ptr": h.counters}
    for cls in h.tape.classes():
        for p, buf in cls.PEER_POINTERS.items():
            out[p] = h.scratch[buf] if buf in h.scratch else h.state[buf]
    if device.type == "cpu" and h.device.type == "cpu":
        return out
    raise NotImplementedError(
        "tensor parallelism over two GPUs: mapping the peer GPU's counters and receive buffers into this GPU "
        "(symmetric memory / CUDA IPC) is not built yet; only the CPU loopback runs (bench/NOTES.md, issue 14)")


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
        if t.dtype != runtime._TORCH_DTYPES[types[name]]:
            raise TypeError(f"{name}: the kernel reads {types[name]}, the peer's buffer is {t.dtype}")
        b.pointers[name] = t
    b.table.copy_(torch.tensor([t.data_ptr() for t in b.pointers.values()], dtype=torch.int64))


def _compile_tp(full: ModelConfig, max_seq_len, device, num_sms, tiling, policy, seed, pool_us, elide_waits,
                lowering, decoder: bool):
    if num_sms is None:
        num_sms = runtime._device_sms(device)
    c = compile_model(full, num_sms, max_seq=max_seq_len, tiling=tiling, policy=policy, seed=seed,
                      sequential=(device.type == "cpu"), lowering=lowering, pool_us=pool_us, decoder=decoder,
                      elide_waits=elide_waits, tp=2)
    return c.tapes


def _build(rank_weights, rank_kv, cfg, max_seq_len, tapes, num_sms, tiling, policy, seed, pool_us, elide_waits,
           spin_limit, sync_check, lowering, decoder) -> TPHandle:
    full = _check_ranks(rank_weights, rank_kv, cfg)
    first = rank_weights[0]["layers"][0].get("q") if isinstance(rank_weights[0]["layers"][0], dict) else None
    device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
    loopback = device.type == "cpu"
    if spin_limit is None:
        spin_limit = INTERPRETER_TP_SPIN_LIMIT if loopback else runtime.DEFAULT_SPIN_LIMIT
    if isinstance(spin_limit, bool) or not isinstance(spin_limit, int) or spin_limit <= 0:
        raise _err(ValueError, "spin_limit", "a positive int", spin_limit)
    if tapes is None:
        tapes = _compile_tp(full, max_seq_len, device, num_sms, tiling, policy, seed, pool_us, elide_waits, lowering,
                            decoder)
    else:
        verify_tp(list(tapes))
    want = TPDecoderLayout if decoder else TPLayout
    for r, t in enumerate(tapes):
        if not isinstance(t.lay, want) or (decoder != isinstance(t.lay, TPDecoderLayout)):
            raise _err(ValueError, f"tapes[{r}]", f"a {want.__name__} tape", type(t.lay).__name__)
        if t.lay.full_cfg.to_dict() != full.to_dict() or t.lay.max_seq != max_seq_len:
            raise ValueError(f"tapes[{r}]: compiled for a different cfg or max_seq_len than the one given")
    hs = []
    try:
        for r in range(2):
            hs.append(_build_rank(rank_weights[r], rank_kv[r], full, r, tapes[r], max_seq_len, spin_limit, sync_check))
        if hs[0].device != hs[1].device and loopback:
            raise ValueError("rank_weights: the CPU loopback needs both ranks' tensors on the CPU")
        for r in range(2):
            wire_peer(hs[r], _peer_tensors(hs[1 - r], hs[r].device))
    except BaseException:
        for h in hs:
            runtime.teardown(h)
        raise
    targets = [int(t) for h in hs for t in h.tape.words[:, 2].tolist() + h.tape.words[:, 4].tolist()] or [1]
    limit = _INT32_MAX // max(1, max(targets)) - 1
    return TPHandle(ranks=hs, cfg=full, loopback=loopback, epoch_limit=limit, decoder=decoder)


def build_tp_layers(rank_weights, rank_kv, cfg, max_seq_len, *, num_sms: int | None = None, tiling=None,
                    policy: str = "cost", tapes=None, seed: int = 0, pool_us: float | None = None,
                    elide_waits: bool = True, spin_limit: int | None = None, sync_check: bool | None = None) -> TPHandle:
    """Prepare the layers of the full model ``cfg`` as 2 ranks for :func:`tp_layer_step`. Untimed.

    rank_weights : [rank 0's, rank 1's] ``{"layers": [...]}`` shards (``opcodes.tp.shard_weights``)
    rank_kv      : [rank 0's, rank 1's] KV caches (``opcodes.tp.shard_kv_cache``), written in place
    ``tapes``: both ranks' precompiled tapes (verified with ``verify_tp``); otherwise compiled here
    (``compile_model(cfg, num_sms, tp=2, decoder=False)``; on the CPU one SM per rank, sequential).
    ``spin_limit``: polls before a wait gives up (default: :data:`INTERPRETER_TP_SPIN_LIMIT` on the CPU).
    """
    return _build(rank_weights, rank_kv, cfg, max_seq_len, tapes, num_sms, tiling, policy, seed, pool_us,
                  elide_waits, spin_limit, sync_check, None, False)


def build_tp_decoder(rank_weights, rank_kv, cfg, max_seq_len, *, lm_rows: int = 0, emb_cols: int = 0,
                     num_sms: int | None = None, tiling=None, policy: str = "cost", tapes=None, seed: int = 0,
                     pool_us: float | None = None, elide_waits: bool = True, spin_limit: int | None = None,
                     sync_check: bool | None = None) -> TPHandle:
    """Prepare the whole model ``cfg`` (with ``vocab``) as 2 ranks for :func:`tp_decode_step` /
    :func:`tp_generate` (greedy: the tapes end in TP_ARGMAX_PUSH / TP_ARGMAX). ``rank_weights[r]``:
    rank r's shard with ``embed``, ``final_norm`` (replicated) and its ``lm_head`` slice
    (``(vocab / 2, d)``). Options as :func:`build_tp_layers`, ``lm_rows`` / ``emb_cols`` as
    ``interp.decoder.build_decoder``'s."""
    from schedule.decoder_program import decoder_lowering
    full = runtime.parse_cfg(cfg)
    if not full.vocab:
        raise _err(ValueError, "cfg['vocab']", "the vocabulary size (> 0) for a whole-model decoder", full.vocab)
    full = _check_ranks(rank_weights, rank_kv, full)
    for r, w in enumerate(rank_weights):
        first = w["layers"][0]["q"]
        shapes = {"embed": (full.vocab, full.d), "final_norm": (full.d,), "lm_head": (full.vocab // 2, full.d)}
        for k, shape in shapes.items():
            if k not in w:
                raise _err(ValueError, f"rank_weights[{r}]", "keys 'embed', 'final_norm', 'lm_head'", f"missing {k!r}")
            _check_tensor(f"rank_weights[{r}][{k!r}]", w[k], shape, torch.bfloat16, first.device)
    h = _build(rank_weights, rank_kv, full, max_seq_len, tapes, num_sms, tiling, policy, seed, pool_us, elide_waits,
               spin_limit, sync_check, decoder_lowering(lm_rows, emb_cols), True)
    for k in h.ranks:
        h.tok.append(k.state["tok"])
        h.toks.append(k.state["toks"])
        h.x0.append(k.scratch["x0"].view(1, full.d))
        h.hidden.append(torch.empty(1, full.d, dtype=torch.bfloat16, device=k.device))
        h.logits.append(k.scratch["logits"].view(1, -1))
    return h


# ---- launch ----------------------------------------------------------------------------------------
def _kernel_args(h: LayerHandle, x, pos: int, out):
    args = (h.tape_dev, h.qoff_dev, h.counters, h.status, h.prof, h.bindings.table, h.ctl, h.spin_limit, pos, x, out)
    return h.kernel, args, {**h.constexprs, **h.launch_opts}


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
            scope.restore()
    for k, e in enumerate(errors):
        if e is not None:
            raise ti.InterpreterError(f"rank {k}: {e!r}") from e


def _launch_ranks(h: TPHandle, xs, pos: int, outs, ranks=(0, 1)) -> None:
    launches = [_kernel_args(h.ranks[r], xs[r], pos, outs[r]) for r in ranks]
    if h.loopback:
        _interpreter_launch_all(launches)
    else:                                    # two GPUs: each rank's launch on its own device (not built)
        for r in ranks:
            with torch.cuda.device(h.ranks[r].device):
                runtime.launch(h.ranks[r], xs[r], pos, outs[r])


def _reset(k: LayerHandle) -> None:
    k.status.zero_()
    k.counters.zero_()
    k.ctl.zero_()


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
            _reset(k)
        h.calls = 0
        raise MegakernelError("tensor-parallel step failed (both ranks' counters were reset):\n" + "\n".join(msgs),
                              stuck)


def _step(h: TPHandle, xs, pos: int, outs, ranks=(0, 1)) -> None:
    if h.closed:
        raise ValueError("handle: tp_teardown() was already called on it")
    if h.calls + 1 > h.epoch_limit:
        raise RuntimeError(f"handle: {h.calls} calls, the counters' int32 range; build the handles again")
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


def tp_layer_step(h: TPHandle, x: torch.Tensor, pos: int, *, ranks=(0, 1)) -> list:
    """Run the layers as 2 ranks on the residual ``x`` (1, d) bf16 at ``pos`` (each rank appends its
    KV heads' rows into its cache). Returns ``[rank 0's output, rank 1's]``, fresh (1, d) bf16
    tensors (bitwise equal: both ranks add the same partials in the same order).
    ``ranks``: for tests, launch only these ranks (a rank whose peer never launches times out on the
    peer's counters: MegakernelError)."""
    if h.decoder:
        raise ValueError("handle: a whole-model decoder (build_tp_decoder); use tp_decode_step")
    pos = runtime._check_pos(h.ranks[0], pos)
    if pos < 0:
        raise _err(TypeError, "pos", "a python int", None)
    for k in h.ranks:
        runtime._check_step_args(k, x, pos)
    outs = [torch.empty(1, h.cfg.d, dtype=torch.bfloat16, device=k.device) for k in h.ranks]
    if not (tuple(ranks) in ((0, 1), (0,), (1,))):
        raise _err(ValueError, "ranks", "(0, 1), (0,) or (1,)", ranks)
    _step(h, [x, x], pos, outs, tuple(ranks))
    return outs


def tp_decode_step(h: TPHandle, token: int, pos: int) -> torch.Tensor:
    """One whole-model decode step as 2 ranks: both embed ``token`` (an int), run the layers at
    ``pos``, the final norm, their LM head slices and the cross-rank argmax. Returns the fp32
    logits (1, vocab) (rank 0's slice, then rank 1's); the greedy next token each rank computed
    is left in its ``tok`` (:func:`tokens`)."""
    if not h.decoder:
        raise ValueError("handle: the layers alone (build_tp_layers); use tp_layer_step")
    pos = runtime._check_pos(h.ranks[0], pos)
    if pos < 0:
        raise _err(TypeError, "pos", "a python int", None)
    if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < h.cfg.vocab:
        raise _err(ValueError, "token", f"an int in [0, vocab={h.cfg.vocab})", token)
    for t in h.tok:
        t.fill_(token)
    _step(h, h.x0, pos, h.hidden)
    return torch.cat([lg.clone() for lg in h.logits], dim=-1)


def tokens(h: TPHandle) -> list[int]:
    """The greedy next token each rank left on its device: ``[rank 0's, rank 1's]`` (equal)."""
    return [int(t.item()) for t in h.tok]


def tp_generate(h: TPHandle, prompt_tokens, n_new: int, start_pos: int = 0) -> list[int]:
    """Greedy generation as 2 ranks: the prompt at ``start_pos, ...``, then ``n_new`` tokens, each
    launch's EMBED reading the token its rank's previous TP_ARGMAX left (no host round trip).
    Returns the new tokens (checked equal on both ranks)."""
    prompt = [int(t) for t in prompt_tokens]
    if not prompt:
        raise _err(ValueError, "prompt_tokens", "a non-empty list of token ids", prompt)
    last = start_pos + len(prompt) - 1 + max(0, n_new - 1)
    if last >= h.max_seq:
        raise _err(ValueError, "prompt_tokens / n_new", f"positions up to {h.max_seq - 1}", last)
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
            _step(h, h.x0, pos + i, h.hidden)       # EMBED reads each rank's own tok
    return out


def tp_teardown(h: TPHandle) -> None:
    """Release both ranks' buffers (idempotent)."""
    if h.closed:
        return
    for k in h.ranks:
        runtime.teardown(k)
    h.closed = True
