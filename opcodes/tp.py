"""Tensor parallelism, host side: how a model is cut across ``tp_size`` GPUs, and the eager torch
reference of what a TP decode step computes (the TP reference).

Rank ``r`` of ``T`` holds (Megatron-style; no kernel, tape or schedule here yet):

* ``q``: the rows of its query heads ``[r*n_q/T, (r+1)*n_q/T)``; ``k`` and ``v``: the rows of its KV
  heads ``[r*n_kv/T, (r+1)*n_kv/T)``. With ``g = n_q/n_kv`` query heads per KV head (query head ``i``
  reads KV head ``i // g``, as in ``layer_ref``), the rank's query heads are exactly the groups of its
  KV heads, so attention needs nothing from another rank.
* ``o``: the input columns of its query heads (each rank makes a partial O projection, summed across ranks).
* ``gate`` / ``up``: output rows ``[r*ffn/T, (r+1)*ffn/T)``; ``down``: the same slice of input columns
  (a partial MLP output, summed across ranks).
* ``in_norm`` / ``post_norm`` / ``final_norm`` / ``embed``: replicated (every rank embeds the token and
  keeps the whole residual stream).
* ``lm_head``: vocabulary rows ``[r*vocab/T, (r+1)*vocab/T)``; the logits are the ranks' slices
  concatenated, and the greedy token is a cross-rank argmax reduction (:func:`tp_argmax`).
* the KV cache: the rank's KV heads (:func:`shard_kv_cache`).

``tp_size`` must divide ``n_kv`` (hence ``n_q``), ``ffn`` and, for a whole model, ``vocab``.

:func:`shard_config` gives the rank's :class:`ModelConfig` (``n_q``, ``n_kv``, ``ffn`` per rank;
``layers``, ``d``, ``hd``, ``vocab``, RoPE and eps as the full model's: ``vocab`` stays the full
vocabulary, the token ids ``embed`` reads, while the rank's ``lm_head`` has ``vocab/T`` rows).
:class:`TPShard` names the slices. :func:`shard_weights` cuts a full weights dict; split tensors come
back as fresh contiguous row-major tensors (a shard never aliases the full weights), replicated ones
are the same tensor objects; with ``tp_size`` 1 it returns the weights' own tensors. Both it and
``interp.hf.load_hf_llama(..., tp_rank, tp_size)`` add ``weights["tp"] = {"rank", "size", "full"}``
(``full``: the full model's cfg dict) when ``tp_size > 1``.

The TP reference (:func:`tp_layer_ref`, :func:`tp_model_ref`, :func:`tp_decoder_ref`,
:func:`tp_argmax`) runs every rank's shard in turn and combines them as the TP kernel must: each
rank's O-projection partial and down-projection partial in fp32, the all-reduce a sum of the
ranks' partials in rank order 0, 1, ..., ``T-1`` in fp32, added once to the residual and rounded to
the residual's dtype; the logits concatenated in rank order; the greedy token the largest logit,
ties to the lowest vocabulary index (the lowest rank, then its lowest local index). In fp32 it
equals ``layer_ref`` / ``decoder_ref`` within fp32 rounding (the sums are regrouped); in bf16 it
differs from them by where the residual is rounded (once per all-reduce instead of once per matmul).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from .base import Layout, register_layout
from .tiling import Tiling
from .config import ModelConfig
from .decoder import DecoderLayout
from .reference import LAYER_KEYS, layer_shapes, rmsnorm, rope, rope_tables

#: per-layer key -> how it is split: "rows" (output rows), "cols" (input columns) or None (replicated)
LAYER_SPLIT = {"in_norm": None, "post_norm": None, "q": "rows", "k": "rows", "v": "rows", "o": "cols",
               "gate": "rows", "up": "rows", "down": "cols"}
#: whole-model key -> how it is split
MODEL_SPLIT = {"embed": None, "final_norm": None, "lm_head": "rows"}


def _check_int(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")


@dataclass(frozen=True)
class TPShard:
    """Rank ``rank`` of ``size``: which slice of a model it holds. The slice methods take the
    **full** model's config and return ``(start, stop)``."""

    rank: int
    size: int

    def __post_init__(self):
        _check_int("tp_size", self.size)
        _check_int("tp_rank", self.rank)
        if self.size < 1:
            raise ValueError(f"tp_size must be >= 1, got {self.size}")
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp_rank must be in [0, tp_size) = [0, {self.size}), got {self.rank}")

    def _part(self, n: int) -> tuple[int, int]:
        k = n // self.size
        return self.rank * k, (self.rank + 1) * k

    def q_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        return self._part(cfg.n_q)

    def kv_heads(self, cfg: ModelConfig) -> tuple[int, int]:
        return self._part(cfg.n_kv)

    def q_rows(self, cfg: ModelConfig) -> tuple[int, int]:
        """Rows of ``q`` (columns of ``o``): the rank's query heads times ``hd``."""
        a, b = self.q_heads(cfg)
        return a * cfg.hd, b * cfg.hd

    def kv_rows(self, cfg: ModelConfig) -> tuple[int, int]:
        """Rows of ``k`` and ``v``: the rank's KV heads times ``hd``."""
        a, b = self.kv_heads(cfg)
        return a * cfg.hd, b * cfg.hd

    def ffn_slice(self, cfg: ModelConfig) -> tuple[int, int]:
        """Rows of ``gate`` / ``up``, columns of ``down``."""
        return self._part(cfg.ffn)

    def vocab_slice(self, cfg: ModelConfig) -> tuple[int, int]:
        """Rows of ``lm_head``: the vocabulary ids whose logits the rank computes."""
        return self._part(cfg.vocab)

    def layer_slices(self, cfg: ModelConfig) -> dict[str, tuple[int, int] | None]:
        """Per-layer key -> the ``(start, stop)`` of its split dimension (``LAYER_SPLIT``), None if replicated."""
        sl = {"q": self.q_rows(cfg), "k": self.kv_rows(cfg), "v": self.kv_rows(cfg), "o": self.q_rows(cfg),
              "gate": self.ffn_slice(cfg), "up": self.ffn_slice(cfg), "down": self.ffn_slice(cfg)}
        return {k: sl.get(k) for k in LAYER_KEYS}


