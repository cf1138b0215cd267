"""Hugging Face interop: ``load_hf_llama`` and whole-model decode against
transformers' own ``LlamaForCausalLM``, through the Triton interpreter.

For each config a randomly initialised small ``LlamaForCausalLM`` (norm weights randomised too, so
a swapped norm would show) is cast to bf16, saved with ``save_pretrained`` (safetensors; one file
or shards) and loaded back through ``load_hf_llama``. The reference is transformers running in
**fp32** on the same bf16 weights (``from_pretrained(..., dtype=torch.float32)``), greedy, one
full forward per step. megatape's ``generate`` (one launch per token, the next token never leaves
the device) must produce the same 16 greedy tokens, and the logits it chose them from must be
within ``TOL`` relative error (``opcodes.reference.rel_err``) of transformers' at every step.

Llama 3.1 / 3.2 RoPE scaling (``rope_type: "llama3"``): ``rope_tables`` against transformers' rotary
embedding (bit for bit), the cfg keys it loads as (v5 ``rope_parameters`` and v4 ``rope_scaling``), and a
48-position ``decode_step`` run past the scaling's ``original_max_position_embeddings``.

Note: the Triton interpreter truncates fp32 -> bf16 casts; the kernel rounds to nearest even on the
bits first under the interpreter (``opcodes.common.to_bf16``), so the K/V cache and outputs round
as on a GPU.
"""
from __future__ import annotations

import copy
import json
import pathlib

import pytest
import torch

from conftest import random_llama, require_interpreter

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

import opcodes  # noqa: E402
from interp import build_decoder, decode_step, generate, load_hf_llama, teardown  # noqa: E402
from opcodes import ModelConfig, Tiling  # noqa: E402
from opcodes.decoder import decoder_ref  # noqa: E402
from opcodes.reference import rel_err, rope_tables  # noqa: E402

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")

TOL = 2e-2
N_NEW = 16
# the default run's greedy steps (interpreter time, ~1 s a step): the first N_NEW_DEFAULT of the N_NEW tokens
# the seeds and prompts were picked for; --runslow runs all N_NEW
N_NEW_DEFAULT = 8

# name -> (LlamaConfig kwargs, seed, save_pretrained kwargs, megatape tiling overrides, prompt).
# Seeds and prompts were picked so that transformers' top-2 logit margin stays >= 0.08 over the 16
# greedy steps (megatape's logits differ from transformers' by <= ~0.025 here): a near-tie would
# make the token comparison a coin toss. The generated sequences have 6 distinct tokens each.
MIN_MARGIN = 0.05
CONFIGS = {
    # GQA 2, tied embeddings, one model.safetensors, megatape's default tiling but 4 attention splits
    # instead of 16 (interpreter time: the default tiling runs through the kernel in test_interp_contract)
    "gqa2-tied": (dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                       rope_theta=10000.0, rms_norm_eps=1e-6), 3, {}, dict(attn_splits=4), [11, 22, 33]),
    # GQA 4, untied LM head, sharded (index + 5 files), head_dim 32 != hidden/heads = 16, vocab not a
    # multiple of the LM head tile, Llama-3 theta and eps; fewer attention splits (interpreter time)
    "gqa4-untied-sharded": (dict(vocab_size=250, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                                 tie_word_embeddings=False, rope_theta=500000.0, rms_norm_eps=1e-5),
                            16, dict(max_shard_size="60KB"), dict(attn_splits=2, gu_rows=32), [11, 22, 33]),
}


# Llama 3.1 / 3.2 RoPE scaling (rope_type "llama3") with original_max_position_embeddings 32, so that a
# 48-position decode runs past it. Wavelengths 2*pi*10000^(2i/32): pair 0 (6.3) is kept, pairs 1 and 2
# (11.2, 19.9) are interpolated, pairs 3..15 (> 32) are divided by 8. 2 heads of 32 (GQA 2), 2 layers: the
# smallest model that does (the Triton interpreter's time goes with the number of heads and layers).
# Seed and prompt (33 random tokens, then 16 greedy tokens: positions 0..47) were picked like CONFIGS':
# transformers' top-2 margin >= 0.086 over the 16 greedy steps, 13 distinct tokens among them.
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
LLAMA3_KW = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, tie_word_embeddings=True, rms_norm_eps=1e-5,
                 rope_parameters=LLAMA3_ROPE)
