"""The eager, unfused torch reference of one decode step: the spec's computation block.

Every correctness test compares against this. It follows the Hugging Face Llama
convention: RMSNorm in fp32 (``x * rsqrt(mean(x^2) + eps)``, cast back, times the weight),
rotate_half RoPE with fp32 cos/sin, K/V appended to the cache in place, softmax in fp32.

:func:`layer_ref` / :func:`model_ref` run one position of B sequences; :func:`layer_ref_rows` /
:func:`model_ref_rows` run R rows, each a (sequence slot, position) of a (B, n_kv, max_seq, hd)
cache: a prefill chunk, a batched decode step, or both in one step (issue 50).
"""
from __future__ import annotations

import math

import torch

from .config import ModelConfig

LAYER_KEYS = ("in_norm", "post_norm", "q", "k", "v", "o", "gate", "up", "down")


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    d = cfg.d
    return {"in_norm": (d,), "post_norm": (d,), "q": (cfg.q_dim, d), "k": (cfg.kv_dim, d),
            "v": (cfg.kv_dim, d), "o": (d, cfg.q_dim), "gate": (cfg.ffn, d), "up": (cfg.ffn, d),
            "down": (d, cfg.ffn)}


def make_weights(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict:
    """Random bf16 weights with the spec's layout, scaled so activations stay O(1)."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)      # generated where it will live (fast on a GPU)
    layers = []
    for _ in range(cfg.layers):
        lw = {}
        for name, shape in layer_shapes(cfg).items():
            if len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=device)
            else:
                t = torch.randn(shape, generator=g, device=device).mul_(1.0 / math.sqrt(shape[1]))
            lw[name] = t.to(torch.bfloat16)
            del t
        layers.append(lw)
    return {"layers": layers}


def make_kv_cache(cfg: ModelConfig, max_seq_len: int, prefill: int, seed: int = 1, device="cpu", batch: int = 1):
    """A list of ``cfg.layers`` (k, v) pairs, each (B, n_kv, max_seq_len, hd) bf16, prefilled with
    random values in ``[0, prefill)`` and zero beyond."""
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    cache = []
    for _ in range(cfg.layers):
        pair = []
        for _ in range(2):
            t = torch.zeros(batch, cfg.n_kv, max_seq_len, cfg.hd, dtype=torch.bfloat16, device=device)
            t[:, :, :prefill] = torch.randn(batch, cfg.n_kv, prefill, cfg.hd, generator=g,
                                            device=device).to(torch.bfloat16)
            pair.append(t)
        cache.append(tuple(pair))
    return cache


def llama3_inv_freq(inv_freq: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama 3.1 / 3.2's rescaling of the fp32 RoPE inverse frequencies: the same torch operations, in the
    same order and on the same Python scalar types, as transformers' ``_compute_llama3_parameters``
    (modeling_rope_utils.py), so the result is bit for bit the same. Wavelengths shorter than
    ``original_max_pos / high_freq_factor`` are kept, those longer than ``original_max_pos / low_freq_factor``
    are divided by ``factor``, and those between are interpolated."""
    factor = cfg.rope_factor
    low_freq_factor = cfg.rope_low_freq_factor
    high_freq_factor = cfg.rope_high_freq_factor
    old_context_len = cfg.rope_original_max_pos

    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def rope_tables(cfg: ModelConfig, max_seq_len: int, device="cpu"):
    """fp32 (cos, sin), each (max_seq_len, hd/2), exactly as HF Llama computes them (with
    ``cfg.rope_type`` "llama3", Llama 3.1 / 3.2's rescaled frequencies)."""
    inv_freq = 1.0 / (cfg.theta ** (torch.arange(0, cfg.hd, 2, dtype=torch.int64).float() / cfg.hd))
    if cfg.rope_type == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, cfg)
    elif cfg.rope_type != "default":
        raise ValueError(f"rope_tables: RoPE type {cfg.rope_type!r} is not implemented")
    t = torch.arange(max_seq_len, dtype=torch.int64).float()
    freqs = torch.outer(t, inv_freq)
    return freqs.cos().to(device), freqs.sin().to(device)


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return w * xf.to(x.dtype)