def check_tp(cfg, tp_rank, tp_size) -> tuple[ModelConfig, TPShard]:
    """``(ModelConfig, TPShard)`` after checking that ``tp_size`` divides what it must split.
    Errors name the argument: ``tp_rank`` / ``tp_size`` (TypeError for a non-int, ValueError otherwise)."""
    mc = ModelConfig.from_dict(cfg)
    sh = TPShard(tp_rank, tp_size)
    T = sh.size
    for key in ("n_kv", "ffn") + (("vocab",) if mc.vocab else ()):
        n = getattr(mc, key)
        if n % T:
            extra = " (each rank holds whole KV heads and their query heads)" if key == "n_kv" else ""
            raise ValueError(f"tp_size = {T} must divide cfg[{key!r}] = {n}{extra}")
    # n_q = n_kv * group, so T | n_kv gives T | n_q and the rank's query heads are the groups of its KV heads
    qa, qb = sh.q_heads(mc)
    ka, kb = sh.kv_heads(mc)
    if (qa, qb) != (ka * mc.group, kb * mc.group):          # cannot happen while ModelConfig checks n_kv | n_q
        raise AssertionError(f"rank {sh.rank}: query heads [{qa}, {qb}) are not the groups of KV heads [{ka}, {kb})")
    return mc, sh


def shard_config(cfg, tp_rank: int, tp_size: int) -> ModelConfig:
    """The config of rank ``tp_rank``'s shard: ``n_q``, ``n_kv`` and ``ffn`` divided by ``tp_size``,
    everything else (``vocab`` included: see the module docstring) as ``cfg``."""
    mc, sh = check_tp(cfg, tp_rank, tp_size)
    if sh.size == 1:
        return mc
    T = sh.size
    return dataclasses.replace(mc, n_q=mc.n_q // T, n_kv=mc.n_kv // T, ffn=mc.ffn // T,
                               name=f"{mc.name}-tp{sh.rank}of{T}")


def _take(t: torch.Tensor, how: str | None, sl: tuple[int, int] | None) -> torch.Tensor:
    """``t``'s rows (``how="rows"``) or columns (``"cols"``) ``sl`` as a fresh contiguous tensor;
    ``t`` itself when replicated or when the slice is all of it."""
    if how is None:
        return t
    a, b = sl
    dim = 0 if how == "rows" else 1
    if (a, b) == (0, t.shape[dim]):
        return t
    view = t[a:b] if dim == 0 else t[:, a:b]
    out = torch.empty(view.shape, dtype=t.dtype, device=t.device)
    return out.copy_(view)


def _check_shape(name: str, t, shape) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} has shape {tuple(t.shape)}, the full model's cfg implies {tuple(shape)} "
                         "(shard_weights takes the full weights and the full cfg)")


