"""Whole-model decode: one launch of the interpreter kernel per token, embedding to next token.

    h = build_decoder(weights, kv_cache, cfg, max_seq_len)
    logits = decode_step(h, tokens, pos)              # tokens: (1,) int on the device -> (1, vocab) fp32
    new = generate(h, prompt_tokens, n_new)           # greedy; the host only launches
    teardown(h)

    h = build_decoder(weights, kv_cache, cfg, max_seq_len, sampling=True)     # SAMPLE instead of ARGMAX
    new = generate(h, prompt_tokens, n_new, temperature=0.8, top_k=50, top_p=0.95, seed=1)

``weights = {"embed": (vocab, d), "layers": [...], "final_norm": (d,), "lm_head": (vocab, d)}``
(bf16; ``lm_head`` may be the same tensor as ``embed``: tied embeddings), ``kv_cache`` and the
layers as for ``build_layer``, ``cfg`` the spec's cfg with ``vocab``.

The tape is ``schedule.decoder_program.lower_decoder``: EMBED tiles gather the token's row into
the layer-0 input, the layers run as in ``build_layer``, LM_HEAD tiles apply the final RMSNorm
and the LM head (fp32 logits and a (max, argmax) partial per tile) and ARGMAX writes the greedy
next token into a device int32 buffer, which the next launch's EMBED reads: greedy generation is
a loop of launches with no host round trip (the token never leaves the device).
``decode_step`` copies the caller's token into that buffer on the device first.
With ``build_decoder(..., sampling=True)`` the tape ends in SAMPLE instead (``opcodes.sample``):
the token is drawn on the device from softmax(logits / temperature) with top-k and top-p, by a
counter-based generator seeded with (seed, position), from parameters in a device buffer that
``generate`` writes once: still one launch per token and no host round trip.
The call count and the position live on the device (the kernel's control block), so on a GPU
``generate`` replays the tokens after the prompt as CUDA graphs of ``graph_block`` launches at the
device's position, greedy or sampled; ``decode_step(h, tokens, None)`` steps there too.

Two tapes: where the default tiling of a short cache is faster at short positions than the cache's
own (``opcodes.Tiling.short_prefix``: the 1B shape's attention in one instruction a KV head below
256 positions), a decoder built without ``tiling`` / ``tape`` holds a second tape of it
(``DecoderHandle.short``) over the same weights, cache and buffers, and every launch at a position
below ``short_until`` runs that one. Both are correct at every position; the choice is speed only.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from opcodes import DecoderLayout, ModelConfig, Tiling
from opcodes.decoder import decoder_shapes
from opcodes.sample import Sample, check_sampling
from schedule.decoder_program import decoder_lowering

from . import runtime
from .codegen import CTL_POS
from .common import arg_error, check_model_tensors, check_open, check_pos, describe, parse_cfg, validate_inputs
from .rows import check_slot, decode_rows, prefill as prefill_rows
from .runtime import LayerHandle


@dataclass
class DecoderHandle:
    """What ``build_decoder`` returns. ``layer`` is the kernel's :class:`LayerHandle` (tape,
    counters, scratch); the rest are the decoder's device buffers. ``short``: a second handle (its
    own tape, counters and control block; ``layer``'s weights, cache and buffers) that the positions
    below ``short_until`` run on, or None."""

    layer: LayerHandle
    cfg: ModelConfig
    lay: DecoderLayout
    device: torch.device
    tok: torch.Tensor            # (1,) int32: the token the next launch embeds (ARGMAX writes it)
    toks: torch.Tensor           # (max_seq,) int32: toks[pos] = the greedy token predicted at pos
    x0: torch.Tensor             # (1, d) bf16: the embedded token, the layer-0 input (x_ptr)
    hidden: torch.Tensor         # (1, d) bf16: the last layer's output (out_ptr)
    logits: torch.Tensor         # (1, vocab) fp32: the last launch's logits
    weights: dict = field(repr=False, default=None)
    closed: bool = False
    sampling: bool = False       # the tape ends in SAMPLE (build_decoder(..., sampling=True)), not ARGMAX
    graphs: dict = field(default_factory=dict, repr=False)   # (handle id, K) -> CUDA graph of K launches
    short: LayerHandle | None = None
    short_until: int = 0
    # the handle whose control block holds the device's position (the last to launch), and the
    # host's view of that position (which tape the next pos=None launch runs; the position itself is
    # always the device's)
    active: LayerHandle | None = field(default=None, repr=False)
    next_pos: int = 0
    # many rows per step (interp.rows): the sequence slots of the cache, the whole cache (the one-row
    # tapes above run on slot 0's view), the rows kernels by bucket (built on first use) and their options
    batch: int = 1
    kv_rows: list = field(default=None, repr=False)
    rows: dict = field(default_factory=dict, repr=False)
    rows_options: dict = field(default_factory=dict, repr=False)
    bound_slot: int = 0          # the slot the one-row kernels' cache pointers point at (_bind_slot)
    # the slot whose next position the device holds (``next_pos``): the last one-row launch's, 0 after
    # ``runtime.set_position`` (decode_step's one-position form runs on slot 0), -1 where a rows call has written
    # that slot since; ``decode_step(..., pos=None)`` is refused unless it is 0
    held_slot: int = 0

    @property
    def tape(self):
        return self.layer.tape

    @property
    def handles(self) -> tuple:
        """The one-row kernel handles of the decoder: ``layer``, then ``short`` if there is one."""
        return (self.layer,) if self.short is None else (self.layer, self.short)

    @property
    def max_seq(self) -> int:
        return self.lay.max_seq


def build_decoder(weights, kv_cache, cfg, max_seq_len, *, lm_rows: int = 0, emb_cols: int = 0, sampling: bool = False,
                  tp_group=None, batch: int = 1, **options):
    """Prepare a whole Llama-family model for ``decode_step`` / ``generate``. Untimed.

    weights  : {"embed": (vocab, d), "layers": [per-layer dicts as for build_layer], "final_norm": (d,),
               "lm_head": (vocab, d)}, bf16, row-major; ``lm_head`` may be ``embed`` itself (tied)
    kv_cache : [(k, v)] per layer, each (batch, n_kv, max_seq_len, hd) bf16, updated in place
    cfg      : the spec's cfg dict (or a ModelConfig) with ``vocab``
    batch    : sequence slots of the cache (``interp.rows``: ``prefill(h, tokens, start_pos, slot)``,
               ``decode_step(h, tokens (R,), pos (R,), slots=None)``); the one-position calls
               (``decode_step`` with one token and an int position) run on slot 0, ``generate`` on its
               ``slot``
    ``lm_rows`` / ``emb_cols``: vocabulary rows per LM_HEAD tile and d columns per EMBED tile (0: the
    defaults of ``opcodes.decoder.DecoderLayout``). ``sampling``: the tape ends in SAMPLE (the token
    drawn on the device; ``generate(..., temperature=...)``) instead of ARGMAX (greedy; the default,
    which ``generate`` needs for temperature 0). Other options go to ``build_layer`` (``num_sms``,
    ``tiling``, ``policy``, ``tape`` (a tape compiled with ``lower_decoder``), ``spin_limit``,
    ``sync_check``, ``profile``, ...). Without ``tiling`` and ``tape``, where
    ``Tiling.short_prefix(cfg, max_seq_len)`` is P > 0, a second tape of ``Tiling.for_config(cfg,
    max_seq=P)`` runs the positions below P (``DecoderHandle.short``; a second kernel to compile).

    ``tp_group`` (a ``torch.distributed`` group of 2 processes, one GPU each): tensor parallel, this
    process's rank only: ``weights`` / ``kv_cache`` are its shard (``opcodes.tp.shard_weights`` /
    ``shard_kv_cache``), ``cfg`` the full model's; collective (both processes call it). Returns an
    ``interp.tp.TPRankHandle`` (``interp.tp.build_tp_decoder(..., tp_group=...)``, whose options it
    takes: ``wait_s``, ``host_group``, ``tapes``, ...); ``decode_step`` / ``generate`` of it are
    ``interp.tp.tp_decode_step`` / ``tp_generate`` (greedy only).
    """
    if isinstance(batch, bool) or not isinstance(batch, int):
        raise arg_error(TypeError, "batch", "a python int >= 1", describe(batch))
    if batch < 1:
        raise arg_error(ValueError, "batch", "an int >= 1", batch)
    if tp_group is not None:
        if batch != 1:
            raise arg_error(ValueError, "batch", "1 with tp_group (tensor-parallel decoders run one sequence)", batch)
        if sampling:
            raise arg_error(ValueError, "sampling",
                            "False with tp_group (tensor-parallel decoders are greedy: TP_ARGMAX)", sampling)
        from .tp import build_tp_decoder
        return build_tp_decoder(weights, kv_cache, cfg, max_seq_len, lm_rows=lm_rows, emb_cols=emb_cols,
                                tp_group=tp_group, **options)
    if "lowering" in options:
        raise TypeError("build_decoder: lowering= is set by the decoder itself")
    if not isinstance(sampling, bool):
        raise arg_error(TypeError, "sampling", "a bool", describe(sampling))
    cfg = parse_cfg(cfg, decoder=True)
    device = validate_inputs(weights, kv_cache, cfg, max_seq_len, batch=batch)
    check_model_tensors("weights", weights, decoder_shapes(cfg), kv_cache, device)
    kv_rows = kv_cache
    if batch > 1:            # the one-row tapes run on slot 0 (a view: their writes land in the cache)
        kv_cache = [tuple(t[:1] for t in pair) for pair in kv_cache]
    h = runtime.build_validated(weights, kv_cache, cfg, device, max_seq_len,
                                lowering=decoder_lowering(lm_rows, emb_cols, sample=sampling), **options)
    lay = h.tape.lay
    if not isinstance(lay, DecoderLayout):
        runtime.teardown(h)
        raise ValueError("tape: not a whole-model decoder tape (compile it with "
                         "lowering=schedule.decoder_program.lower_decoder)")
    if sampling != any(c is Sample for c in h.tape.classes()):
        runtime.teardown(h)
        raise ValueError(f"tape: {'no' if sampling else 'a'} SAMPLE instruction, but sampling={sampling} (compile "
                         f"it with lowering=schedule.decoder_program.decoder_lowering(sample={sampling}))")
    short, until = None, 0
    if options.get("tiling") is None and options.get("tape") is None:
        until = Tiling.short_prefix(cfg, max_seq_len)
        if until:
            try:
                short = runtime.build_validated(weights, kv_cache, cfg, device, max_seq_len,
                                                lowering=decoder_lowering(lm_rows, emb_cols, sample=sampling),
                                                share_buffers=h,
                                                **{**options, "tiling": Tiling.for_config(cfg, max_seq=until)})
            except BaseException:
                runtime.teardown(h)
                raise
    hidden = torch.empty(1, cfg.d, dtype=torch.bfloat16, device=device)
    dh = DecoderHandle(layer=h, cfg=cfg, lay=lay, device=device, tok=h.state["tok"], toks=h.state["toks"],
                       x0=h.scratch["x0"].view(1, cfg.d), hidden=hidden,
                       logits=h.scratch["logits"].view(1, cfg.vocab), weights=weights, sampling=sampling,
                       short=short, short_until=until if short is not None else 0, active=h,
                       batch=batch, kv_rows=kv_rows, rows_options=dict(options))
    if sampling:
        set_sampling(dh)                 # temperature 1, no top-k / top-p, seed 0 until generate sets others
    return dh


def set_sampling(handle, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> None:
    """Write SAMPLE's parameters into the handle's device buffer (read by every later launch).
    Errors name the argument; the handle must have been built with ``sampling=True``."""
    _check_handle(handle)
    if not handle.sampling:
        raise ValueError("temperature: sampling (temperature > 0) needs a decoder built with "
                         "build_decoder(..., sampling=True); this one ends in the greedy ARGMAX")
    for name, v in Sample.state_values(temperature, top_k, top_p, seed).items():
        handle.layer.state[name].copy_(v)


def _check_handle(dh) -> None:
    if not isinstance(dh, DecoderHandle):
        raise arg_error(TypeError, "handle", "a DecoderHandle from build_decoder", describe(dh))
    check_open(dh)


def _check_token_range(what: str, t: torch.Tensor, vocab: int) -> None:
    """Tokens the host can see without a device sync are range-checked (the kernel clamps)."""
    if t.device.type == "cpu" and t.numel():
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi >= vocab:
            raise arg_error(ValueError, what, f"token ids in [0, vocab={vocab})", f"ids in [{lo}, {hi}]")


def _stepping(dh: DecoderHandle):
    """``runtime.Stepping`` of every handle of the decoder (a failure of either's earlier launch is
    reported; another thread stepping the decoder meanwhile gets a clear error)."""
    stack = contextlib.ExitStack()
    try:
        for h in dh.handles:
            stack.enter_context(runtime.Stepping(h))
    except BaseException:
        stack.close()
        raise
    return stack


def _pick(dh: DecoderHandle, pos: int) -> LayerHandle:
    """The handle that runs a launch at ``pos`` (-1: the device's position, which the host tracks as
    ``next_pos``). Switching hands the device's position over: the new handle's control block gets
    the old one's (a device copy, in stream order; captured too), so a ``pos=None`` launch of either
    tape continues where the other stopped."""
    p = dh.next_pos if pos < 0 else pos
    h = dh.short if dh.short is not None and p < dh.short_until else dh.layer
    if h is not dh.active:
        if pos < 0:
            h.ctl[CTL_POS:CTL_POS + 1].copy_(dh.active.ctl[CTL_POS:CTL_POS + 1])
        dh.active = h
    return h


def _bind_slot(dh: DecoderHandle, slot: int) -> None:
    """Point the one-row kernels' cache pointers (layer 0's k and v; the other layers are offsets from
    them, the same for every slot) at sequence slot ``slot`` of the (batch, ...) cache: two device
    writes into each kernel's address table, in stream order (graphs captured earlier see them too)."""
    if dh.bound_slot == slot:
        return
    for h in dh.handles:
        names = list(h.bindings.pointers)
        for ptr, j in (("kc_ptr", 0), ("vc_ptr", 1)):
            h.bindings.table[names.index(ptr)].fill_(dh.kv_rows[0][j][slot].data_ptr())
    dh.bound_slot = slot


