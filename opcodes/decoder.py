"""The whole-model decoder's layout: the layers' :class:`~opcodes.base.Layout` plus the vocabulary.

A decoder program (``schedule/decoder_program.py``) wraps the layers' tiles with

    EMBED(col0)  -> x0 (the layer-0 input)      -> layers ... -> out[L-1]
    LM_HEAD(row0) (final RMSNorm + rows of lm_head) -> logits, one (max, argmax) partial per tile
    ARGMAX(nparts) -> the next token (device int32 buffer read by the next call's EMBED)

:class:`DecoderLayout` adds the whole-model tensors (``MODEL_TENSORS``) and the tile sizes of
those opcodes (their scratch buffers are declared by the opcodes). It is only used for decoder
programs: a layer-only program of a config that has a vocabulary keeps the plain :class:`Layout`.

Also here: :func:`decoder_shapes` and :func:`decoder_ref`, the eager torch reference of one
whole-model decode step (embedding, the layers of ``opcodes.reference.model_ref``, final RMSNorm,
LM head, greedy argmax), and :func:`decoder_ref_rows`, the same over R rows (sequence slot,
position) of ``opcodes.reference.model_ref_rows``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .base import Layout, register_layout
from .tiling import cdiv, next_pow2
from .config import ModelConfig
from .reference import make_weights, model_ref, model_ref_fp32, model_ref_rows, model_ref_rows_fp32, rel_err, rmsnorm

#: extra weights of a whole model beyond ``weights["layers"]``
DECODER_KEYS = ("embed", "final_norm", "lm_head")


def _pow2(name: str, v) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v & (v - 1):
        raise ValueError(f"DecoderLayout.{name} must be a positive power of two, got {v!r}")


@register_layout
@dataclass(frozen=True)
class DecoderLayout(Layout):
    """A :class:`Layout` for programs that embed the token and end in logits and the next token.

    ``lm_rows``  vocabulary rows per LM_HEAD tile (0: 256 with the row loop (``Tiling.row_bytes``), else 32,
                 at most ``next_pow2(lm_vocab)``)

    :attr:`lm_vocab` is the number of vocabulary rows the program's LM head computes: the whole
    vocabulary here, a rank's slice in a tensor-parallel decoder (``opcodes.tp.TPDecoderLayout``).
    ``emb_cols`` columns of d per EMBED tile (0: ``min(1024, next_pow2(d))``)
    """

    lm_rows: int = 0
    emb_cols: int = 0

    WHOLE_MODEL = True

    def __post_init__(self):
        super().__post_init__()
        c = self.cfg
        if not c.vocab:
            raise ValueError("a decoder needs cfg['vocab'] > 0 (the embedding and LM head rows)")
        if self.lm_rows == 0:
            # the row loop (Tiling.row_bytes) streams any tile height in 32 KB stages
            object.__setattr__(self, "lm_rows", min(256 if self.tiling.row_bytes else 32, next_pow2(self.lm_vocab)))
        if self.emb_cols == 0:
            object.__setattr__(self, "emb_cols", min(1024, next_pow2(c.d)))
        _pow2("lm_rows", self.lm_rows)
        _pow2("emb_cols", self.emb_cols)

    @classmethod
    def of(cls, lay: Layout, **tiles) -> "DecoderLayout":
        """The decoder layout of a layer layout (same config, tiling and cache length)."""
        if isinstance(lay, DecoderLayout) and not tiles:
            return lay
        return cls(lay.cfg, lay.tiling, lay.max_seq, **tiles)

    # ---- derived counts ---------------------------------------------------------------
    @property
    def lm_vocab(self) -> int:
        """Rows of the LM head this program computes (its logits, its LM_HEAD tiles' local row
        indices): the whole vocabulary."""
        return self.cfg.vocab

    @property
    def n_lm_tiles(self) -> int:
        return cdiv(self.lm_vocab, self.lm_rows)

    @property
    def n_emb_tiles(self) -> int:
        return cdiv(self.cfg.d, self.emb_cols)

    def extra(self) -> dict:
        return {"lm_rows": self.lm_rows, "emb_cols": self.emb_cols}


def random_model_weights(cfg: ModelConfig, seed: int = 0, device="cpu") -> dict:
    """Random whole-model weights: ``make_weights``' layers plus a unit-normal embedding, a final norm
    (1 + N(0, 0.1^2)) and an untied LM head (entries N(0, (3 / sqrt(d))^2)), all bf16, drawn on the CPU
    (the same bits on every device) and moved to ``device``."""
    w = make_weights(cfg, seed=seed)
    g = torch.Generator().manual_seed(100 + seed)
    w["embed"] = torch.randn(cfg.vocab, cfg.d, generator=g).to(torch.bfloat16)
    w["final_norm"] = (1.0 + 0.1 * torch.randn(cfg.d, generator=g)).to(torch.bfloat16)
    w["lm_head"] = (torch.randn(cfg.vocab, cfg.d, generator=g) * (3.0 / math.sqrt(cfg.d))).to(torch.bfloat16)
    if torch.device(device).type != "cpu":
        w = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in w.items()}
        w["layers"] = [{n: t.to(device) for n, t in lw.items()} for lw in w["layers"]]
    return w


def decoder_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shapes of the whole-model tensors beyond the layers."""
    return {"embed": (cfg.vocab, cfg.d), "final_norm": (cfg.d,), "lm_head": (cfg.vocab, cfg.d)}