def shard_weights(weights: dict, cfg, tp_rank: int, tp_size: int) -> dict:
    """Rank ``tp_rank``'s shard of the full ``weights`` (``{"layers": [...]}`` and, for a whole model,
    ``"embed"``, ``"final_norm"``, ``"lm_head"``) of the full model ``cfg``: see the module docstring.
    A tied ``lm_head`` (the ``embed`` tensor itself) becomes the vocabulary slice of ``embed``."""
    mc, sh = check_tp(cfg, tp_rank, tp_size)
    if not isinstance(weights, dict) or "layers" not in weights:
        raise TypeError("weights must be a dict with key 'layers'")
    if "tp" in weights:
        raise ValueError(f"weights is already a shard (weights['tp'] = {weights['tp']!r}); shard_weights takes "
                         "the full weights")
    unknown = set(weights) - {"layers"} - set(MODEL_SPLIT)
    if unknown:
        raise ValueError(f"weights has unknown keys {sorted(unknown)}; known keys are "
                         f"{['layers', *MODEL_SPLIT]}")
    layers = weights["layers"]
    if len(layers) != mc.layers:
        raise ValueError(f"weights['layers'] has {len(layers)} layers, cfg['layers'] = {mc.layers}")
    shapes, slices = layer_shapes(mc), sh.layer_slices(mc)
    out_layers = []
    for l, lw in enumerate(layers):
        missing = [k for k in LAYER_KEYS if k not in lw]
        if missing:
            raise ValueError(f"weights['layers'][{l}] is missing {missing}")
        olw = {}
        for k in LAYER_KEYS:
            _check_shape(f"weights['layers'][{l}][{k!r}]", lw[k], shapes[k])
            olw[k] = _take(lw[k], LAYER_SPLIT[k], slices[k])
        out_layers.append(olw)
    out = {"layers": out_layers}
    model_keys = [k for k in MODEL_SPLIT if k in weights]
    if model_keys and not mc.vocab:
        raise ValueError(f"weights has {model_keys} but cfg has no 'vocab'")
    full = {"embed": (mc.vocab, mc.d), "final_norm": (mc.d,), "lm_head": (mc.vocab, mc.d)}
    for k in model_keys:
        _check_shape(f"weights[{k!r}]", weights[k], full[k])
        out[k] = _take(weights[k], MODEL_SPLIT[k], sh.vocab_slice(mc) if MODEL_SPLIT[k] else None)
    if sh.size > 1:
        out["tp"] = {"rank": sh.rank, "size": sh.size, "full": dict(cfg) if isinstance(cfg, dict) else mc.to_dict()}
    return out


def shard_kv_cache(kv_cache: list, cfg, tp_rank: int, tp_size: int) -> list:
    """Rank ``tp_rank``'s KV cache: of each layer's ``(k, v)``, each ``(B, n_kv, S, hd)``, the rank's KV
    heads ``(B, n_kv/T, S, hd)`` as fresh contiguous tensors (the list itself when ``tp_size`` is 1)."""
    mc, sh = check_tp(cfg, tp_rank, tp_size)
    if len(kv_cache) != mc.layers:
        raise ValueError(f"kv_cache has {len(kv_cache)} layers, cfg['layers'] = {mc.layers}")
    if sh.size == 1:
        return kv_cache
    a, b = sh.kv_heads(mc)
    out = []
    for l, pair in enumerate(kv_cache):
        sp = []
        for j, t in enumerate(pair):
            if t.dim() != 4 or t.shape[1] != mc.n_kv or t.shape[3] != mc.hd:
                raise ValueError(f"kv_cache[{l}][{j}] has shape {tuple(t.shape)}, expected (B, n_kv = {mc.n_kv}, S, "
                                 f"hd = {mc.hd})")
            sp.append(torch.empty(t[:, a:b].shape, dtype=t.dtype, device=t.device).copy_(t[:, a:b]))
        out.append(tuple(sp))
    return out


# ---- the TP reference ------------------------------------------------------------------------------
def _all_reduce(x: torch.Tensor, partials: list[torch.Tensor]) -> torch.Tensor:
    """The residual plus the fp32 sum of the ranks' partials in rank order, rounded to x's dtype."""
    s = partials[0].float()
    for p in partials[1:]:
        s = s + p.float()
    return (x.float() + s).to(x.dtype)