def _launch(dh: DecoderHandle, pos: int, slot: int = 0) -> None:
    """One launch (inside ``_stepping``) on sequence slot ``slot``; ``pos`` -1: the position held on the
    device."""
    if dh.batch > 1:
        _bind_slot(dh, slot)
    h = _pick(dh, pos)
    if h.status_host and not h.in_capture:
        h.check(sync=False)      # a failure of an earlier launch that has finished since
    h.last_pos = pos
    dh.next_pos = (dh.next_pos if pos < 0 else pos) + 1
    dh.held_slot = slot
    runtime.launch(h, dh.x0, pos, dh.hidden)
    if h.sync_check:
        h.check(sync=True)


def _block_graph(dh: DecoderHandle, h: LayerHandle, k: int):
    """A CUDA graph of ``k`` launches of ``h`` (one of ``dh.handles``) at the device's position,
    captured once per handle and ``k``: each launch embeds the token the previous one's ARGMAX /
    SAMPLE left and advances the position (SAMPLE reads its parameters and the position from the
    device too), so a replay is ``k`` tokens with no host work between them."""
    g = dh.graphs.get((id(h), k))
    if g is None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(k):
                runtime.launch(h, dh.x0, -1, dh.hidden)
        dh.graphs[(id(h), k)] = g
    return g


