"""Hugging Face interop: load a Llama checkpoint directory into megatape's weights and cfg.

    from interp import load_hf_llama, build_decoder
    weights, cfg = load_hf_llama("path/to/checkpoint")      # config.json + *.safetensors
    h = build_decoder(weights, kv_cache, cfg, max_seq_len)

The directory is the layout ``save_pretrained`` writes: ``config.json`` plus either one
``model.safetensors``, or shards listed by ``model.safetensors.index.json`` (or, without an
index, every ``*.safetensors`` file in it). Tensors are read with the ``safetensors`` library
(transformers is not needed) and converted to contiguous bf16. Names map as

    model.embed_tokens.weight                        -> weights["embed"]
    model.layers.N.input_layernorm.weight            -> weights["layers"][N]["in_norm"]
    model.layers.N.post_attention_layernorm.weight   -> ...["post_norm"]
    model.layers.N.self_attn.{q,k,v,o}_proj.weight   -> ...["q"], ["k"], ["v"], ["o"]
    model.layers.N.mlp.{gate,up,down}_proj.weight    -> ...["gate"], ["up"], ["down"]
    model.norm.weight                                -> weights["final_norm"]
    lm_head.weight                                   -> weights["lm_head"] (the embed tensor itself when
                                                        config.json has tie_word_embeddings)

HF's q/k projections are already in the rotate_half order that megatape's RoPE uses, so no
permutation is needed. Errors name the file and the key: FileNotFoundError for a missing
directory, config.json or shard; ValueError for a missing tensor, a shape that disagrees with
config.json, or a config megatape does not run (a different architecture, biases, an activation
other than SiLU, RoPE scaling other than Llama 3.1 / 3.2's ``rope_type: "llama3"``, shapes the
kernel does not support).

RoPE: ``rope_theta`` becomes ``cfg["theta"]``; Llama 3.1 / 3.2's scaling (``rope_parameters`` in a
transformers v5 config.json, ``rope_scaling`` in a v4 one, with rope_type "llama3") becomes
``cfg["rope_type"] = "llama3"`` plus ``rope_factor``, ``rope_low_freq_factor``,
``rope_high_freq_factor`` and ``rope_original_max_pos`` (its factor, low_freq_factor,
high_freq_factor and original_max_position_embeddings), from which ``opcodes.reference.rope_tables``
builds the rescaled cos/sin tables the kernel reads (the kernel itself is unchanged).

Tensor parallel: ``load_hf_llama(path, tp_rank=r, tp_size=T)`` returns rank ``r``'s shard, the same
tensors as ``opcodes.tp.shard_weights`` of the full load (see ``opcodes/tp.py`` for the split), reading
only the rank's slices from the safetensors files (``safe_open(...).get_slice(name)[a:b]`` for rows,
``[:, a:b]`` for columns: a shard of a 70B model never materialises a full projection). ``embed``
and the norms are read whole (replicated); a tied ``lm_head`` is the rank's vocabulary slice of ``embed``
(a copy; ``embed`` stays whole). The returned cfg is the shard's (``opcodes.tp.shard_config``:
``n_q``, ``n_kv``, ``ffn`` per rank; ``vocab`` the full vocabulary), and ``weights["tp"] = {"rank": r,
"size": T, "full": the full model's cfg dict}``. With ``tp_size=1`` (the default) nothing changes:
no ``"tp"`` key, every tensor read whole.
"""
from __future__ import annotations

import json
import pathlib

import torch

from opcodes import ModelConfig
from opcodes.reference import layer_shapes
from opcodes.tp import LAYER_SPLIT, check_tp, shard_config

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"

#: megatape's per-layer key -> the HF tensor name after ``model.layers.N.``
LAYER_NAMES = {
    "in_norm": "input_layernorm.weight",
    "post_norm": "post_attention_layernorm.weight",
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
}
EMBED, FINAL_NORM, LM_HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
SUPPORTED_MODEL_TYPES = ("llama",)


#: transformers' llama3 rope_parameters / rope_scaling key -> megatape's cfg key
LLAMA3_ROPE_KEYS = {
    "factor": "rope_factor",
    "low_freq_factor": "rope_low_freq_factor",
    "high_freq_factor": "rope_high_freq_factor",
    "original_max_position_embeddings": "rope_original_max_pos",
}


def _rope_params(conf: dict) -> tuple[float, str | None, dict | None, str]:
    """(theta, scaling type or None, the scaling dict, the config key it came from) from a transformers
    v4 (``rope_theta`` + ``rope_scaling``) or v5 (``rope_parameters``) config."""
    rp = conf.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        theta = rp.get("rope_theta", conf.get("rope_theta", 10000.0))
        kind = rp.get("rope_type", rp.get("type"))
        scaling, src = rp, "rope_parameters"
    else:
        theta = conf.get("rope_theta", 10000.0)
        scaling, src = conf.get("rope_scaling"), "rope_scaling"
        kind = None if scaling is None else (scaling.get("rope_type", scaling.get("type"))
                                             if isinstance(scaling, dict) else scaling)
    if kind in (None, "default"):
        return float(theta), None, scaling if isinstance(scaling, dict) else None, src
    return float(theta), str(kind), scaling, src