def tp_layer_ref(shard_layers: list[dict], shard_kv: list[tuple], cfg, x: torch.Tensor, pos: int,
                 cos_sin=None) -> torch.Tensor:
    """One decoder layer run as ``T = len(shard_layers)`` ranks: ``shard_layers[r]`` is rank r's layer dict
    (``shard_weights(...)["layers"][l]``), ``shard_kv[r]`` its ``(k, v)`` (``shard_kv_cache``), written at
    ``pos`` in place; ``cfg`` the **full** model's config. x: (B, d), the residual every rank holds.
    Returns the new residual (B, d) in x's dtype (the all-reduce semantics: module docstring)."""
    T = len(shard_layers)
    if len(shard_kv) != T:
        raise ValueError(f"shard_kv has {len(shard_kv)} ranks, shard_layers has {T}")
    sc = shard_config(cfg, 0, T)
    B = x.shape[0]
    if cos_sin is None:
        cos_sin = rope_tables(sc, pos + 1, device=x.device)
    cos, sin = cos_sin[0][pos], cos_sin[1][pos]
    parts = []
    for lw, (kc, vc) in zip(shard_layers, shard_kv):
        h = rmsnorm(x, lw["in_norm"], sc.eps)
        q = rope((h @ lw["q"].T).view(B, sc.n_q, sc.hd), cos, sin)
        k = rope((h @ lw["k"].T).view(B, sc.n_kv, sc.hd), cos, sin)
        v = (h @ lw["v"].T).view(B, sc.n_kv, sc.hd)
        kc[:, :, pos] = k
        vc[:, :, pos] = v
        K, V = kc[:, :, : pos + 1].float(), vc[:, :, : pos + 1].float()
        qg = q.float().view(B, sc.n_kv, sc.group, sc.hd)
        p = torch.softmax(torch.einsum("bgqd,bgtd->bgqt", qg, K) / math.sqrt(sc.hd), dim=-1)
        a = torch.einsum("bgqt,bgtd->bgqd", p, V).reshape(B, sc.q_dim).to(x.dtype)
        parts.append((a @ lw["o"].T).float())
    x = _all_reduce(x, parts)
    parts = []
    for lw in shard_layers:
        h = rmsnorm(x, lw["post_norm"], sc.eps)
        parts.append(((torch.nn.functional.silu(h @ lw["gate"].T) * (h @ lw["up"].T)) @ lw["down"].T).float())
    return _all_reduce(x, parts)


def tp_model_ref(shards: list[dict], shard_caches: list[list], cfg, x: torch.Tensor, pos: int, cos_sin=None):
    """All layers (no embedding, no LM head) as ``len(shards)`` ranks; ``shards[r]`` rank r's weights,
    ``shard_caches[r]`` its KV cache."""
    for l in range(len(shards[0]["layers"])):
        x = tp_layer_ref([s["layers"][l] for s in shards], [c[l] for c in shard_caches], cfg, x, pos, cos_sin)
    return x


def tp_decoder_ref(shards: list[dict], shard_caches: list[list], cfg, token: int, pos: int, cos_sin=None):
    """One whole-model decode step as ``len(shards)`` ranks (the TP form of ``opcodes.decoder.decoder_ref``):
    every rank embeds ``token`` (rank 0's ``embed``; they are the same), runs the layers, the final norm
    and its ``lm_head`` slice. Returns the fp32 logits (1, vocab): the ranks' slices concatenated."""
    x = shards[0]["embed"][int(token)].reshape(1, -1)
    h = tp_model_ref(shards, shard_caches, cfg, x, pos, cos_sin)
    h = rmsnorm(h, shards[0]["final_norm"], ModelConfig.from_dict(cfg).eps)
    return torch.cat([h.float() @ s["lm_head"].float().T for s in shards], dim=-1)


def tp_argmax(rank_logits: list[torch.Tensor]) -> int:
    """The greedy token from the ranks' logits slices (rank r's covers vocabulary ids from
    ``sum(len of ranks < r)``): each rank's max and its first index, then the largest max, ties to the
    lowest rank. Equals ``greedy_token`` of the concatenated logits (ties to the lowest index)."""
    best, best_id, off = None, None, 0
    for lg in rank_logits:
        lg = lg.reshape(-1)
        i = int(torch.argmax(lg))
        v = lg[i].item()
        if best is None or v > best:
            best, best_id = v, off + i
        off += lg.numel()
    return best_id


# ---- the rank's layout (tensor-parallel tapes) -----------------------------------------------------