def _rows_call(handle: DecoderHandle, tokens, pos, slots) -> bool:
    """Whether a ``decode_step`` is a many-rows one (``interp.rows``): ``slots`` given or the positions a
    sequence (a list, or a 1-D tensor: on a batched decoder of any length, so that a row's kernel does not
    change when a step's rows drop to one; with batch 1, a (1,) tensor is the one-row call's position)."""
    if slots is not None or isinstance(pos, (list, tuple)):
        return True
    return isinstance(pos, torch.Tensor) and pos.dim() == 1 and (pos.numel() != 1 or handle.batch > 1)


def _check_held(handle: DecoderHandle) -> None:
    """``decode_step(..., pos=None)`` continues the position the device holds, on slot 0: refused where that
    position is another slot's or a rows call has written its slot since (the step would write the cache where
    nothing asked). ``runtime.set_position`` makes it slot 0's again."""
    s = handle.held_slot
    if s == -1:
        raise ValueError(f"pos: None continues the position the device holds ({handle.next_pos}), but a many-rows call "
                         "(prefill, or decode_step with pos (R,)) has written its slot since: pass the position, or "
                         "set it (interp.runtime.set_position)")
    if s != 0:
        raise ValueError(f"pos: None continues the position the device holds, which is slot {s}'s (the last "
                         f"one-position launch ran there: generate(..., slot={s})); decode_step's one-position form "
                         f"runs on slot 0: pass pos (or set it: interp.runtime.set_position), or pos=[p] with "
                         f"slots=[{s}] to go on in slot {s}")


