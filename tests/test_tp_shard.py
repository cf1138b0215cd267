"""Tensor-parallel sharding (``opcodes/tp.py``) and ``load_hf_llama(..., tp_rank, tp_size)``, on the CPU
(the kernels of TP tapes: tests/test_tp_runtime.py).

* ``shard_weights``: the ranks' shards concatenated along the split dimension are the full tensors,
  bit for bit; replicated tensors are the full ones; every shard is contiguous bf16 of the shard
  config's shapes.
* the TP reference (``tp_decoder_ref``: per-rank partials of O and down summed in rank order, logits
  concatenated) equals the unsharded ``decoder_ref`` within fp32 rounding when run in fp32, and
  ``tp_argmax`` the greedy token of the concatenated logits (ties included).
* ``load_hf_llama(path, tp_rank=r, tp_size=2)`` of a ``save_pretrained`` checkpoint in two safetensors
  files equals ``shard_weights`` of the full load, tensor for tensor, and reads every split tensor
  through ``get_slice`` (only the rank's rows or columns), never ``get_tensor``.
* bad ``tp_rank`` / ``tp_size``: errors that name the argument.
"""
from __future__ import annotations

import pytest
import torch

from conftest import check_message, decoder_weights, random_llama

from opcodes import ModelConfig
from opcodes.decoder import decoder_ref, greedy_token
from opcodes.reference import layer_ref, layer_shapes, make_kv_cache, rel_err
from opcodes.tp import (LAYER_SPLIT, TPShard, shard_config, shard_kv_cache, shard_weights, tp_argmax,
                        tp_decoder_ref, tp_layer_ref)

# 4 KV heads of GQA 2, ffn and vocab divisible by 4: T = 1, 2 and 4 all apply
CFG = ModelConfig(layers=2, d=64, ffn=96, n_q=8, n_kv=4, hd=16, vocab=64, theta=10000.0, name="tp-test")
DIM = {"rows": 0, "cols": 1}


def _f32(w: dict) -> dict:
    out = {k: v.float() for k, v in w.items() if isinstance(v, torch.Tensor)}
    out["layers"] = [{k: v.float() for k, v in lw.items()} for lw in w["layers"]]
    return out


def _clone_cache(kv):
    return [tuple(t.clone() for t in p) for p in kv]


