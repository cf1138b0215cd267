"""GPU benchmark baselines for megatape: what the megakernel is measured against.

Everything here targets an NVIDIA GPU (the lent H200), but every function
also runs on CPU with tiny configs so that a smoke test can exercise it without a GPU.

Rows this module can produce (see ``bench_table``):

* the floor: bytes per step / ``stream_copy_bandwidth`` (read + write counted);
* ``eager_step``: the spec's unfused eager reference (``opcodes.reference.model_ref``);
* ``compiled_step``: gpt-fast style ``torch.compile`` with the static KV cache as buffers,
  ``mode="reduce-overhead"`` (CUDA graphs; the bench rows use this one);
* ``cublas_gemv_graph``: the seven weight GEMVs of every layer alone in one CUDA graph.

Timing helpers: ``time_step`` (CUDA-event and synchronised wall-clock medians) and
``stream_copy_bandwidth`` come from the product (``megatape.measure``, re-exported here);
``count_kernels`` (GPU kernels per call and the largest kernel's share, via torch.profiler).

Works on torch 2.11 (the GPU box) and 2.13; Python 3.11+.
"""
from __future__ import annotations

import math
import time
import warnings
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F

from megatape.measure import stream_copy_bandwidth, time_step
from opcodes.config import ModelConfig
from opcodes.reference import LAYER_KEYS, model_ref, rope_tables

__all__ = [
    "stream_copy_bandwidth",
    "time_step",
    "count_kernels",
    "eager_step",
    "compiled_step",
    "cublas_gemv_graph",
    "bench_table",
]


def _cfg(cfg) -> ModelConfig:
    return cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(dict(cfg))


# ---------------------------------------------------------------------------------------
# counting kernels
# ---------------------------------------------------------------------------------------
_NON_KERNEL_PREFIXES = ("memcpy", "memset", "cudamemcpy", "cudamemset")


def _is_gpu_kernel(evt) -> bool:
    """True for a FunctionEvent that is a GPU kernel (not memcpy/memset/annotation/CPU op).

    torch >= ~2.12 FunctionEvents carry kineto's ``activity_type`` string ("kernel",
    "gpu_memcpy", "gpu_memset", "gpu_user_annotation", ...); older ones (2.11) do not, so we
    fall back to device_type == CUDA plus kineto's naming of copies ("Memcpy DtoD (Device ->
    Device)", "Memset (Device)") and the ``is_user_annotation`` flag."""
    from torch.autograd import DeviceType

    if getattr(evt, "device_type", None) != DeviceType.CUDA:
        return False
    at = getattr(evt, "activity_type", None)
    if isinstance(at, str) and at:
        return at.lower() in ("kernel", "concurrent_kernel", "gpu_kernel")
    if getattr(evt, "is_user_annotation", False):
        return False
    name = (getattr(evt, "name", "") or "").strip().lower()
    return not name.startswith(_NON_KERNEL_PREFIXES)


def _evt_duration_us(evt) -> float:
    tr = getattr(evt, "time_range", None)
    if tr is not None:
        return float(tr.end - tr.start)
    for attr in ("device_time", "cuda_time", "self_device_time_total", "self_cuda_time_total"):
        v = getattr(evt, attr, None)
        if v is not None:
            return float(v)
    return 0.0


def count_kernels(fn: Callable, args: tuple = (), warmup: int = 1, return_names: bool = False):
    """Run ``fn(*args)`` once under ``torch.profiler`` (CPU + CUDA activities) and return
    ``(n_kernels, dominant_share)``: the number of GPU kernel executions (memcpy / memset and
    annotations excluded; kernels replayed inside a CUDA graph count one by one) and the
    largest single kernel's share of their summed time. ``warmup`` untimed calls run first.

    Without CUDA (``torch.cuda.is_available()`` false) returns ``(0, 1.0)`` without calling
    ``fn``. With ``return_names`` a third element lists ``(name, us)`` of each kernel in
    launch order.
    """
    if not torch.cuda.is_available():
        return (0, 1.0, []) if return_names else (0, 1.0)
    from torch.profiler import ProfilerActivity, profile

    for _ in range(warmup):
        fn(*args)
    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # 2.11: "Profiler clears events at the end of each cycle"
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*args)
            torch.cuda.synchronize()
    kernels = [e for e in prof.events() if _is_gpu_kernel(e)]
    kernels.sort(key=lambda e: getattr(getattr(e, "time_range", None), "start", 0))
    durs = [_evt_duration_us(e) for e in kernels]
    n = len(kernels)
    total = sum(durs)
    share = (max(durs) / total) if n and total > 0 else (1.0 if n <= 1 else 0.0)
    if return_names:
        return n, share, [(e.name, d) for e, d in zip(kernels, durs)]
    return n, share