def decode_step(handle: DecoderHandle, tokens, pos, slots=None) -> torch.Tensor:
    """One whole-model decode step: embed ``tokens``, run every layer at ``pos`` (appending K/V
    into the cache), the final norm and the LM head. One launch.

    tokens : (1,) integer tensor on the handle's device (a python int is accepted too, but not
             under CUDA-graph capture: its copy to the device is a host transfer)
    pos    : int, the absolute position being written; None: the position held on the device (the
             last call's + 1, or ``runtime.set_position``'s), which a captured CUDA graph of several
             steps uses; on slot 0, so refused where the last one-position launch ran on another slot
             (``generate(..., slot=s)``) or a many-rows call has written its slot since (until
             ``runtime.set_position``)
    returns a fresh (1, vocab) fp32 tensor of logits. The greedy next token is also left on the
    device (``handle.tok``), where a following ``generate`` or launch would read it.
    A tensor-parallel rank's handle (``build_decoder(..., tp_group=...)``): ``interp.tp.tp_decode_step``
    (collective; the logits of both ranks' slices).

    Many rows (``interp.rows``): ``tokens`` (R,) and ``pos`` (R,) (integer tensors or lists of ints; on a
    decoder built with batch > 1 a (1,) pos tensor too), ``slots`` (R,) or None (row r is slot r, R <= batch):
    one launch of the rows kernel, every row independent; returns (R, vocab) fp32 logits. Every check comes
    before the cache is touched.
    """
    if not isinstance(handle, DecoderHandle):       # (the common case imports nothing more)
        from .tp import TPRankHandle, tp_decode_step
        if isinstance(handle, TPRankHandle):
            if isinstance(tokens, torch.Tensor) and tokens.numel() == 1 and not tokens.dtype.is_floating_point:
                tokens = int(tokens.reshape(-1)[0])
            return tp_decode_step(handle, tokens, pos)
    _check_handle(handle)
    if _rows_call(handle, tokens, pos, slots):
        if isinstance(tokens, int):
            raise arg_error(TypeError, "tokens", "a (R,) integer tensor or list of ints beside pos (R,) (a many-rows "
                            "step; a (1,) pos tensor is one on a decoder of batch > 1: an int token takes an int pos)",
                            describe(tokens))
        return decode_rows(handle, tokens, pos, slots)
    pos = check_pos(handle.layer, pos)
    if pos < 0:
        _check_held(handle)
    if isinstance(tokens, int) and not isinstance(tokens, bool):
        tokens = torch.tensor([tokens], dtype=torch.int32)
        _check_token_range("tokens", tokens, handle.cfg.vocab)
        tokens = tokens.to(handle.device)
    if not isinstance(tokens, torch.Tensor):
        raise arg_error(TypeError, "tokens", "a (1,) integer tensor or an int with an int pos (many rows: tokens "
                        "and pos both (R,))", describe(tokens))
    if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
        raise arg_error(TypeError, "tokens", "an integer dtype", describe(tokens))
    if tuple(tokens.shape) != (1,):
        raise arg_error(ValueError, "tokens", "shape (1,) with an int pos (many rows: pos (R,))", describe(tokens))
    if tokens.device != handle.device:
        raise arg_error(ValueError, "tokens", f"a tensor on {handle.device}", describe(tokens))
    _check_token_range("tokens", tokens, handle.cfg.vocab)
    with _stepping(handle):
        handle.tok.copy_(tokens)
        _launch(handle, pos)
        return handle.logits.clone()