LLAMA3_SEED = 7
LLAMA3_PROMPT = [107, 173, 11, 55, 40, 40, 18, 223, 225, 80, 250, 166, 33, 254, 30, 51, 9, 0, 127, 8, 155, 13, 176,
                 168, 111, 81, 240, 140, 197, 238, 176, 18, 161]
LLAMA3_CFG = {"layers": 2, "d": 64, "ffn": 160, "n_q": 2, "n_kv": 1, "hd": 32, "eps": 1e-5, "theta": 10000.0,
              "vocab": 256, "rope_type": "llama3", "rope_factor": 8.0, "rope_low_freq_factor": 1.0,
              "rope_high_freq_factor": 4.0, "rope_original_max_pos": 32}


def _save(path: pathlib.Path, kw: dict, seed: int, save_kw: dict):
    """A random bf16 LlamaForCausalLM saved to ``path``; returns transformers' fp32 copy of it."""
    random_llama(kw, seed).save_pretrained(path, **save_kw)
    return transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for name, (kw, seed, save_kw, _, _) in CONFIGS.items():
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, _save(path, kw, seed, save_kw))
    return out


def _hf_greedy(model, prompt: list[int], n: int):
    """transformers' greedy tokens and the fp32 logits that chose each (full forward per step)."""
    seq = list(prompt)
    logits = []
    with torch.no_grad():
        for _ in range(n):
            lg = model(torch.tensor([seq])).logits[0, -1].float()
            logits.append(lg)
            seq.append(int(torch.argmax(lg)))
    return seq[len(prompt):], torch.stack(logits)


def _cache(cfg: dict, max_seq: int):
    mc = ModelConfig.from_dict(cfg)
    return [tuple(torch.zeros(1, mc.n_kv, max_seq, mc.hd, dtype=torch.bfloat16) for _ in range(2))
            for _ in range(mc.layers)]