def _rope_cfg(conf: dict, where: str) -> dict:
    """megatape's RoPE cfg keys (``theta`` and, for Llama 3.1 / 3.2, the llama3 scaling) from ``conf``."""
    theta, kind, scaling, src = _rope_params(conf)
    for holder, name in ((conf, "partial_rotary_factor"),
                         (scaling if isinstance(scaling, dict) else {}, f"{src}['partial_rotary_factor']")):
        prf = holder.get("partial_rotary_factor")
        if prf is not None and prf != 1.0:
            raise ValueError(f"{where}: {name} = {prf!r} is not supported (megatape rotates the whole head_dim)")
    if kind is None:
        return {"theta": theta}
    if kind != "llama3":
        raise ValueError(f"{where}: RoPE scaling type {kind!r} ({src}) is not supported; megatape runs unscaled "
                         f"RoPE (rope_type 'default' or no scaling) and Llama 3.1 / 3.2's rope_type 'llama3'. "
                         f"Got {scaling!r}")
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {src} names rope_type 'llama3' but is not an object with its parameters "
                         f"({', '.join(LLAMA3_ROPE_KEYS)}). Got {scaling!r}")
    rope = {"rope_type": "llama3"}
    for hk, ck in LLAMA3_ROPE_KEYS.items():
        if scaling.get(hk) is None:
            raise ValueError(f"{where}: {src} has rope_type 'llama3' but no {hk!r} (llama3 scaling needs "
                             f"{', '.join(LLAMA3_ROPE_KEYS)}). Got {scaling!r}")
        v = scaling[hk]
        if ck == "rope_original_max_pos" and isinstance(v, float) and v.is_integer():
            v = int(v)          # 8192.0: the same tables as 8192
        rope[ck] = v
    try:     # the scaling alone, so that an error here is not reported as a shape the kernel does not support
        mc = ModelConfig(layers=1, d=2, ffn=1, n_q=1, n_kv=1, hd=2, **rope)
    except (TypeError, ValueError) as e:
        keys = [hk for hk, ck in LLAMA3_ROPE_KEYS.items() if f"cfg[{ck!r}]" in str(e)]
        named = " and ".join(f"{src}[{hk!r}] = {scaling[hk]!r}" for hk in keys) or src
        raise ValueError(f"{where}: bad llama3 RoPE scaling, {named}: {e}") from None
    return {"theta": theta, "rope_type": "llama3", **{ck: getattr(mc, ck) for ck in LLAMA3_ROPE_KEYS.values()}}