def _eos_ids(eos_token_ids) -> frozenset:
    if eos_token_ids is None:
        return frozenset()
    if isinstance(eos_token_ids, int) and not isinstance(eos_token_ids, bool):
        eos_token_ids = [eos_token_ids]
    try:
        ids = list(eos_token_ids)
    except TypeError:
        raise arg_error(TypeError, "eos_token_ids", "an int, a list of ints or None", describe(eos_token_ids)) from None
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise arg_error(TypeError, "eos_token_ids", "an int, a list of ints or None", describe(eos_token_ids))
    return frozenset(ids)


def _generate_args(handle, prompt_tokens, n_new, start_pos, temperature, top_k, top_p, seed, eos_token_ids):
    """Every check of ``generate`` / ``generate_stream``, before anything runs: returns (the prompt
    on the device, its length, start_pos, the EOS ids)."""
    _check_handle(handle)
    if isinstance(prompt_tokens, (list, tuple)):
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_tokens):
            raise arg_error(TypeError, "prompt_tokens", "a list of python ints or a 1-D integer tensor",
                            describe(prompt_tokens))
        prompt_tokens = torch.tensor(list(prompt_tokens), dtype=torch.int32)
    if not isinstance(prompt_tokens, torch.Tensor):
        raise arg_error(TypeError, "prompt_tokens", "a 1-D integer tensor or a list of ints", describe(prompt_tokens))
    if prompt_tokens.dtype.is_floating_point or prompt_tokens.dtype.is_complex or prompt_tokens.dtype == torch.bool:
        raise arg_error(TypeError, "prompt_tokens", "an integer dtype", describe(prompt_tokens))
    if prompt_tokens.dim() != 1 or prompt_tokens.numel() == 0:
        raise arg_error(ValueError, "prompt_tokens", "a non-empty 1-D tensor (batch 1)", describe(prompt_tokens))
    if isinstance(n_new, bool) or not isinstance(n_new, int) or n_new < 0:
        raise arg_error(ValueError if isinstance(n_new, int) and not isinstance(n_new, bool) else TypeError,
                        "n_new", "an int >= 0", describe(n_new))
    start_pos = check_pos(handle.layer, start_pos, "start_pos", held=False)
    P = int(prompt_tokens.numel())
    last = start_pos + P - 1 + max(0, n_new - 1)
    if last >= handle.max_seq:
        raise arg_error(ValueError, "prompt_tokens / n_new", f"positions up to max_seq_len - 1 = {handle.max_seq - 1} "
                        f"(start_pos {start_pos} + {P} prompt tokens + {n_new} new - 1)", f"position {last}")
    _check_token_range("prompt_tokens", prompt_tokens, handle.cfg.vocab)
    check_sampling(temperature, top_k, top_p, seed)
    if temperature == 0 and handle.sampling:
        raise ValueError("temperature: 0 (greedy) needs a decoder that ends in ARGMAX (build_decoder(..., "
                         "sampling=False)); this one was built with sampling=True")
    if temperature > 0 and not handle.sampling:
        raise ValueError(f"temperature: {temperature} (sampling) needs a decoder built with build_decoder(..., "
                         "sampling=True); this one ends in the greedy ARGMAX")
    eos = _eos_ids(eos_token_ids)
    prompt = prompt_tokens.to(device=handle.device, dtype=torch.int32, non_blocking=True)
    return prompt, P, start_pos, eos