# ---- loading -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_load_matches_state_dict(checkpoints, name):
    path, model = checkpoints[name]
    kw = CONFIGS[name][0]
    weights, cfg = load_hf_llama(path)
    assert cfg == {"layers": kw["num_hidden_layers"], "d": kw["hidden_size"], "ffn": kw["intermediate_size"],
                   "n_q": kw["num_attention_heads"], "n_kv": kw["num_key_value_heads"], "hd": kw["head_dim"],
                   "eps": kw["rms_norm_eps"], "theta": kw["rope_theta"], "vocab": kw["vocab_size"]}
    sd = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    assert torch.equal(weights["embed"], sd["model.embed_tokens.weight"])
    assert torch.equal(weights["final_norm"], sd["model.norm.weight"])
    if kw["tie_word_embeddings"]:
        assert weights["lm_head"] is weights["embed"]
    else:
        assert torch.equal(weights["lm_head"], sd["lm_head.weight"])
        assert weights["lm_head"].data_ptr() != weights["embed"].data_ptr()
    names = {"in_norm": "input_layernorm", "post_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}
    assert len(weights["layers"]) == kw["num_hidden_layers"]
    for n, lw in enumerate(weights["layers"]):
        assert set(lw) == set(names)
        for k, hf in names.items():
            t = lw[k]
            assert t.dtype == torch.bfloat16 and t.is_contiguous()
            assert torch.equal(t, sd[f"model.layers.{n}.{hf}.weight"]), (n, k)


def test_sharded_and_single_file_load_the_same(checkpoints, tmp_path):
    path, model = checkpoints["gqa4-untied-sharded"]
    assert (path / "model.safetensors.index.json").is_file()
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(tmp_path)      # the same model in one file
    assert (tmp_path / "model.safetensors").is_file()
    a, ca = load_hf_llama(path)
    b, cb = load_hf_llama(tmp_path)
    assert ca == cb
    for k in ("embed", "final_norm", "lm_head"):
        assert torch.equal(a[k], b[k])
    for la, lb in zip(a["layers"], b["layers"]):
        for k in la:
            assert torch.equal(la[k], lb[k])


# ---- load errors: each names the file and the key ------------------------------------------------
def _copy_ckpt(src: pathlib.Path, dst: pathlib.Path) -> pathlib.Path:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_config(d: pathlib.Path, **changes):
    conf = json.loads((d / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            conf.pop(k, None)
        else:
            conf[k] = v
    (d / "config.json").write_text(json.dumps(conf))


def _drop_tensor(d: pathlib.Path, key: str):
    """Rewrite the file holding ``key`` without it (the index still lists it, if there is one)."""
    from safetensors import safe_open
    idx = d / "model.safetensors.index.json"
    f = d / (json.loads(idx.read_text())["weight_map"][key] if idx.is_file() else "model.safetensors")
    with safe_open(str(f), framework="pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys() if k != key}
    safetensors_torch.save_file(tensors, str(f), metadata={"format": "pt"})
    return f


def _no_config(d):
    (d / "config.json").unlink()


def _no_shard(d):
    (d / "model-00003-of-00005.safetensors").unlink()


def _missing_tensor_sharded(d):
    _drop_tensor(d, "model.layers.1.mlp.up_proj.weight")


def _missing_tensor_single(d):
    _drop_tensor(d, "model.layers.0.self_attn.k_proj.weight")


def _missing_from_index(d):
    idx = d / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    del obj["weight_map"]["model.norm.weight"]
    idx.write_text(json.dumps(obj))


def _untied_without_lm_head(d):
    """As a tied checkpoint is saved (no lm_head.weight anywhere), but config.json says untied."""
    _drop_tensor(d, "lm_head.weight")
    idx = d / "model.safetensors.index.json"
    obj = json.loads(idx.read_text())
    del obj["weight_map"]["lm_head.weight"]
    idx.write_text(json.dumps(obj))


def _no_weights(d):
    for f in d.glob("*.safetensors*"):
        f.unlink()


def _llama3_rope(**changes) -> dict:
    """A transformers v5 ``rope_parameters`` for llama3 scaling; a None value drops the key."""
    rp = dict(LLAMA3_ROPE, **changes)
    return {k: v for k, v in rp.items() if v is not None}


# (case id, checkpoint, edit, exception, substrings the message must contain)
LOAD_ERRORS = [
    ("no-directory", "gqa2-tied", lambda d: None, FileNotFoundError, ["no-such-dir"]),
    ("no-config", "gqa2-tied", _no_config, FileNotFoundError, ["config.json"]),
    ("no-weights", "gqa2-tied", _no_weights, FileNotFoundError, ["model.safetensors", "*.safetensors"]),
    ("missing-shard", "gqa4-untied-sharded", _no_shard, FileNotFoundError,
     ["model-00003-of-00005.safetensors", "missing shard"]),
    ("missing-tensor-sharded", "gqa4-untied-sharded", _missing_tensor_sharded, ValueError,
     ["model.layers.1.mlp.up_proj.weight", ".safetensors"]),
    ("missing-tensor-single", "gqa2-tied", _missing_tensor_single, ValueError,
     ["model.layers.0.self_attn.k_proj.weight", "model.safetensors"]),
    ("missing-from-index", "gqa4-untied-sharded", _missing_from_index, ValueError,
     ["model.norm.weight", "model.safetensors.index.json"]),
    ("untied-no-lm-head", "gqa4-untied-sharded", _untied_without_lm_head, ValueError,
     ["lm_head.weight", "tie_word_embeddings"]),
    ("ffn-disagrees", "gqa2-tied", lambda d: _edit_config(d, intermediate_size=192), ValueError,
     ["model.layers.0.mlp.gate_proj.weight", "(160, 64)", "(192, 64)", "model.safetensors"]),
    ("kv-heads-disagree", "gqa4-untied-sharded", lambda d: _edit_config(d, num_key_value_heads=2), ValueError,
     ["model.layers.0.self_attn.k_proj.weight", "(32, 64)", "(64, 64)"]),
    ("vocab-disagrees", "gqa2-tied", lambda d: _edit_config(d, vocab_size=300), ValueError,
     ["model.embed_tokens.weight", "(256, 64)", "(300, 64)"]),
    # llama3 RoPE scaling with a bad or missing parameter: the message names the key (and where it is)
    ("rope-llama3-no-factor", "gqa2-tied", lambda d: _edit_config(d, rope_parameters=_llama3_rope(factor=None)),
     ValueError, ["config.json", "rope_parameters", "'factor'"]),
    ("rope-llama3-factor-below-1", "gqa2-tied", lambda d: _edit_config(d, rope_parameters=_llama3_rope(factor=0.5)),
     ValueError, ["config.json", "rope_parameters['factor'] = 0.5", ">= 1"]),
    ("rope-llama3-factor-not-a-number", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=_llama3_rope(factor="8")),
     ValueError, ["config.json", "rope_parameters['factor'] = '8'"]),
    ("rope-llama3-high-not-above-low", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=_llama3_rope(low_freq_factor=4.0, high_freq_factor=2.0)),
     ValueError, ["config.json", "rope_parameters['high_freq_factor'] = 2.0", "rope_parameters['low_freq_factor'] = 4.0"]),
    ("rope-llama3-low-not-positive", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=_llama3_rope(low_freq_factor=0.0)),
     ValueError, ["config.json", "rope_parameters['low_freq_factor'] = 0.0", "> 0"]),
    ("rope-llama3-original-not-int", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=_llama3_rope(original_max_position_embeddings=32.5)),
     ValueError, ["config.json", "rope_parameters['original_max_position_embeddings'] = 32.5", "int"]),
    ("rope-scaling-v4-llama3-no-original", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=None, rope_theta=10000.0,
                            rope_scaling=_llama3_rope(rope_theta=None, original_max_position_embeddings=None)),
     ValueError, ["config.json", "rope_scaling", "'original_max_position_embeddings'"]),
    ("rope-partial-rotary", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "partial_rotary_factor": 0.5}),
     ValueError, ["config.json", "partial_rotary_factor", "0.5"]),
    # other scaling types stay refused, naming the type and the file
    ("rope-yarn", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                "original_max_position_embeddings": 32}),
     ValueError, ["config.json", "'yarn'", "llama3"]),
    ("rope-scaling-v4-linear", "gqa2-tied",
     lambda d: _edit_config(d, rope_parameters=None, rope_theta=10000.0, rope_scaling={"type": "linear", "factor": 2.0}),
     ValueError, ["config.json", "'linear'"]),
    ("head-dim-implicit", "gqa2-tied", lambda d: _edit_config(d, head_dim=None, num_attention_heads=3,
                                                               num_key_value_heads=1),
     ValueError, ["config.json", "head_dim", "num_attention_heads 3"]),
    ("model-type", "gqa2-tied", lambda d: _edit_config(d, model_type="mistral"), ValueError,
     ["config.json", "'mistral'"]),
    ("activation", "gqa2-tied", lambda d: _edit_config(d, hidden_act="gelu"), ValueError, ["config.json", "'gelu'"]),
    ("bias", "gqa2-tied", lambda d: _edit_config(d, attention_bias=True), ValueError,
     ["config.json", "attention_bias"]),
    ("config-missing-key", "gqa2-tied", lambda d: _edit_config(d, intermediate_size=None), ValueError,
     ["config.json", "'intermediate_size'"]),
    ("hd-not-pow2", "gqa2-tied", lambda d: _edit_config(d, head_dim=24), ValueError,
     ["config.json", "power of two"]),
    ("bad-json", "gqa2-tied", lambda d: (d / "config.json").write_text("{not json"), ValueError,
     ["config.json", "JSON"]),
]