# ---------------------------------------------------------------------------------------
# 4a. eager reference
# ---------------------------------------------------------------------------------------
def eager_step(weights: dict, kv_cache: list, cfg) -> Callable:
    """``step(x, pos) -> x_out``: the spec's unfused eager reference, ``model_ref`` as is
    (it rebuilds the RoPE table each call, as the spec's reference does)."""
    cfg = _cfg(cfg)

    def step(x: torch.Tensor, pos: int) -> torch.Tensor:
        with torch.no_grad():
            return model_ref(weights, kv_cache, cfg, x, int(pos))

    return step


# ---------------------------------------------------------------------------------------
# 4b. torch.compile, gpt-fast style
# ---------------------------------------------------------------------------------------
class _Layer(torch.nn.Module):
    def __init__(self, lw: dict, kc: torch.Tensor, vc: torch.Tensor, cfg: ModelConfig):
        super().__init__()
        for name in LAYER_KEYS:
            self.register_buffer(name, lw[name], persistent=False)
        # the SAME tensors as the caller's cache: index_copy_ updates them in place
        self.register_buffer("k_cache", kc, persistent=False)
        self.register_buffer("v_cache", vc, persistent=False)
        self.n_q, self.n_kv, self.hd, self.group = cfg.n_q, cfg.n_kv, cfg.hd, cfg.group
        self.q_dim, self.eps = cfg.q_dim, float(cfg.eps)

    def _rmsnorm(self, x, w):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    @staticmethod
    def _rope(t, c, s):
        # t (B, H, hd); c, s (1, 1, hd) fp32 (cos/sin already duplicated to the full hd)
        tf = t.float()
        h = tf.shape[-1] // 2
        rot = torch.cat([-tf[..., h:], tf[..., :h]], dim=-1)
        return (tf * c + rot * s).to(t.dtype)

    def _attend(self, q, mask):
        """q (B, n_q, hd) bf16 -> (B, n_q, 1, hd) attention output (bf16) over the whole static
        cache with ``mask`` (1, 1, 1, max_seq) bool, True where key t <= pos: SDPA with
        ``enable_gqa=True`` (torch picks cuDNN attention on the H200)."""
        qh = q.view(q.shape[0], self.n_q, 1, self.hd)
        return F.scaled_dot_product_attention(qh, self.k_cache, self.v_cache, attn_mask=mask,
                                              scale=1.0 / math.sqrt(self.hd), enable_gqa=True)

    def _attention(self, x, input_pos, c, s, mask):
        """RMSNorm, q / k / v, RoPE, the K/V row written at ``input_pos``, attention: (B, q_dim),
        before the O projection."""
        B = x.shape[0]
        h = self._rmsnorm(x, self.in_norm)
        q = F.linear(h, self.q).view(B, self.n_q, self.hd)
        k = F.linear(h, self.k).view(B, self.n_kv, self.hd)
        v = F.linear(h, self.v).view(B, self.n_kv, self.hd)
        q, k = self._rope(q, c, s), self._rope(k, c, s)
        self.k_cache.index_copy_(2, input_pos, k.unsqueeze(2))
        self.v_cache.index_copy_(2, input_pos, v.unsqueeze(2))
        return self._attend(q, mask).reshape(B, self.q_dim)

    def _mlp(self, x):
        """The SwiGLU MLP of the post-attention RMSNorm of ``x``, before the residual add."""
        h = self._rmsnorm(x, self.post_norm)
        return F.linear(F.silu(F.linear(h, self.gate)) * F.linear(h, self.up), self.down)

    def forward(self, x, input_pos, c, s, mask):
        x = x + F.linear(self._attention(x, input_pos, c, s, mask), self.o)
        return x + self._mlp(x)


class _Model(torch.nn.Module):
    def __init__(self, weights: dict, kv_cache: list, cfg: ModelConfig, max_seq_len: int, device):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            _Layer(lw, kc, vc, cfg) for lw, (kc, vc) in zip(weights["layers"], kv_cache))
        cos, sin = rope_tables(cfg, max_seq_len, device=device)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1).contiguous(), persistent=False)
        self.register_buffer("sin", torch.cat([sin, sin], dim=-1).contiguous(), persistent=False)
        self.register_buffer("seq", torch.arange(max_seq_len, device=device, dtype=torch.int64),
                             persistent=False)

    def forward(self, x, input_pos):
        c = self.cos[input_pos].view(1, 1, -1)          # (1, 1, hd) fp32
        s = self.sin[input_pos].view(1, 1, -1)
        mask = (self.seq <= input_pos).view(1, 1, 1, -1)   # static (1,1,1,max_seq) bool
        for layer in self.layers:
            x = layer(x, input_pos, c, s, mask)
        return x