def _run_prompt(handle, prompt, P: int, start_pos: int, temperature, top_k, top_p, seed, chunked: bool,
                slot: int = 0) -> None:
    """The prompt: with ``chunked``, all but its last token in chunked prefill launches
    (``interp.rows.prefill``), else one one-row step each; the last token a one-row step (whose ARGMAX /
    SAMPLE makes the first new token)."""
    if temperature > 0:
        set_sampling(handle, temperature, top_k, top_p, seed)
    if chunked and P > 1:
        prefill_rows(handle, prompt[:P - 1].tolist(), start_pos, slot)
    for i in range(0 if not chunked else P - 1, P):
        handle.tok.copy_(prompt[i:i + 1])          # a device-side copy: no host round trip
        _launch(handle, start_pos + i, slot)


def generate(handle: DecoderHandle, prompt_tokens, n_new: int, start_pos: int = 0, return_logits: bool = False, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_ids=None,
             graph_block: int | None = None, prefill: bool | None = None, slot: int = 0):
    """Generation: consume ``prompt_tokens`` at positions ``start_pos, start_pos + 1, ...``, then
    generate ``n_new`` tokens. ``prefill``: the prompt but its last token in chunks of many rows a
    launch (``interp.rows.prefill``), or (False) one decode step each, the way every token after it
    runs; None: chunked on a GPU, one step a token on the CPU (under the Triton interpreter a launch
    costs its instruction count, and a rows launch has ~R times a one-row launch's). Then one launch
    per position, and the host only launches: each launch's ARGMAX (greedy) or SAMPLE leaves the next
    token on the device, where the next launch's EMBED reads it.

    prompt_tokens : 1-D integer tensor (any device: copied to the device once) or list of ints, >= 1 token
    temperature   : 0 (default): greedy, the handle's ARGMAX; > 0: SAMPLE draws each token from
                    softmax(logits / temperature), after ``top_k`` (0: off) and ``top_p`` (1: off)
                    as transformers' warpers define them, with Philox seeded by (``seed``, position);
                    needs ``build_decoder(..., sampling=True)``. Same seed and prompt: same tokens.
    eos_token_ids : an int or ints: stop after the first of them (it is returned); the host then
                    reads each token as it is made (``generate_stream``), one step ahead of the device
    graph_block   : on a GPU, the tokens after the prompt run as replays of a CUDA graph of this many
                    launches at the device's position (no host work between them; the handle keeps
                    the graph); greedy and sampling alike (SAMPLE reads its parameters and the
                    position on the device). None: 32 on a GPU, 0 (one host launch per token) on a
                    CPU, with ``return_logits``, with ``eos_token_ids`` (the host reads each token as
                    it comes, so graph blocks are off there, as in ``generate_stream``) or with
                    ``sync_check=True``; a number > 0 in those cases is an error. Same tokens either way.
    returns the (<= n_new,) int64 generated tokens on the device (and, with ``return_logits``, the
    (n_new, vocab) fp32 logits that chose them: a device-side copy after each launch; not with
    ``eos_token_ids``). Errors name the argument and come before anything runs.
    Positions used: ``start_pos .. start_pos + len(prompt) + n_new - 2`` (all < max_seq_len).
    slot          : the sequence slot of a ``build_decoder(..., batch=B)`` cache it runs on (its one-row
                    kernels are pointed at that slot; the others are untouched)
    """
    prompt, P, start_pos, eos = _generate_args(handle, prompt_tokens, n_new, start_pos, temperature, top_k, top_p,
                                               seed, eos_token_ids)
    slot = check_slot(handle, slot)
    if eos and return_logits:
        raise arg_error(ValueError, "return_logits", "False when eos_token_ids is given", return_logits)
    block = _graph_block(handle, graph_block, bool(return_logits), bool(eos))
    if eos:
        toks = list(_stream(handle, prompt, P, start_pos, n_new, eos, (temperature, top_k, top_p, seed),
                            _check_bool("prefill", prefill, handle), slot))
        return torch.tensor(toks, dtype=torch.int64).to(handle.device)
    hist = torch.empty(n_new, handle.cfg.vocab, dtype=torch.float32, device=handle.device) if return_logits else None
    first = start_pos + P - 1          # the position whose step makes new token 0
    with _stepping(handle):
        _run_prompt(handle, prompt, P, start_pos, temperature, top_k, top_p, seed, _check_bool("prefill", prefill, handle),
                    slot)
        if n_new and hist is not None:
            hist[0].copy_(handle.logits[0])
        # token j is made at position first + j: in each tape's run of positions, whole blocks as
        # graph replays at the device's position (the last call's + 1), then the rest one launch
        # each; EMBED reads the token the last ARGMAX / SAMPLE wrote
        j = 1
        while j < n_new:
            p = first + j
            end = first + n_new
            if handle.short is not None and p < handle.short_until:
                end = min(end, handle.short_until)
            blocks = (end - p) // block if block else 0
            if blocks:
                h = _pick(handle, -1)
                g = _block_graph(handle, h, block)
                for _ in range(blocks):
                    g.replay()
                j += blocks * block
                handle.next_pos = first + j
                h.last_pos = first + j - 1
                continue
            _launch(handle, p, slot)
            if hist is not None:
                hist[j].copy_(handle.logits[0])
            j += 1
    out = handle.toks[first:first + n_new].to(torch.int64)
    return (out, hist) if return_logits else out


