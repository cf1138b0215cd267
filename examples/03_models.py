"""
From one layer to a whole model
===============================

A tape is not limited to one layer: more layers are a longer tape in the same launch, and a whole
model adds an embedding, a final norm, the LM head and a greedy argmax around them. In this
tutorial you will learn how to:

* run several decoder layers in one launch per token with ``build_model`` / ``model_step`` and
  check them against the eager reference;
* load a Hugging Face Llama checkpoint directory with ``interp.hf.load_hf_llama`` (here a tiny
  random ``LlamaForCausalLM`` written with ``save_pretrained``, so nothing is downloaded);
* build the whole model with ``build_decoder`` and decode greedy tokens with ``generate`` (one
  launch per token, the next token never leaves the device), compared with transformers' own.

Run it with ``python examples/03_models.py`` (CPU: the Triton interpreter, ``small-2layer``, under
a minute; on a GPU the default is ``llama3.2-1b``'s 16 layers). The second part needs
``transformers`` and ``safetensors`` (``pip install 'megatape[test]'``).
"""
from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # run from a clone: no install needed

import torch  # noqa: E402  (torch does not import triton)

CUDA = torch.cuda.is_available()
if not CUDA:                                       # no GPU: the kernel runs in the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from interp import build_decoder, build_model, generate, load_hf_llama, model_step, teardown  # noqa: E402
from interp.hf import random_llama  # noqa: E402
from opcodes import ModelConfig  # noqa: E402
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")


def layers_part(preset: str, steps: int) -> None:
    # %%
    # 1. Several layers, one launch
    # -----------------------------
    # ``build_model`` compiles ``cfg['layers']`` layers into one tape (layer l+1's tiles wait on
    # layer l's output counters, so layers overlap where the dataflow allows) and builds the kernel;
    # ``model_step`` runs all of them on one hidden state and appends K/V to every layer's cache.
    cfg = ModelConfig.from_name(preset)
    max_seq, prefill = (64, 37) if cfg.d < 1024 else (1152, 1024)
    w = make_weights(cfg, seed=0, device=DEV)
    kv = make_kv_cache(cfg, max_seq, prefill, seed=1, device=DEV)
    kv_ref = [tuple(t.clone() for t in p) for p in kv]
    h = build_model(w, kv, cfg.to_dict(), max_seq)        # a whole-model cfg (vocab) runs its layers alone here
    print(f"== 1. build_model: {cfg.name}, {cfg.layers} layers in one tape of {len(h.tape)} instructions "
          f"on {h.num_sms} SMs")
    g = torch.Generator().manual_seed(5)
    for i in range(steps):
        x = torch.randn(1, cfg.d, generator=g).to(torch.bfloat16).to(DEV)
        out = model_step(h, x, prefill + i)               # one launch: every layer
        ref = model_ref(w, kv_ref, cfg, x, prefill + i)   # the eager reference, layer by layer
        print(f"model_step pos {prefill + i}: rel err vs reference {rel_err(out, ref):.2e}")
    teardown(h)


def hf_part(n_new: int) -> None:
    try:
        import transformers
    except ImportError:
        print("== 2. transformers is not installed: skipping the Hugging Face part")
        return
    # %%
    # 2. A Hugging Face checkpoint
    # ----------------------------
    # A tiny Llama (2 layers, GQA 2, tied embeddings) with weights drawn here, saved in bf16 exactly
    # as a downloaded checkpoint directory looks: config.json + model.safetensors.
    # (``interp.hf.random_llama`` draws every weight itself, so the model does not depend on
    # transformers' initialisation.)
    model = random_llama(dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                              rope_theta=10000.0, rms_norm_eps=1e-6), seed=3)
    path = pathlib.Path(tempfile.mkdtemp(prefix="megatape-03-"))
    model.save_pretrained(path)
    print(f"== 2. saved a random LlamaForCausalLM to {path}: {sorted(p.name for p in path.iterdir())}")

    # ``load_hf_llama`` returns the weights dict and the cfg (with ``vocab``) that
    # ``build_decoder`` takes; sharded checkpoints and Llama 3's RoPE scaling load too.
    weights, cfg = load_hf_llama(path, device=DEV)
    print(f"load_hf_llama: cfg {cfg}")

    # %%
    # 3. Greedy decoding, one launch per token
    # ----------------------------------------
    # ``build_decoder`` compiles the whole model (embedding, layers, final norm, LM head, argmax).
    # ``generate`` consumes the prompt one position per launch, then keeps going on the token the
    # previous launch's ARGMAX left on the device.
    max_seq = 32
    mc = ModelConfig.from_dict(cfg)
    kv = [tuple(torch.zeros(1, mc.n_kv, max_seq, mc.hd, dtype=torch.bfloat16, device=DEV) for _ in range(2))
          for _ in range(mc.layers)]
    # On a CPU the Triton interpreter runs the SMs' programs one after another, so the fewest
    # instructions is fastest there (interp.textgen.interpreter_options); on a GPU the default tiling.
    from interp.textgen import interpreter_options
    h = build_decoder(weights, kv, cfg, max_seq, **({} if CUDA else interpreter_options(cfg)))
    prompt = [11, 22, 33]
    toks = generate(h, torch.tensor(prompt), n_new).tolist()
    teardown(h)
    # transformers, in fp32, the same greedy loop (a full forward per token)
    ref_model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(n_new):
            seq.append(int(ref_model(torch.tensor([seq])).logits[0, -1].argmax()))
    want = seq[len(prompt):]
    print(f"== 3. megatape generate: {toks}")
    print(f"transformers greedy:    {want}")
    print(f"greedy tokens equal: {sum(a == b for a, b in zip(toks, want))}/{n_new}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--preset", default="llama3.2-1b" if CUDA else "small-2layer",
                    help="the multi-layer model of part 1")
    ap.add_argument("--steps", type=int, default=2, help="model_step calls in part 1")
    ap.add_argument("--new-tokens", type=int, default=8, help="tokens to generate in part 3")
    a = ap.parse_args(argv)
    layers_part(a.preset, a.steps)
    hf_part(a.new_tokens)
    return 0


if __name__ == "__main__":
    sys.exit(main())