def compiled_step(weights: dict, kv_cache: list, cfg, max_seq_len: int, mode: str | None = "reduce-overhead",
                  backend: str = "inductor", fullgraph: bool = True, do_compile: bool = True) -> Callable:
    """``step(x, pos) -> x_out`` through ``torch.compile`` in the gpt-fast style.

    An ``nn.Module`` holds the weights and the caller's KV cache tensors as buffers (the same
    tensors, so ``index_copy_`` at ``input_pos`` updates the caller's cache in place), fp32 RoPE
    tables indexed by ``input_pos``, and attends over the whole ``max_seq_len`` cache with a
    ``seq <= pos`` mask so every shape is static. ``pos`` goes in through a persistent int64
    device tensor refilled each call (no recompiles). Compiled with
    ``torch.compile(mode=mode, fullgraph=True, dynamic=False)``; ``backend != "inductor"`` (e.g.
    ``"eager"`` for a fast CPU smoke test) ignores ``mode``; ``do_compile=False`` runs the module
    uncompiled. The output is cloned, since CUDA graphs reuse their output memory.

    Attention is SDPA on q (B, n_q, 1, hd) with ``enable_gqa=True`` over the static cache (torch
    picks cuDNN attention on the H200, ~11 us + a 3 us reduction). Measured on the H200 (torch 2.11,
    spec layer, pos 4096..4127, reduce-overhead): 458 us, 20 kernels (floor 405 us); the other
    attention formulations tried (K/V repeated to every query head as in gpt-fast, the group as
    SDPA's query axis, the reference's fp32 matmuls left to inductor) measured 534-556 us and
    were removed (bench/NOTES.md; the code is in the history, ebe4133).
        """
    cfg = _cfg(cfg)
    kc0 = kv_cache[0][0]
    device = kc0.device
    if kc0.shape[2] != max_seq_len:
        raise ValueError(f"kv_cache time axis is {kc0.shape[2]}, max_seq_len is {max_seq_len}")
    if len(weights["layers"]) != cfg.layers or len(kv_cache) != cfg.layers:
        raise ValueError(f"cfg.layers={cfg.layers} but got {len(weights['layers'])} weight layers "
                         f"and {len(kv_cache)} cache layers")
    model = _Model(weights, kv_cache, cfg, max_seq_len, device).eval()
    input_pos = torch.zeros(1, dtype=torch.int64, device=device)
    if not do_compile:
        fwd = model
    elif backend == "inductor":
        fwd = torch.compile(model, mode=mode, fullgraph=fullgraph, dynamic=False)
    else:
        fwd = torch.compile(model, backend=backend, fullgraph=fullgraph, dynamic=False)
    # reduce-overhead and max-autotune both use CUDA graph trees; marking a step is harmless
    # elsewhere, and we clone the output anyway
    use_graphs = do_compile and backend == "inductor" and device.type == "cuda"
    mark = getattr(getattr(torch, "compiler", None), "cudagraph_mark_step_begin", None)

    def step(x: torch.Tensor, pos: int) -> torch.Tensor:
        input_pos.fill_(int(pos))
        with torch.no_grad():
            if use_graphs and mark is not None:
                mark()
            out = fwd(x, input_pos)
        return out.clone()

    step.module = model          # for inspection
    step.input_pos = input_pos
    return step


# ---------------------------------------------------------------------------------------
# 4c. the weight GEMVs alone, one CUDA graph
# ---------------------------------------------------------------------------------------
_GEMV_KEYS = ("q", "k", "v", "o", "gate", "up", "down")


