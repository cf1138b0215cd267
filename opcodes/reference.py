"""The eager, unfused torch reference of one decode step: the spec's computation block.

Every correctness test compares against this. It follows the Hugging Face Llama
convention: RMSNorm in fp32 (``x * rsqrt(mean(x^2) + eps)``, cast back, times the weight),
rotate_half RoPE with fp32 cos/sin, K/V appended to the cache in place, softmax in fp32.
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
    """rotate_half RoPE in fp32. t: (..., hd); cos/sin: (hd/2,) for this position."""
    tf = t.float()
    h = tf.shape[-1] // 2
    t1, t2 = tf[..., :h], tf[..., h:]
    c = torch.cat([cos, cos]).to(tf.device)
    s = torch.cat([sin, sin]).to(tf.device)
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