# ---- shard_config / shard_weights ----------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 2, 4])
def test_shard_config(T):
    for r in range(T):
        sc = shard_config(CFG, r, T)
        assert (sc.n_q, sc.n_kv, sc.ffn) == (CFG.n_q // T, CFG.n_kv // T, CFG.ffn // T)
        assert (sc.layers, sc.d, sc.hd, sc.vocab, sc.eps, sc.theta, sc.group) == \
            (CFG.layers, CFG.d, CFG.hd, CFG.vocab, CFG.eps, CFG.theta, CFG.group)
        assert ModelConfig.from_dict(sc.to_dict()) == sc
        sh = TPShard(r, T)
        qa, qb = sh.q_heads(CFG)
        ka, kb = sh.kv_heads(CFG)
        assert list(range(qa, qb)) == [i for i in range(CFG.n_q) if ka <= i // CFG.group < kb]   # GQA groups
    assert shard_config(CFG.to_dict(), 0, T) == shard_config(CFG, 0, T)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("T", [2, 4])
def test_shard_weights_concat(T, tied):
    w = decoder_weights(CFG, seed=1)
    if tied:
        w["lm_head"] = w["embed"]
    shards = [shard_weights(w, CFG, r, T) for r in range(T)]
    for r, s in enumerate(shards):
        assert s["tp"] == {"rank": r, "size": T, "full": CFG.to_dict()}
        shapes = layer_shapes(shard_config(CFG, r, T))
        for lw in s["layers"]:
            for k, t in lw.items():
                assert tuple(t.shape) == shapes[k] and t.dtype == torch.bfloat16 and t.is_contiguous(), k
        assert s["lm_head"].shape == (CFG.vocab // T, CFG.d) and s["lm_head"].is_contiguous()
        assert s["embed"] is w["embed"] and s["final_norm"] is w["final_norm"]
    for l, lw in enumerate(w["layers"]):
        for k, how in LAYER_SPLIT.items():
            parts = [s["layers"][l][k] for s in shards]
            if how is None:
                assert all(p is lw[k] for p in parts), k
            else:
                assert torch.equal(torch.cat(parts, dim=DIM[how]), lw[k]), k
                assert all(p.untyped_storage().data_ptr() != lw[k].untyped_storage().data_ptr() for p in parts)
    assert torch.equal(torch.cat([s["lm_head"] for s in shards]), w["lm_head"])
    # tp_size 1: the weights' own tensors, no "tp" key
    one = shard_weights(w, CFG, 0, 1)
    assert "tp" not in one and one["lm_head"] is w["lm_head"]
    assert all(one["layers"][l][k] is w["layers"][l][k] for l in range(CFG.layers) for k in LAYER_SPLIT)


def test_shard_kv_cache():
    kv = make_kv_cache(CFG, 8, 5, batch=2)
    for T in (2, 4):
        shards = [shard_kv_cache(kv, CFG, r, T) for r in range(T)]
        for l in range(CFG.layers):
            for j in range(2):
                assert all(s[l][j].is_contiguous() and s[l][j].shape == (2, CFG.n_kv // T, 8, CFG.hd) for s in shards)
                assert torch.equal(torch.cat([s[l][j] for s in shards], dim=1), kv[l][j])
    assert shard_kv_cache(kv, CFG, 0, 1) is kv


# ---- the TP reference ----------------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 2, 4])
def test_tp_reference_fp32(T):
    """fp32: tp_decoder_ref (per-rank partials all-reduced by summing) == decoder_ref within fp32 rounding,
    over two steps (the second reads the K/V the first wrote into each rank's cache)."""
    w = _f32(decoder_weights(CFG, seed=2))
    kv = [tuple(t.float() for t in p) for p in make_kv_cache(CFG, 8, 4, seed=3)]
    shards = [shard_weights(w, CFG, r, T) for r in range(T)]
    kv_r = [shard_kv_cache(_clone_cache(kv), CFG, r, T) for r in range(T)]
    for pos, tok in ((4, 7), (5, 33)):
        ref = decoder_ref(w, kv, CFG, tok, pos)
        out = tp_decoder_ref(shards, kv_r, CFG, tok, pos)
        assert out.shape == (1, CFG.vocab) and out.dtype == torch.float32
        assert rel_err(out, ref) < 1e-6 and torch.allclose(out, ref, rtol=1e-5, atol=1e-5), (pos, rel_err(out, ref))
        for r in range(T):
            for a, b in zip(kv_r[r][0], shard_kv_cache(kv, CFG, r, T)[0]):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
        lg = [out[:, slice(*TPShard(r, T).vocab_slice(CFG))] for r in range(T)]
        assert tp_argmax(lg) == greedy_token(out) == greedy_token(ref)


def test_tp_layer_ref_bf16():
    """bf16 (the kernel's dtypes): the TP layer differs from layer_ref only by where the residual rounds."""
    w = decoder_weights(CFG, seed=4)
    kv = make_kv_cache(CFG, 8, 6, seed=5)
    x = torch.randn(1, CFG.d, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    ref = layer_ref(w["layers"][0], _clone_cache(kv)[0], CFG, x, 6)
    shards = [shard_weights(w, CFG, r, 2) for r in range(2)]
    out = tp_layer_ref([s["layers"][0] for s in shards], [shard_kv_cache(kv, CFG, r, 2)[0] for r in range(2)],
                       CFG, x, 6)
    assert out.dtype == torch.bfloat16 and rel_err(out, ref) < 1e-2


def test_tp_argmax_ties():
    lg = [torch.tensor([[0.0, 3.0]]), torch.tensor([[3.0, 1.0]]), torch.tensor([[2.0, 3.0]])]
    assert tp_argmax(lg) == greedy_token(torch.cat(lg, dim=-1)) == 1
    lg = [torch.tensor([[0.0, 1.0]]), torch.tensor([[3.0, 5.0]]), torch.tensor([[5.0, 0.0]])]
    assert tp_argmax(lg) == 3


# ---- bad arguments -------------------------------------------------------------------------------
@pytest.mark.parametrize("cfg, r, T, exc, names", [
    (CFG, 0, 3, ValueError, ["tp_size", "3", "n_kv", "4"]),
    (CFG, 0, 8, ValueError, ["tp_size", "8", "n_kv"]),
    (ModelConfig(layers=1, d=64, ffn=99, n_q=4, n_kv=2, hd=16), 0, 2, ValueError, ["tp_size", "ffn", "99"]),
    (ModelConfig(layers=1, d=64, ffn=98, n_q=4, n_kv=2, hd=16, vocab=65), 1, 2, ValueError,
     ["tp_size", "vocab", "65"]),
    (CFG, 2, 2, ValueError, ["tp_rank", "[0, 2)", "2"]),
    (CFG, -1, 2, ValueError, ["tp_rank", "-1"]),
    (CFG, 0, 0, ValueError, ["tp_size", ">= 1", "0"]),
    (CFG, 0, 2.0, TypeError, ["tp_size", "int"]),
    (CFG, True, 2, TypeError, ["tp_rank", "int"]),
])
def test_bad_tp_args(cfg, r, T, exc, names):
    for fn in (lambda: shard_config(cfg, r, T), lambda: shard_kv_cache([], cfg, r, T),
               lambda: shard_weights({"layers": []}, cfg, r, T)):
        with pytest.raises(exc) as ei:
            fn()
        check_message(ei.value, names)


def test_shard_weights_bad_weights():
    w = decoder_weights(CFG, seed=0)
    with pytest.raises(ValueError) as ei:
        shard_weights(shard_weights(w, CFG, 0, 2), CFG, 0, 2)
    check_message(ei.value, ["already a shard"])
    with pytest.raises(ValueError) as ei:
        shard_weights(w, shard_config(CFG, 0, 2), 0, 2)        # the shard's cfg, not the full one
    check_message(ei.value, ["weights['layers'][0]['q']", "(128, 64)", "(64, 64)"])


# ---- load_hf_llama(..., tp_rank, tp_size) --------------------------------------------------------
HF_KW = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, rope_theta=10000.0, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def tp_checkpoints(tmp_path_factory):
    pytest.importorskip("transformers")
    out = {}
    for tied in (False, True):
        path = tmp_path_factory.mktemp(f"tp-tied{int(tied)}")
        random_llama({**HF_KW, "tie_word_embeddings": tied}, seed=11 + tied).save_pretrained(
            path, max_shard_size="100KB")
        assert len(list(path.glob("*.safetensors"))) >= 2        # sharded
        out[tied] = path
    return out


class _Recorder:
    """Wraps safetensors.safe_open: records ("tensor", key) for get_tensor and ("slice", key, index) for
    every get_slice(...)[index]."""

    def __init__(self, real, log):
        self.real, self.log = real, log

    def __call__(self, *a, **kw):
        h, log = self.real(*a, **kw), self.log

        class Slice:
            def __init__(self, key):
                self.key, self.sl = key, h.get_slice(key)

            def get_shape(self):
                return self.sl.get_shape()

            def __getitem__(self, idx):
                log.append(("slice", self.key, idx))
                return self.sl[idx]

        class Handle:
            def keys(self):
                return h.keys()

            def get_tensor(self, key):
                log.append(("tensor", key))
                return h.get_tensor(key)

            def get_slice(self, key):
                return Slice(key)

        return Handle()


@pytest.mark.parametrize("tied", [False, True])
def test_load_hf_tp(tp_checkpoints, tied, monkeypatch):
    import safetensors
    from interp import load_hf_llama
    from interp.hf import EMBED, LAYER_NAMES, LM_HEAD
    path = tp_checkpoints[tied]
    full_w, full_cfg = load_hf_llama(path)
    mc = ModelConfig.from_dict(full_cfg)
    log = []
    monkeypatch.setattr(safetensors, "safe_open", _Recorder(safetensors.safe_open, log))
    for r in range(2):
        log.clear()
        w, cfg = load_hf_llama(path, tp_rank=r, tp_size=2)
        ref = shard_weights(full_w, full_cfg, r, 2)
        assert cfg == {**full_cfg, "n_q": 2, "n_kv": 1, "ffn": 48}
        assert ModelConfig.from_dict(cfg) == shard_config(full_cfg, r, 2)
        assert w["tp"] == ref["tp"] == {"rank": r, "size": 2, "full": full_cfg}
        assert set(w) == set(ref)
        for k in ("embed", "final_norm", "lm_head"):
            assert w[k].dtype == torch.bfloat16 and w[k].is_contiguous() and torch.equal(w[k], ref[k]), k
        for l in range(mc.layers):
            for k, t in w["layers"][l].items():
                assert t.dtype == torch.bfloat16 and t.is_contiguous() and torch.equal(t, ref["layers"][l][k]), (l, k)
        # what was read: split tensors only through get_slice, only the rank's rows / columns
        sh = TPShard(r, 2)
        slices = sh.layer_slices(mc)
        whole = {e[1] for e in log if e[0] == "tensor"}
        sliced = {e[1]: e[2] for e in log if e[0] == "slice"}
        want_sliced = {}
        for l in range(mc.layers):
            for k, hf in LAYER_NAMES.items():
                if LAYER_SPLIT[k] == "rows":
                    want_sliced[f"model.layers.{l}.{hf}"] = slice(*slices[k])
                elif LAYER_SPLIT[k] == "cols":
                    want_sliced[f"model.layers.{l}.{hf}"] = (slice(None), slice(*slices[k]))
        if not tied:
            want_sliced[LM_HEAD] = slice(*sh.vocab_slice(mc))
        assert sliced == want_sliced
        assert not whole & set(want_sliced)
        assert whole == {EMBED, "model.norm.weight"} | {f"model.layers.{l}.{n}" for l in range(mc.layers)
                                                         for n in ("input_layernorm.weight",
                                                                   "post_attention_layernorm.weight")}
        assert len([e for e in log if e[0] == "tensor"]) == len(whole)      # each read once
    # tp_size 1 reads whole tensors, as before
    log.clear()
    w1, cfg1 = load_hf_llama(path, tp_rank=0, tp_size=1)
    assert cfg1 == full_cfg and "tp" not in w1 and not [e for e in log if e[0] == "slice"]
    assert (w1["lm_head"] is w1["embed"]) == tied


def test_load_hf_tp_bad_args(tp_checkpoints):
    from interp import load_hf_llama
    with pytest.raises(ValueError) as ei:
        load_hf_llama(tp_checkpoints[False], tp_rank=0, tp_size=4)        # n_kv = 2
    check_message(ei.value, ["tp_size", "4", "n_kv", "2"])
    with pytest.raises(ValueError) as ei:
        load_hf_llama(tp_checkpoints[False], tp_rank=2, tp_size=2)
    check_message(ei.value, ["tp_rank", "[0, 2)"])