def cublas_gemv_graph(weights: dict, cfg, use_mv: bool = True) -> Callable:
    """A callable (arguments ignored) that streams every layer's seven weight matrices through
    cuBLAS GEMVs — q, k, v, gate, up from a (d,) vector, o from a (n_q*hd,) vector, down from a
    (ffn,) vector — with no norm, no attention and no data dependency between them, all captured
    in ONE ``torch.cuda.CUDAGraph`` and replayed per call (7 * layers kernels). ``use_mv``:
    ``torch.mv(W, x, out=...)``; otherwise ``x @ W.T`` on (1, n) rows. On CPU the GEMVs run
    eagerly. Returns the last output (the ``down`` product of the last layer)."""
    cfg = _cfg(cfg)
    layers = weights["layers"]
    device = layers[0]["q"].device
    dtype = layers[0]["q"].dtype
    g = torch.Generator(device="cpu").manual_seed(0)
    ins = {n: torch.randn(n_, generator=g).to(dtype=dtype, device=device)
           for n, n_ in (("d", cfg.d), ("qd", cfg.q_dim), ("ffn", cfg.ffn))}
    src = {"q": "d", "k": "d", "v": "d", "o": "qd", "gate": "d", "up": "d", "down": "ffn"}
    outs = [{k: torch.empty(lw[k].shape[0], dtype=dtype, device=device) for k in _GEMV_KEYS}
            for lw in layers]

    def run_all():
        for lw, ob in zip(layers, outs):
            for key in _GEMV_KEYS:
                xv = ins[src[key]]
                if use_mv:
                    torch.mv(lw[key], xv, out=ob[key])
                else:
                    ob[key].copy_((xv.view(1, -1) @ lw[key].T).view(-1))
        return outs[-1]["down"]

    if device.type != "cuda":
        def eager(*_a, **_k):
            with torch.no_grad():
                return run_all()
        return eager

    with torch.no_grad():
        s = torch.cuda.Stream(device=device)
        s.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(s):
            for _ in range(3):   # warm up cuBLAS (workspace, heuristics) off the capture
                run_all()
        torch.cuda.current_stream(device).wait_stream(s)
        torch.cuda.synchronize(device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            last = run_all()
    torch.cuda.synchronize(device)

    def replay(*_a, **_k):
        graph.replay()
        return last

    replay.graph = graph
    replay.buffers = (ins, outs)
    return replay


# ---------------------------------------------------------------------------------------
# 5. the table
# ---------------------------------------------------------------------------------------
_COLS = (("name", "name", None), ("us_event", "us/step (event)", "{:.1f}"),
         ("us_wall", "us/step (wall)", "{:.1f}"), ("tokens_s", "tokens/s", "{:.0f}"),
         ("x_floor", "x floor", "{:.2f}"), ("kernels", "kernels/step", "{}"),
         ("dominant", "dominant share", "{:.3f}"))


def _fmt(v: Any, spec: str | None) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if spec is None or isinstance(v, str):
        return str(v)
    try:
        return spec.format(v)
    except (ValueError, TypeError):
        return str(v)


def bench_table(rows: Sequence[dict]) -> str:
    """An aligned markdown table of ``rows`` (dicts with keys name, us_event, us_wall, tokens_s,
    x_floor, kernels, dominant; missing or None values print as ``-``)."""
    header = [h for _, h, _ in _COLS]
    body = [[_fmt(r.get(k), spec) for k, _, spec in _COLS] for r in rows]
    widths = [max(len(header[i]), *(len(b[i]) for b in body)) if body else len(header[i])
              for i in range(len(_COLS))]

    def line(cells):
        out = []
        for i, c in enumerate(cells):
            out.append(c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]))
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join(("-" * (w + 1) + ":") if i else ("-" * (w + 2))
                         for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), sep] + [line(b) for b in body])


def hf_generate_us(cfg, device, pos: int, n_new: int = 32, compile: bool = True, seed: int = 0,
                   reps: int = 5) -> float:
    """transformers' greedy ``generate`` with a static cache (and ``torch.compile`` of the forward,
    mode reduce-overhead, as transformers documents for it) on a randomly initialised
    ``LlamaForCausalLM`` of ``cfg``'s shape: microseconds per generated token after a ``pos``-token
    prompt, by wall clock, as the difference of the fastest of ``reps`` runs of ``2 * n_new`` and of
    ``n_new`` new tokens (alternated, after a warm-up of each), so the prompt and the setup cancel; a
    busy host only adds time to a run, so the fastest is the least disturbed (the medians' difference
    came out at or below 0 on a loaded 2-core CI machine). A difference that is not positive raises
    RuntimeError: the host was too noisy to time ``n_new`` tokens, and no number is better than 0."""
    from interp.hf import hf_config_kwargs, random_llama_on
    kw = hf_config_kwargs(cfg)
    kw["max_position_embeddings"] = max(kw["max_position_embeddings"], pos + 2 * n_new + 8)
    model = random_llama_on(kw, device, seed)
    if compile:
        model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
    ids = torch.randint(0, cfg.vocab, (1, pos), generator=torch.Generator().manual_seed(seed + 1)).to(device)
    cuda = torch.device(device).type == "cuda"

    def run(n: int) -> float:
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, cache_implementation="static", pad_token_id=0, eos_token_id=None)
        if cuda:
            torch.cuda.synchronize()
        assert out.shape[1] == pos + n, f"generate made {out.shape[1] - pos} tokens, not {n}"
        return time.perf_counter() - t0

    for n in (n_new, 2 * n_new):          # warm-up (and compile) for both lengths
        run(n)
    times = [(run(n_new), run(2 * n_new)) for _ in range(reps)]
    short = min(t[0] for t in times)
    long = min(t[1] for t in times)
    if long <= short:
        raise RuntimeError(f"hf_generate_us: {2 * n_new} new tokens took no longer than {n_new} ({long * 1e3:.2f} "
                           f"against {short * 1e3:.2f} ms, the fastest of {reps} runs each): the host is too busy "
                           f"to time {n_new} tokens")
    return (long - short) / n_new * 1e6