def rope(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half RoPE in fp32. t: (..., hd); cos/sin: (hd/2,) for this position, or (..., hd/2)
    broadcast against t's leading dims (one position per row: :func:`layer_ref_rows`)."""
    tf = t.float()
    h = tf.shape[-1] // 2
    t1, t2 = tf[..., :h], tf[..., h:]
    c = torch.cat([cos, cos], dim=-1).to(tf.device)
    s = torch.cat([sin, sin], dim=-1).to(tf.device)
    rot = torch.cat([-t2, t1], dim=-1)
    return (tf * c + rot * s).to(t.dtype)


def layer_ref(lw: dict, kv: tuple, cfg: ModelConfig, x: torch.Tensor, pos: int, cos_sin=None) -> torch.Tensor:
    """One decoder layer at position ``pos``. x: (B, d) bf16. Writes K/V at ``pos`` into ``kv``
    in place and returns the new residual stream (B, d) bf16."""
    B = x.shape[0]
    kc, vc = kv
    if cos_sin is None:
        cos_sin = rope_tables(cfg, pos + 1, device=x.device)
    cos, sin = cos_sin[0][pos], cos_sin[1][pos]
    h = rmsnorm(x, lw["in_norm"], cfg.eps)                       # (B, d)
    q = (h @ lw["q"].T).view(B, cfg.n_q, cfg.hd)
    k = (h @ lw["k"].T).view(B, cfg.n_kv, cfg.hd)
    v = (h @ lw["v"].T).view(B, cfg.n_kv, cfg.hd)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kc[:, :, pos] = k
    vc[:, :, pos] = v
    K = kc[:, :, : pos + 1].float()                               # (B, n_kv, T, hd)
    V = vc[:, :, : pos + 1].float()
    qg = q.float().view(B, cfg.n_kv, cfg.group, cfg.hd)          # GQA: group of query heads per KV head
    s = torch.einsum("bgqd,bgtd->bgqt", qg, K) / math.sqrt(cfg.hd)
    p = torch.softmax(s, dim=-1)
    a = torch.einsum("bgqt,bgtd->bgqd", p, V).reshape(B, cfg.q_dim).to(x.dtype)
    x = x + a @ lw["o"].T
    h = rmsnorm(x, lw["post_norm"], cfg.eps)
    mlp = (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
    return x + mlp


def model_ref(weights: dict, kv_cache: list, cfg: ModelConfig, x: torch.Tensor, pos: int, cos_sin=None):
    """All ``cfg.layers`` layers in sequence (no embedding, no LM head)."""
    for lw, kv in zip(weights["layers"], kv_cache):
        x = layer_ref(lw, kv, cfg, x, pos, cos_sin)
    return x


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp32 (the spec's metric)."""
    o, r = out.float(), ref.float()
    return (torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30)).item()


def model_ref_fp32(weights: dict, kv_cache32: list, cfg: ModelConfig, x: torch.Tensor, pos: int, cos_sin=None):
    """The same computation with every tensor in fp32 (weights upcast one layer at a time): the
    yardstick for how far a bf16 implementation, the reference included, is from exact arithmetic.
    ``kv_cache32`` is an fp32 copy of the cache, updated in place."""
    x = x.float()
    for lw, kv in zip(weights["layers"], kv_cache32):
        x = layer_ref({k: v.float() for k, v in lw.items()}, kv, cfg, x, pos, cos_sin)
    return x


# ---- many rows per step: each row a (sequence slot, position) -----------------------------------
#: rows of one slot whose attention one torch call computes (bounds the fp32 score block of a long
#: prefill chunk: rows x n_q x keys)
ATTN_ROWS = 256


def _int_list(name: str, v, R: int) -> list[int]:
    """``v`` (a 1-D integer tensor or a sequence of ints) as R Python ints, or a clear error."""
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise TypeError(f"{name} must hold integers, got a tensor of {v.dtype}")
        if v.dim() != 1:
            raise ValueError(f"{name} must be 1-D (one entry per row of x), got shape {tuple(v.shape)}")
        out = [int(e) for e in v.tolist()]
    elif isinstance(v, (list, tuple)):
        bad = [e for e in v if isinstance(e, bool) or not isinstance(e, int)]
        if bad:
            raise TypeError(f"{name} must hold ints, got {type(bad[0]).__name__} {bad[0]!r}")
        out = list(v)
    else:
        raise TypeError(f"{name} must be a 1-D integer tensor or a sequence of ints, got {type(v).__name__}")
    if len(out) != R:
        raise ValueError(f"{name} has {len(out)} entries, x has R = {R} rows (one {name} per row)")
    return out


def _check_layer_weights(name: str, lw, cfg: ModelConfig) -> None:
    if not isinstance(lw, dict):
        raise TypeError(f"{name} must be a dict of the layer's tensors, got {type(lw).__name__}")
    for k, shape in layer_shapes(cfg).items():
        if k not in lw:
            raise ValueError(f"{name} is missing {k!r} (a layer has {', '.join(LAYER_KEYS)})")
        t = lw[k]
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != shape:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}[{k!r}] has shape {got}, cfg implies {shape}")


def check_rows(cfg: ModelConfig, kv_cache: list, x: torch.Tensor, slots, pos, cos_sin=None,
               kv_name: str = "kv_cache", per_layer: bool = True) -> tuple[list[int], list[int]]:
    """Validate the inputs of one R-row step: ``x`` (R, d), every layer's ``(k, v)`` cache
    (B, n_kv, max_seq, hd), ``slots`` / ``pos`` R ints each in [0, B) / [0, max_seq), no two rows
    writing the same (slot, pos), and ``cos_sin`` (if given) covering every position. Returns
    (slots, pos) as Python lists; raises TypeError / ValueError naming the argument. Touches nothing.
    ``kv_name``: the cache's name in messages, ``kv_name[l]`` for layer l where ``per_layer``, else
    ``kv_name`` itself (one layer's ``(k, v)``)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor (R, d), got {type(x).__name__}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] != cfg.d:
        raise ValueError(f"x must be (R, d = {cfg.d}) with R >= 1 (one row per token), got shape {tuple(x.shape)}")
    if not x.dtype.is_floating_point:
        raise TypeError(f"x must be a floating-point tensor, got {x.dtype}")
    R = x.shape[0]
    if not isinstance(kv_cache, (list, tuple)) or not kv_cache:
        raise TypeError(f"{kv_name} must be a non-empty list of (k, v) pairs")
    shape = None
    for l, pair in enumerate(kv_cache):
        where = f"{kv_name}[{l}]" if per_layer else kv_name
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"{where} must be a (k, v) pair of tensors")
        for j, t in enumerate(pair):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{where}[{j}] must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4 or t.shape[1] != cfg.n_kv or t.shape[3] != cfg.hd:
                raise ValueError(f"{where}[{j}] must be (B, n_kv = {cfg.n_kv}, max_seq, hd = {cfg.hd}), "
                                 f"got shape {tuple(t.shape)}")
            if shape is None:
                shape = tuple(t.shape)
            elif tuple(t.shape) != shape:
                raise ValueError(f"{where}[{j}] has shape {tuple(t.shape)}, the first cache tensor has {shape} "
                                 "(every layer's k and v alike)")
            if t.device != x.device:
                raise ValueError(f"{where}[{j}] is on {t.device}, x on {x.device}")
    B, S = shape[0], shape[2]
    slots = _int_list("slots", slots, R)
    pos = _int_list("pos", pos, R)
    for r, (s, p) in enumerate(zip(slots, pos)):
        if not 0 <= s < B:
            raise ValueError(f"slots[{r}] = {s} is not a slot of the cache: {kv_name} holds B = {B} "
                             f"sequences, slots [0, {B})")
        if not 0 <= p < S:
            raise ValueError(f"pos[{r}] = {p} is past max_seq: {kv_name} holds positions [0, {S})"
                             if p >= S else f"pos[{r}] = {p} is negative")
    seen: dict[tuple[int, int], int] = {}
    for r, sp in enumerate(zip(slots, pos)):
        if sp in seen:
            raise ValueError(f"rows {seen[sp]} and {r} both write slot {sp[0]} position {sp[1]} "
                             "(slots, pos): each (slot, position) at most once a step")
        seen[sp] = r
    if cos_sin is not None:
        if not isinstance(cos_sin, (list, tuple)) or len(cos_sin) != 2 or \
                not all(isinstance(t, torch.Tensor) and t.dim() == 2 for t in cos_sin):
            raise TypeError("cos_sin must be a (cos, sin) pair of 2-D tensors (positions, hd/2)")
        for name, t in zip(("cos", "sin"), cos_sin):
            if t.shape[0] <= max(pos) or t.shape[1] != cfg.hd // 2:
                raise ValueError(f"cos_sin's {name} has shape {tuple(t.shape)}: it must cover positions "
                                 f"[0, {max(pos) + 1}) and hd/2 = {cfg.hd // 2} columns")
    return slots, pos


def _layer_rows(lw: dict, kv: tuple, cfg: ModelConfig, x: torch.Tensor, slots: list[int], pos: list[int],
                cos_sin) -> torch.Tensor:
    """:func:`layer_ref_rows` on validated inputs."""
    R = x.shape[0]
    kc, vc = kv
    sidx = torch.tensor(slots, dtype=torch.long, device=x.device)
    pidx = torch.tensor(pos, dtype=torch.long, device=x.device)
    cos = cos_sin[0][pidx.to(cos_sin[0].device)].unsqueeze(1)    # (R, 1, hd/2): each row its own position
    sin = cos_sin[1][pidx.to(cos_sin[1].device)].unsqueeze(1)
    h = rmsnorm(x, lw["in_norm"], cfg.eps)                       # (R, d)
    q = (h @ lw["q"].T).view(R, cfg.n_q, cfg.hd)
    k = (h @ lw["k"].T).view(R, cfg.n_kv, cfg.hd)
    v = (h @ lw["v"].T).view(R, cfg.n_kv, cfg.hd)
    q, k = rope(q, cos, sin), rope(k, cos, sin)
    kc[sidx, :, pidx] = k                                        # every row's K/V first, in place ...
    vc[sidx, :, pidx] = v
    a = torch.empty(R, cfg.q_dim, dtype=x.dtype, device=x.device)
    for s in dict.fromkeys(slots):                               # ... then each slot's rows attend to its keys
        rows_s = [r for r in range(R) if slots[r] == s]
        for i in range(0, len(rows_s), ATTN_ROWS):
            rows = rows_s[i:i + ATTN_ROWS]
            n = len(rows)
            ridx = torch.tensor(rows, dtype=torch.long, device=x.device)
            T = max(pos[r] for r in rows) + 1
            K = kc[s:s + 1, :, :T].float()                       # (1, n_kv, T, hd)
            V = vc[s:s + 1, :, :T].float()
            # the rows stacked along the query axis: (1, n_kv, n*group, hd), row-major in (row, group)
            # (one row: layer_ref's (1, n_kv, group, hd) exactly)
            qg = q[ridx].float().view(n, cfg.n_kv, cfg.group, cfg.hd).transpose(0, 1)
            qg = qg.reshape(1, cfg.n_kv, n * cfg.group, cfg.hd)
            sc = torch.einsum("bgqd,bgtd->bgqt", qg, K) / math.sqrt(cfg.hd)
            # row r sees keys [0, pos[r]]: rows of one slot at consecutive positions form a causal block
            lim = torch.tensor([pos[r] for r in rows], device=x.device).repeat_interleave(cfg.group)
            sc = sc.masked_fill(torch.arange(T, device=x.device)[None, :] > lim[:, None], float("-inf"))
            p = torch.softmax(sc, dim=-1)
            o = torch.einsum("bgqt,bgtd->bgqd", p, V)            # (1, n_kv, n*group, hd)
            a[ridx] = o.view(cfg.n_kv, n, cfg.group, cfg.hd).transpose(0, 1).reshape(n, cfg.q_dim).to(x.dtype)
    x = x + a @ lw["o"].T
    h = rmsnorm(x, lw["post_norm"], cfg.eps)
    mlp = (torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T
    return x + mlp


def layer_ref_rows(lw: dict, kv: tuple, cfg: ModelConfig, x: torch.Tensor, slots, pos, cos_sin=None) -> torch.Tensor:
    """One decoder layer over R rows, row r being token ``x[r]`` of sequence slot ``slots[r]`` at
    position ``pos[r]`` (chunked prefill: R consecutive positions of one slot; batched decode: one
    row a slot; or any mix). ``kv``: (k, v), each (B, n_kv, max_seq, hd). Every row's K/V is written
    into its (slot, position) in place first, then row r attends to its slot's keys [0, pos[r]].
    x: (R, d); slots, pos: R ints (a 1-D integer tensor or a sequence). Returns the new residual
    stream (R, d) in x's dtype. Bad inputs (shapes, a slot outside [0, B), a position past max_seq,
    two rows writing one (slot, position), cos_sin too short) raise before the cache is touched.

    With one row this is :func:`layer_ref` on the slot's (1, n_kv, max_seq, hd) view, the same
    torch operations on the same shapes. Rows of one slot share one masked attention block, which
    sums its softmax and P.V over the longest row's keys (the masked ones exact zeros): the same
    values as row-by-row, in another fp32 summation order."""
    cfg = ModelConfig.from_dict(cfg)
    _check_layer_weights("lw", lw, cfg)
    slots, pos = check_rows(cfg, [kv], x, slots, pos, cos_sin, kv_name="kv", per_layer=False)
    if cos_sin is None:
        cos_sin = rope_tables(cfg, max(pos) + 1, device=x.device)
    return _layer_rows(lw, kv, cfg, x, slots, pos, cos_sin)


def _check_model(weights, kv_cache, cfg: ModelConfig, name: str = "kv_cache") -> None:
    if not isinstance(weights, dict) or not isinstance(weights.get("layers"), (list, tuple)):
        raise TypeError("weights must be a dict with a list 'layers'")
    if not isinstance(kv_cache, (list, tuple)):
        raise TypeError(f"{name} must be a list of (k, v) pairs, one per layer")
    if len(weights["layers"]) != len(kv_cache):
        raise ValueError(f"{name} has {len(kv_cache)} layers, weights['layers'] has {len(weights['layers'])}")
    for l, lw in enumerate(weights["layers"]):
        _check_layer_weights(f"weights['layers'][{l}]", lw, cfg)


def model_ref_rows(weights: dict, kv_cache: list, cfg: ModelConfig, x: torch.Tensor, slots, pos, cos_sin=None):
    """Every layer of ``weights`` over R rows (:func:`layer_ref_rows`; no embedding, no LM head).
    ``kv_cache``: one (k, v) per layer, each (B, n_kv, max_seq, hd), written in place. Everything
    is validated before the first layer runs: on an error no layer's cache has been touched."""
    cfg = ModelConfig.from_dict(cfg)
    _check_model(weights, kv_cache, cfg)
    slots, pos = check_rows(cfg, kv_cache, x, slots, pos, cos_sin)
    if cos_sin is None:
        cos_sin = rope_tables(cfg, max(pos) + 1, device=x.device)
    for lw, kv in zip(weights["layers"], kv_cache):
        x = _layer_rows(lw, kv, cfg, x, slots, pos, cos_sin)
    return x


def model_ref_rows_fp32(weights: dict, kv_cache32: list, cfg: ModelConfig, x: torch.Tensor, slots, pos,
                        cos_sin=None):
    """:func:`model_ref_rows` with every tensor in fp32 (weights upcast one layer at a time), like
    :func:`model_ref_fp32`: ``kv_cache32`` is an fp32 copy of the cache, updated in place."""
    cfg = ModelConfig.from_dict(cfg)
    _check_model(weights, kv_cache32, cfg, "kv_cache32")
    slots, pos = check_rows(cfg, kv_cache32, x, slots, pos, cos_sin, kv_name="kv_cache32")
    if cos_sin is None:
        cos_sin = rope_tables(cfg, max(pos) + 1, device=x.device)
    x = x.float()
    for lw, kv in zip(weights["layers"], kv_cache32):
        x = _layer_rows({k: v.float() for k, v in lw.items()}, kv, cfg, x, slots, pos, cos_sin)
    return x