def _graph_block(handle: DecoderHandle, graph_block, return_logits: bool, eos: bool) -> int:
    """``generate``'s graph_block, checked: the launches per CUDA-graph replay (0: none)."""
    off = handle.device.type != "cuda" or return_logits or eos or handle.layer.sync_check
    if graph_block is None:
        return 0 if off else 32
    if isinstance(graph_block, bool) or not isinstance(graph_block, int) or graph_block < 0:
        raise arg_error(ValueError if isinstance(graph_block, int) and not isinstance(graph_block, bool) else TypeError,
                        "graph_block", "an int >= 0 or None", describe(graph_block))
    if graph_block and off:
        raise arg_error(ValueError, "graph_block", "0 or None on a CPU, with return_logits, with eos_token_ids or with "
                        "sync_check=True (a CUDA graph replays launches with no host work between them)", graph_block)
    return graph_block


def _check_bool(name: str, v, handle=None) -> bool:
    """A bool argument; None (``prefill``): whether the handle is on a GPU."""
    if v is None and handle is not None:
        return handle.device.type == "cuda"
    if not isinstance(v, bool):
        raise arg_error(TypeError, name, "a bool" + (" or None" if handle is not None else ""), describe(v))
    return v


def generate_stream(handle: DecoderHandle, prompt_tokens, n_new: int, start_pos: int = 0, *,
                    temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                    eos_token_ids=None, prefill: bool | None = None, slot: int = 0):
    """``generate``, yielding each new token (a python int) as soon as the host has it; stops
    after ``n_new`` tokens or after an EOS id (yielded). The arguments are checked now, before
    anything runs; the launches happen as the iterator is consumed. After handing over token j the
    device is already computing token j + 1 (launched before the host waits for j), so the host
    never waits for a token it does not hand out; stopping early leaves that one launch done.
    One host launch per token: no CUDA-graph blocks here (``generate``'s ``graph_block``), since
    the host reads each token as it comes."""
    prompt, P, start_pos, eos = _generate_args(handle, prompt_tokens, n_new, start_pos, temperature, top_k, top_p,
                                               seed, eos_token_ids)
    return _stream(handle, prompt, P, start_pos, n_new, eos, (temperature, top_k, top_p, seed),
                   _check_bool("prefill", prefill, handle), check_slot(handle, slot))