@register_layout
@dataclass(frozen=True)
class TPLayout(Layout):
    """The layout of rank ``tp_rank`` of ``tp_size`` in a tensor-parallel tape: ``cfg`` is the rank's
    shard (:func:`shard_config` of the full model), the weights and KV cache the tape's opcodes index
    are the rank's (:func:`shard_weights`, :func:`shard_kv_cache`). The O projection always writes
    partials (:attr:`o_partial`): TP_PUSH sends the rank's partial of a row block to the peer, and
    TP_REDUCE adds rank 0's and rank 1's partials in that order to the residual on both ranks.
    Tapes exist for ``tp_size == 2`` only (one peer)."""

    tp_rank: int = 0
    tp_size: int = 2

    def __post_init__(self):
        super().__post_init__()
        TPShard(self.tp_rank, self.tp_size)          # checks the ints and the range
        if self.tp_size != 2:
            raise ValueError(f"TPLayout: tensor-parallel tapes need tp_size = 2 (one peer), got {self.tp_size}")

    @property
    def o_partial(self) -> bool:
        return True

    @property
    def peer(self) -> int:
        return 1 - self.tp_rank

    @property
    def full_cfg(self) -> ModelConfig:
        """The full (unsharded) model's config."""
        T = self.tp_size
        name = self.cfg.name.rsplit(f"-tp{self.tp_rank}of{T}", 1)[0]
        return dataclasses.replace(self.cfg, n_q=self.cfg.n_q * T, n_kv=self.cfg.n_kv * T, ffn=self.cfg.ffn * T,
                                   name=name)

    def extra(self) -> dict:
        return {"tp_rank": self.tp_rank, "tp_size": self.tp_size}

    @classmethod
    def of(cls, cfg, tp_rank: int, tp_size: int, tiling=None, max_seq: int = 256) -> "TPLayout":
        """Rank ``tp_rank``'s layout of the full model ``cfg`` (the tiling defaults to the shard's)."""
        sc = shard_config(cfg, tp_rank, tp_size)
        return cls(sc, tiling or cls.default_tiling(sc), max_seq, tp_rank, tp_size)

    @staticmethod
    def default_tiling(sc: ModelConfig, **overrides) -> Tiling:
        """The default tiling of a rank's shard ``sc`` (:func:`shard_config`): ``Tiling.for_config`` with
        the rows of ``opcodes.tiling.DEFAULTS`` for a tensor-parallel rank. ``overrides`` win."""
        return Tiling.for_config(sc, tp=True, **overrides)


@register_layout
@dataclass(frozen=True)
class TPDecoderLayout(TPLayout, DecoderLayout):
    """The layout of rank ``tp_rank`` of a tensor-parallel whole-model decoder: a :class:`TPLayout`
    (the shard's cfg, whose ``vocab`` is the full vocabulary: the token ids EMBED reads from the
    replicated embedding) and a :class:`~opcodes.decoder.DecoderLayout` (``lm_rows``, ``emb_cols``),
    whose LM head covers the rank's vocabulary slice: :attr:`lm_vocab` = ``vocab / tp_size`` rows
    (its ``lm_head`` shard), global id ``vocab0 + local row``. The program ends in TP_ARGMAX_PUSH and
    TP_ARGMAX (``opcodes/tp_argmax.py``) instead of ARGMAX. Built by ``schedule.decoder_program``'s
    ``lower_decoder`` from a :class:`TPLayout`."""

    WHOLE_MODEL = True

    def __post_init__(self):
        TPShard(self.tp_rank, self.tp_size)          # the ints and the range, before lm_vocab divides
        if self.cfg.vocab % self.tp_size:
            raise ValueError(f"TPDecoderLayout: tp_size = {self.tp_size} must divide cfg['vocab'] = {self.cfg.vocab}")
        super().__post_init__()

    @property
    def lm_vocab(self) -> int:
        """Rows of the rank's LM head: its vocabulary slice."""
        return self.cfg.vocab // self.tp_size

    @property
    def vocab0(self) -> int:
        """The global vocabulary id of the rank's first LM head row."""
        return self.tp_rank * self.lm_vocab

    def extra(self) -> dict:
        return {**DecoderLayout.extra(self), **TPLayout.extra(self)}

    @classmethod
    def of(cls, lay: TPLayout, **tiles) -> "TPDecoderLayout":
        """The decoder layout of a rank's layer layout (same shard cfg, tiling, cache length, rank)."""
        if isinstance(lay, TPDecoderLayout) and not tiles:
            return lay
        return cls(lay.cfg, lay.tiling, lay.max_seq, tp_rank=lay.tp_rank, tp_size=lay.tp_size, **tiles)