def decoder_ref(weights: dict, kv_cache: list, cfg: ModelConfig, token: int, pos: int, cos_sin=None):
    """One whole-model decode step in eager torch (bf16 weights and activations, like
    ``model_ref``): returns fp32 logits (1, vocab); writes K/V at ``pos`` into ``kv_cache``."""
    tok = int(token)
    x = weights["embed"][tok].reshape(1, -1)
    h = model_ref(weights, kv_cache, cfg, x, pos, cos_sin)
    h = rmsnorm(h, weights["final_norm"], cfg.eps)
    return (h.float() @ weights["lm_head"].float().T)


def decoder_ref_fp32(weights: dict, kv_cache32: list, cfg: ModelConfig, token: int, pos: int, cos_sin=None):
    """:func:`decoder_ref` with every tensor in fp32 (the yardstick of the multi-layer accuracy
    criterion): ``kv_cache32`` is an fp32 copy of the cache, updated in place."""
    x = weights["embed"][int(token)].reshape(1, -1).float()
    h = model_ref_fp32(weights, kv_cache32, cfg, x, pos, cos_sin)
    h = rmsnorm(h, weights["final_norm"].float(), cfg.eps)
    return h @ weights["lm_head"].float().T


def _embed_rows(weights: dict, cfg: ModelConfig, tokens) -> torch.Tensor:
    """The embedding rows of ``tokens`` (a 1-D integer tensor or a sequence of ints in [0, vocab))."""
    if isinstance(tokens, torch.Tensor):
        if tokens.dtype.is_floating_point or tokens.dtype == torch.bool or tokens.dim() != 1:
            raise TypeError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        toks = [int(t) for t in tokens.tolist()]
    elif isinstance(tokens, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        toks = list(tokens)
    else:
        raise TypeError(f"tokens must be a 1-D integer tensor or a sequence of ints, got {type(tokens).__name__}")
    if not toks:
        raise ValueError("tokens is empty: a step has R >= 1 rows")
    V = weights["embed"].shape[0]
    bad = [(r, t) for r, t in enumerate(toks) if not 0 <= t < V]
    if bad:
        raise ValueError(f"tokens[{bad[0][0]}] = {bad[0][1]} is not a token id: the vocabulary is [0, {V})")
    return weights["embed"][torch.tensor(toks, dtype=torch.long, device=weights["embed"].device)]


def decoder_ref_rows(weights: dict, kv_cache: list, cfg, tokens, slots, pos, cos_sin=None) -> torch.Tensor:
    """One whole-model step over R rows (``opcodes.reference.model_ref_rows``): row r embeds
    ``tokens[r]`` of sequence slot ``slots[r]`` at position ``pos[r]``. Returns fp32 logits (R, vocab),
    row r's next-token logits; writes every row's K/V in place. Bad inputs raise before the cache is
    touched."""
    cfg = ModelConfig.from_dict(cfg)
    x = _embed_rows(weights, cfg, tokens)
    h = model_ref_rows(weights, kv_cache, cfg, x, slots, pos, cos_sin)
    h = rmsnorm(h, weights["final_norm"], cfg.eps)
    return h.float() @ weights["lm_head"].float().T


def decoder_ref_rows_fp32(weights: dict, kv_cache32: list, cfg, tokens, slots, pos, cos_sin=None) -> torch.Tensor:
    """:func:`decoder_ref_rows` with every tensor in fp32; ``kv_cache32`` an fp32 copy of the cache."""
    cfg = ModelConfig.from_dict(cfg)
    x = _embed_rows(weights, cfg, tokens).float()
    h = model_ref_rows_fp32(weights, kv_cache32, cfg, x, slots, pos, cos_sin)
    h = rmsnorm(h, weights["final_norm"].float(), cfg.eps)
    return h @ weights["lm_head"].float().T


def step_accuracy(logits: torch.Tensor, ref: torch.Tensor, ref32: torch.Tensor) -> dict:
    """One step of the multi-layer criterion: the relative error of ``logits`` and of the bf16
    reference's ``ref`` against the all-fp32 ``ref32``; the greedy token agrees with ``ref32``'s
    where its top-2 margin is decisive: more than twice the bf16 reference's largest logit
    deviation from ``ref32`` (a margin a bf16 implementation cannot be expected to flip)."""
    l32 = ref32.reshape(-1).float()
    top2 = torch.topk(l32, 2).values
    margin = float(top2[0] - top2[1])
    dev = float((ref.reshape(-1).float() - l32).abs().max())
    return dict(err=rel_err(logits, ref32), ref_err=rel_err(ref, ref32), margin=margin, decisive=margin > 2 * dev,
                agree=greedy_token(logits) == greedy_token(ref32))


def greedy_token(logits: torch.Tensor) -> int:
    """The greedy next token of (1, vocab) logits: the max, ties to the lowest index."""
    return int(torch.argmax(logits.reshape(-1)).item())