def _stream(handle, prompt, P: int, start_pos: int, n_new: int, eos: frozenset, sampling: tuple, chunked: bool,
            slot: int = 0):
    # the handle is held per launch, not across the yields (the caller may step other handles)
    with _stepping(handle):
        _run_prompt(handle, prompt, P, start_pos, *sampling, chunked, slot)
    if n_new == 0:
        return
    first = start_pos + P - 1
    cuda = handle.device.type == "cuda"
    host = torch.empty(n_new, dtype=torch.int32, pin_memory=cuda)
    ready = torch.cuda.Event() if cuda else None
    for j in range(n_new):
        p = first + j
        host[j:j + 1].copy_(handle.toks[p:p + 1], non_blocking=cuda)
        if cuda:
            ready.record()
        if j + 1 < n_new:
            with _stepping(handle):
                _launch(handle, p + 1, slot)        # token j + 1 is computed while the host reads token j
        if cuda:
            ready.synchronize()
        t = int(host[j])
        yield t
        if t in eos:
            return


def teardown_decoder(handle: DecoderHandle) -> None:
    """Release the decoder's device buffers (idempotent)."""
    if not isinstance(handle, DecoderHandle):
        raise arg_error(TypeError, "handle", "a DecoderHandle from build_decoder", describe(handle))
    if handle.closed:
        return
    handle.graphs.clear()
    for h in (*handle.handles, *handle.rows.values()):
        runtime.teardown(h)
    handle.rows.clear()
    handle.closed = True
    handle.active = None
    handle.weights = None
    handle.tok = handle.toks = handle.x0 = handle.hidden = handle.logits = None