@pytest.mark.parametrize("case,ckpt,edit,exc,words", LOAD_ERRORS, ids=[c[0] for c in LOAD_ERRORS])
def test_load_errors(checkpoints, tmp_path, case, ckpt, edit, exc, words):
    src = checkpoints[ckpt][0]
    if case == "no-directory":
        d = tmp_path / "no-such-dir"
    else:
        d = _copy_ckpt(src, tmp_path / "ckpt")
        edit(d)
    with pytest.raises(exc) as ei:
        load_hf_llama(d)
    msg = str(ei.value)
    for w in words:
        assert w in msg, f"{case}: {w!r} not in {msg!r}"


def test_rope_default_and_v4_keys(checkpoints, tmp_path):
    """transformers v4 configs (rope_theta + rope_scaling null, no head_dim) load too."""
    d = _copy_ckpt(checkpoints["gqa2-tied"][0], tmp_path / "v4")
    _edit_config(d, rope_parameters=None, rope_theta=123.0, rope_scaling=None, head_dim=None)
    _, cfg = load_hf_llama(d)
    assert cfg["theta"] == 123.0 and cfg["hd"] == 16


# ---- whole-model decode against transformers -----------------------------------------------------
@pytest.mark.parametrize("name", list(CONFIGS))
def test_generate_matches_transformers(checkpoints, runslow, name):
    path, model = checkpoints[name]
    _, _, _, tiling, prompt = CONFIGS[name]
    n_new = N_NEW if runslow else N_NEW_DEFAULT
    want_tokens, want_logits = _hf_greedy(model, prompt, n_new)
    weights, cfg = load_hf_llama(path)
    max_seq = 32
    til = Tiling.for_config(ModelConfig.from_dict(cfg), **tiling) if tiling else None
    h = build_decoder(weights, _cache(cfg, max_seq), cfg, max_seq, tiling=til)
    toks, logits = generate(h, torch.tensor(prompt), n_new, return_logits=True)
    teardown(h)
    assert toks.dtype == torch.int64 and toks.shape == (n_new,)
    assert logits.dtype == torch.float32 and logits.shape == (n_new, cfg["vocab"])
    top2 = want_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    assert min(margins) >= MIN_MARGIN, f"the test model has a near-tie (margins {margins}): pick another seed"
    assert toks.tolist() == want_tokens, f"greedy tokens differ; transformers' top-2 margins {margins}"
    errs = [rel_err(logits[j], want_logits[j]) for j in range(n_new)]
    assert max(errs) <= TOL, f"rel err per step {errs}"