def config_from_hf(conf: dict, where: str = CONFIG) -> dict:
    """megatape's cfg dict from a Hugging Face Llama ``config.json`` (already parsed).
    ``where`` names the file in error messages."""
    mt = conf.get("model_type")
    if mt is not None and mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type {mt!r} is not supported (megatape loads {SUPPORTED_MODEL_TYPES})")
    if mt is None and not any("Llama" in a for a in conf.get("architectures") or []):
        raise ValueError(f"{where}: no model_type and no Llama architecture: not a Llama checkpoint")
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if k not in conf:
            raise ValueError(f"{where}: missing key {k!r}")
        v = conf[k]
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"{where}: {k!r} must be a positive int, got {v!r}")
    d, n_q = conf["hidden_size"], conf["num_attention_heads"]
    n_kv = conf.get("num_key_value_heads") or n_q
    act = conf.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{where}: hidden_act {act!r} is not supported (megatape's MLP is SwiGLU with SiLU)")
    for k in ("attention_bias", "mlp_bias"):
        if conf.get(k):
            raise ValueError(f"{where}: {k} = true is not supported (megatape's projections have no bias)")
    hd = conf.get("head_dim")
    if hd is None:
        if d % n_q:
            raise ValueError(f"{where}: hidden_size {d} is not a multiple of num_attention_heads {n_q} and there "
                             "is no head_dim")
        hd = d // n_q
    rope = _rope_cfg(conf, where)
    cfg = {"layers": conf["num_hidden_layers"], "d": d, "ffn": conf["intermediate_size"], "n_q": n_q,
           "n_kv": n_kv, "hd": hd, "eps": float(conf.get("rms_norm_eps", 1e-6)), "theta": rope.pop("theta"),
           "vocab": conf["vocab_size"], **rope}
    try:
        ModelConfig.from_dict(cfg)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: a shape megatape does not support: {e}") from None
    return cfg


def _tensor_files(root: pathlib.Path) -> tuple[dict[str, pathlib.Path] | None, list[pathlib.Path], str]:
    """(tensor name -> file from the index, or None; the files to search; a description)."""
    index = root / INDEX
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index (no weight_map): {e!r}") from None
        return {k: root / v for k, v in wm.items()}, sorted({root / v for v in wm.values()}), str(index)
    single = root / SINGLE
    if single.is_file():
        return None, [single], str(single)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{root}: no {SINGLE}, {INDEX} or *.safetensors file (the checkpoint's weights)")
    return None, files, ", ".join(str(f) for f in files)


class _Reader:
    """Reads named tensors from safetensors files, each file opened once."""

    def __init__(self, root: pathlib.Path):
        from safetensors import safe_open
        self._open = safe_open
        self.index, self.files, self.where = _tensor_files(root)
        self.handles: dict[pathlib.Path, object] = {}
        self.keys: dict[str, pathlib.Path] | None = None

    def _handle(self, f: pathlib.Path, key: str):
        if f not in self.handles:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: missing shard ({INDEX} maps tensor {key!r} to it)")
            try:
                self.handles[f] = self._open(str(f), framework="pt", device="cpu")
            except Exception as e:      # safetensors raises its own error types for a corrupt header
                raise ValueError(f"{f}: not a readable safetensors file: {e}") from None
        return self.handles[f]

    def locate(self, key: str) -> pathlib.Path | None:
        if self.index is not None:
            return self.index.get(key)
        if self.keys is None:
            self.keys = {}
            for f in self.files:
                for k in self._handle(f, "*").keys():
                    self.keys.setdefault(k, f)
        return self.keys.get(key)

    def has(self, key: str) -> bool:
        return self.locate(key) is not None

    def get(self, key: str, shape: tuple[int, ...], device, rows: tuple[int, int] | None = None,
            cols: tuple[int, int] | None = None) -> torch.Tensor:
        """The tensor ``key`` (its full shape checked against ``shape``), or only its rows ``rows`` /
        columns ``cols`` (``(start, stop)``), read through ``get_slice`` so the rest is never read."""
        f = self.locate(key)
        if f is None:
            raise ValueError(f"tensor {key!r} not found in {self.where}")
        h = self._handle(f, key)
        if key not in h.keys():
            raise ValueError(f"{f}: tensor {key!r} is missing ({INDEX} maps it to this file)")
        sl = h.get_slice(key)
        got = tuple(sl.get_shape())
        if got != tuple(shape):
            raise ValueError(f"{f}: tensor {key!r} has shape {got}, config.json implies {tuple(shape)}")
        if rows is not None and tuple(rows) != (0, got[0]):
            t = sl[rows[0]:rows[1]]
        elif cols is not None and tuple(cols) != (0, got[1]):
            t = sl[:, cols[0]:cols[1]]
        else:
            t = h.get_tensor(key)
        if not t.dtype.is_floating_point:
            raise ValueError(f"{f}: tensor {key!r} has dtype {t.dtype}, expected a floating-point dtype")
        # always a fresh allocation: a tensor read from a bf16 file may alias the file's memory map at an
        # offset that is not 16-byte aligned (the kernel loads 16 bytes at a time)
        out = torch.empty(t.shape, dtype=torch.bfloat16, device=device)
        out.copy_(t)
        return out


def hf_config_kwargs(cfg: ModelConfig) -> dict:
    """``transformers.LlamaConfig`` keyword arguments of a whole-model config (the inverse of
    :func:`config_from_hf`; no EOS id: a model of these never stops early)."""
    kw = dict(hidden_size=cfg.d, intermediate_size=cfg.ffn, num_hidden_layers=cfg.layers,
              num_attention_heads=cfg.n_q, num_key_value_heads=cfg.n_kv, head_dim=cfg.hd, vocab_size=cfg.vocab,
              tie_word_embeddings=True, rope_theta=cfg.theta, rms_norm_eps=cfg.eps, hidden_act="silu",
              bos_token_id=0, eos_token_id=None, pad_token_id=None,
              max_position_embeddings=131072 if cfg.rope_type == "llama3" else 4096)
    if cfg.rope_type == "llama3":
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                              "low_freq_factor": cfg.rope_low_freq_factor,
                              "high_freq_factor": cfg.rope_high_freq_factor,
                              "original_max_position_embeddings": cfg.rope_original_max_pos}
    return kw


def read_checkpoint_config(path) -> tuple[pathlib.Path, dict, dict]:
    """(the directory, its config.json, the spec's cfg of it) of the checkpoint directory ``path``;
    FileNotFoundError / ValueError name the file."""
    root = pathlib.Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"{root}: not a checkpoint directory (no such directory)")
    cpath = root / CONFIG
    if not cpath.is_file():
        raise FileNotFoundError(f"{cpath}: missing (a Hugging Face checkpoint directory has config.json beside "
                                "its *.safetensors)")
    conf = read_json(cpath)
    return root, conf, config_from_hf(conf, str(cpath))


def read_json(path: pathlib.Path) -> dict:
    """A JSON object from ``path``; errors name the file."""
    try:
        obj = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return obj


def random_llama(kw: dict, seed: int, max_position_embeddings: int = 128):
    """A transformers ``LlamaForCausalLM(LlamaConfig(**kw))`` whose every weight is drawn here (not
    by transformers' init, which may change between versions): matrices N(0, 0.1^2), norm weights
    1 + N(0, 0.2^2), rounded to bf16. For tests and tutorials: ``.save_pretrained(dir)`` makes a
    checkpoint directory that :func:`load_hf_llama` reads. Needs transformers."""
    import transformers
    conf = transformers.LlamaConfig(**{"max_position_embeddings": max_position_embeddings, **kw})
    m = transformers.LlamaForCausalLM(conf)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(m.named_parameters()):
            r = torch.randn(p.shape, generator=g)
            p.copy_((1.0 + 0.2 * r) if name.endswith("norm.weight") else 0.1 * r)
    return m.to(torch.bfloat16).eval()


def random_llama_on(kw: dict, device, seed: int, std: float = 0.02):
    """A transformers ``LlamaForCausalLM(LlamaConfig(**kw))`` built in bf16 on ``device``, its matrices
    drawn there from N(0, std^2) and its norm weights 1: for benchmarks of real shapes (fast on a
    GPU; the values depend on the device's generator, unlike :func:`random_llama`'s)."""
    import transformers
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
    finally:
        torch.set_default_dtype(old)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=g)
    return model.eval()


def load_hf_llama(path, device="cpu", tp_rank: int = 0, tp_size: int = 1) -> tuple[dict, dict]:
    """Read a Hugging Face Llama checkpoint directory; return ``(weights, cfg)`` for
    ``build_decoder`` (``weights["layers"]`` and ``cfg`` also suit ``build_model``).

    path    : the directory (``config.json`` + ``*.safetensors``, sharded or not)
    device  : where the bf16 tensors go
    tp_rank, tp_size : read only rank ``tp_rank``'s shard of ``tp_size`` (tensor parallel; the module
              docstring): cfg is then the shard's, and ``weights["tp"]`` names the rank, the size and the
              full cfg. The defaults (0, 1) read the whole model.
    cfg is the spec's cfg dict plus ``vocab`` (layers, d, ffn, n_q, n_kv, hd, eps, theta, vocab), and the
    ``rope_*`` keys of the llama3 RoPE scaling when config.json has it.
    With ``tie_word_embeddings`` (config.json) ``weights["lm_head"] is weights["embed"]`` (with ``tp_size`` > 1,
    a copy of the rank's vocabulary slice of it).
    """
    root, conf, cfg = read_checkpoint_config(path)
    mc, sh = check_tp(cfg, tp_rank, tp_size)        # errors name tp_rank / tp_size
    device = torch.device(device)
    rd = _Reader(root)
    shapes, slices = layer_shapes(mc), sh.layer_slices(mc)
    embed = rd.get(EMBED, (mc.vocab, mc.d), device)
    layers = []
    for n in range(mc.layers):
        layers.append({k: rd.get(f"model.layers.{n}.{hf}", shapes[k], device,
                                 **({LAYER_SPLIT[k]: slices[k]} if LAYER_SPLIT[k] else {}))
                       for k, hf in LAYER_NAMES.items()})
    final_norm = rd.get(FINAL_NORM, (mc.d,), device)
    tied = bool(conf.get("tie_word_embeddings", False))
    va, vb = sh.vocab_slice(mc)
    if tied:
        lm_head = embed if (va, vb) == (0, mc.vocab) else embed[va:vb].clone()
    else:
        if not rd.has(LM_HEAD):
            raise ValueError(f"tensor {LM_HEAD!r} not found in {rd.where} (config.json has tie_word_embeddings "
                             "false, so the LM head is a tensor of its own)")
        lm_head = rd.get(LM_HEAD, (mc.vocab, mc.d), device, rows=(va, vb))
    weights = {"embed": embed, "layers": layers, "final_norm": final_norm, "lm_head": lm_head}
    if sh.size == 1:
        return weights, cfg
    weights["tp"] = {"rank": sh.rank, "size": sh.size, "full": dict(cfg)}
    sc = shard_config(mc, sh.rank, sh.size)
    return weights, {**cfg, "n_q": sc.n_q, "n_kv": sc.n_kv, "ffn": sc.ffn}    # cfg's keys, the shard's sizes