def test_decode_step_matches_transformers(checkpoints):
    """decode_step over the prompt (the host hands each token): logits at every prompt position."""
    name = "gqa4-untied-sharded"
    path, model = checkpoints[name]
    _, _, _, tiling, prompt = CONFIGS[name]
    with torch.no_grad():
        want = model(torch.tensor([prompt])).logits[0].float()
    weights, cfg = load_hf_llama(path)
    til = Tiling.for_config(ModelConfig.from_dict(cfg), **tiling)
    h = build_decoder(weights, _cache(cfg, 16), cfg, 16, tiling=til)
    for p, t in enumerate(prompt):
        lg = decode_step(h, torch.tensor([t]), p)
        assert lg.shape == (1, cfg["vocab"]) and lg.dtype == torch.float32
        assert rel_err(lg[0], want[p]) <= TOL, p
        assert int(h.tok) == int(torch.argmax(want[p]))      # the greedy token stays on the device
    teardown(h)


# ---- Llama 3.1 / 3.2 RoPE scaling (rope_type "llama3") -------------------------------------------
@pytest.fixture(scope="module")
def llama3_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama3-rope")
    return path, _save(path, copy.deepcopy(LLAMA3_KW), LLAMA3_SEED, {})


def _hf_rope(hd: int, theta: float, rope_parameters: dict | None, n: int):
    """transformers' LlamaRotaryEmbedding cos/sin (fp32) for positions 0..n-1, each (n, hd)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    rp = {"rope_type": "default", "rope_theta": theta} if rope_parameters is None else dict(rope_parameters)
    conf = transformers.LlamaConfig(vocab_size=16, hidden_size=2 * hd, intermediate_size=16, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=hd,
                                    max_position_embeddings=max(n, 2 * rp.get("original_max_position_embeddings", 1)),
                                    rope_parameters=rp)
    cos, sin = LlamaRotaryEmbedding(conf)(torch.zeros(1, dtype=torch.float32), torch.arange(n)[None])
    return cos[0], sin[0]


ROPE_TABLE_CASES = [
    # (id, ModelConfig, positions): the test checkpoint's scaling, other parameters, and the real presets
    ("hd32-orig32", ModelConfig.from_dict(LLAMA3_CFG), 96),
    ("hd16-orig64-int-factors", ModelConfig(layers=1, d=64, ffn=64, n_q=4, n_kv=1, hd=16, theta=500000.0,
                                           rope_type="llama3", rope_factor=4, rope_low_freq_factor=2,
                                           rope_high_freq_factor=8, rope_original_max_pos=64), 200),
    ("llama3.2-1b", opcodes.PRESETS["llama3.2-1b"], 9000),
    ("llama3.1-8b", opcodes.PRESETS["llama3.1-8b"], 9000),
]


@pytest.mark.parametrize("case,mc,n", ROPE_TABLE_CASES, ids=[c[0] for c in ROPE_TABLE_CASES])
def test_rope_tables_llama3_match_transformers(case, mc, n):
    """opcodes.reference.rope_tables with llama3 scaling is transformers' rotary embedding, bit for bit."""
    from opcodes.reference import rope_tables
    assert mc.rope_type == "llama3"
    rp = {"rope_type": "llama3", "rope_theta": mc.theta, "factor": mc.rope_factor,
          "low_freq_factor": mc.rope_low_freq_factor, "high_freq_factor": mc.rope_high_freq_factor,
          "original_max_position_embeddings": mc.rope_original_max_pos}
    want_cos, want_sin = _hf_rope(mc.hd, mc.theta, rp, n)
    cos, sin = rope_tables(mc, n)
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == sin.shape == (n, mc.hd // 2)
    # HF's tables repeat the hd/2 frequencies twice (rotate_half); megatape keeps one copy
    assert torch.equal(torch.cat([cos, cos], -1), want_cos)
    assert torch.equal(torch.cat([sin, sin], -1), want_sin)
    # the scaling matters: unscaled RoPE (megatape's and transformers') is a different table
    plain = ModelConfig(layers=1, d=mc.d, ffn=mc.ffn, n_q=mc.n_q, n_kv=mc.n_kv, hd=mc.hd, theta=mc.theta)
    plain_cos, _ = rope_tables(plain, n)
    assert torch.equal(torch.cat([plain_cos, plain_cos], -1), _hf_rope(mc.hd, mc.theta, None, n)[0])
    assert (plain_cos - cos).abs().max() > 0.1


def test_load_llama3_rope_scaling(llama3_checkpoint, tmp_path):
    """The llama3 scaling of a v5 config.json (rope_parameters) and of a v4 one (rope_theta + rope_scaling)
    become the same cfg keys, and the cfg round-trips through ModelConfig."""
    path, _ = llama3_checkpoint
    assert json.loads((path / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    _, cfg = load_hf_llama(path)
    assert cfg == LLAMA3_CFG
    mc = ModelConfig.from_dict(cfg)
    assert mc.to_dict() == dict(cfg, wdtype="bf16")
    assert ModelConfig.from_dict(json.loads(json.dumps(mc.to_dict()))) == mc
    d = _copy_ckpt(path, tmp_path / "v4")
    v4 = {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
    _edit_config(d, rope_parameters=None, rope_theta=LLAMA3_ROPE["rope_theta"], rope_scaling=v4)
    assert load_hf_llama(d)[1] == LLAMA3_CFG
    # the legacy "type" key and integral numbers (8, 8192.0) give the same cfg
    v4 = dict(v4, factor=8, original_max_position_embeddings=32.0)
    v4["type"] = v4.pop("rope_type")
    _edit_config(d, rope_scaling=v4)
    assert load_hf_llama(d)[1] == LLAMA3_CFG


LLAMA3_FIRST = 24       # the first position the kernel decodes (the reference prefills the cache before it)
# the default run's window (interpreter time, ~0.7 s a position): positions 28..40, still across
# original_max_position_embeddings (32), the first 9 greedy tokens; --runslow decodes 24..47
LLAMA3_FIRST_DEFAULT, LLAMA3_LAST_DEFAULT = 28, 40


def test_llama3_decode_matches_transformers(llama3_checkpoint, runslow):
    """decode_step over positions 24..47 (the prompt's last 9 of 33 tokens, then the greedy ones; the
    eager reference prefills positions 0..23), past the scaling's original_max_position_embeddings
    (32): logits within TOL of transformers' at every decoded position, and the same 16 greedy tokens.
    (The default run decodes 28..40: the first 9 greedy tokens.)"""
    path, model = llama3_checkpoint
    prompt, P = LLAMA3_PROMPT, len(LLAMA3_PROMPT)
    want_tokens, step_logits = _hf_greedy(model, prompt, N_NEW)
    seq = prompt + want_tokens[:-1]                                     # the tokens fed at positions 0..47
    with torch.no_grad():
        want = model(torch.tensor([seq])).logits[0].float()             # (48, vocab), one forward
    assert torch.allclose(want[P - 1:], step_logits, atol=1e-4, rtol=0)
    top2 = step_logits.topk(2, dim=-1).values
    margins = (top2[:, 0] - top2[:, 1]).tolist()
    assert min(margins) >= MIN_MARGIN, f"the test model has a near-tie (margins {margins}): pick another seed"
    # the scaling matters: the same weights with unscaled RoPE are far from these logits
    conf0 = transformers.LlamaConfig(max_position_embeddings=128, **dict(
        LLAMA3_KW, rope_parameters={"rope_type": "default", "rope_theta": LLAMA3_ROPE["rope_theta"]}))
    plain = transformers.LlamaForCausalLM(conf0)
    plain.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain_logits = plain.float().eval()(torch.tensor([seq])).logits[0]
    assert max(rel_err(plain_logits[p], want[p]) for p in range(len(seq))) > 10 * TOL

    weights, cfg = load_hf_llama(path)
    assert cfg["rope_type"] == "llama3" and cfg["rope_original_max_pos"] < len(seq)
    max_seq = len(seq)
    mc = ModelConfig.from_dict(cfg)
    til = Tiling.for_config(mc, attn_splits=2, gu_rows=32)
    first, last = (LLAMA3_FIRST, max_seq - 1) if runslow else (LLAMA3_FIRST_DEFAULT, LLAMA3_LAST_DEFAULT)
    assert first < cfg["rope_original_max_pos"] < P <= last
    # positions 0 .. first-1 are prefilled by the eager reference (their K/V rows, RoPE-scaled by the
    # same tables; interpreter time), the kernel decodes first .. last, across original_max_pos = 32
    kv = _cache(cfg, max_seq)
    cs = rope_tables(mc, max_seq)
    for p in range(first):
        decoder_ref(weights, kv, mc, prompt[p], p, cs)
    h = build_decoder(weights, kv, cfg, max_seq, tiling=til)
    toks, errs = [], []
    for p in range(first, last + 1):
        t = prompt[p] if p < P else toks[-1]                            # megatape's own greedy token
        lg = decode_step(h, torch.tensor([t]), p)
        errs.append(rel_err(lg[0], want[p]))
        if p >= P - 1:
            toks.append(int(h.tok))
    teardown(h)
    assert len(toks) == last - P + 2
    assert toks == want_tokens[:len(toks)], f"greedy tokens differ; transformers' top-2 margins {margins}"
    assert max(errs) <= TOL, f"rel err per position {errs}"
