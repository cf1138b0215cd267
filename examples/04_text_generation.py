"""
Text in, text out
=================

``megatape generate`` reads a Hugging Face Llama checkpoint directory (config.json, the
safetensors, tokenizer.json), runs the prompt one launch per token and streams the text. In this
tutorial you will learn how to:

* make a tiny checkpoint with no download: a byte-level BPE tokenizer trained here with the
  ``tokenizers`` library and a random ``LlamaForCausalLM`` (2 layers, d 64), both written with
  ``save_pretrained`` (a random model: its text is gibberish);
* generate greedily (the ARGMAX opcode) and by sampling on the device (the SAMPLE opcode:
  temperature, top-k, top-p, Philox seeded by the seed and the position), from the command line;
* do the same from Python with ``interp.textgen``: the streamed pieces, a stop string, the timings.

Run it with ``python examples/04_text_generation.py [--out DIR]`` (CPU: the Triton interpreter, about
half a minute; needs ``transformers``, ``tokenizers`` and ``safetensors``: ``pip install
'megatape[test]'``). ``DIR`` (default: a temporary directory, printed) keeps the checkpoint for
``megatape generate --model DIR``.
"""
from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # run from a clone: no install needed

import torch  # noqa: E402  (torch does not import triton)

if not torch.cuda.is_available():                  # no GPU: the kernel runs in the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

CORPUS = ["The café serves crème brûlée and café au lait.", "漢字 and かな are written in Japan; 漢字 came from China.",
          "Once upon a time there was a small model that wrote text.", "Déjà vu: the naïve coöperation of the élite.",
          "Tokens, bytes and characters: é is two bytes, 漢 is three."]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_checkpoint(out: pathlib.Path, seed: int = 3) -> None:
    # %%
    # 1. A tiny checkpoint
    # --------------------
    # The tokenizer: byte-level BPE, so any text encodes (a character it never merged is split into
    # its bytes, which is what streaming has to get right). The model: ``interp.hf.random_llama``
    # draws every weight (matrices N(0, 0.1^2), norms 1 + N(0, 0.2^2), in bf16); its vocabulary is
    # the tokenizer's.
    import tokenizers
    import transformers
    from interp.hf import random_llama
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, tokenizers.trainers.BpeTrainer(
        vocab_size=384, special_tokens=["<s>", "</s>"], show_progress=False,
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    m = random_llama(dict(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True,
                          bos_token_id=0, eos_token_id=1), seed, max_position_embeddings=64)
    m.save_pretrained(out)
    print(f"wrote {out}: " + ", ".join(sorted(f.name for f in out.iterdir())))


def command_line(out: pathlib.Path, n: int) -> None:
    # %%
    # 2. megatape generate
    # --------------------
    # Greedy by default; --temperature > 0 samples on the device. The text goes to stdout as the
    # tokens arrive, the counts and timings to stderr.
    from megatape.cli import main
    for extra in ([], ["--temperature", "0.8", "--top-k", "50", "--top-p", "0.95", "--seed", "1"]):
        argv = ["generate", "--model", str(out), "--prompt", "The café", "--max-new-tokens", str(n), *extra]
        print(f"\n$ megatape {shlex.join(argv)}", flush=True)
        rc = main(argv)
        sys.stderr.flush()
        print(f"\n(exit status {rc})", flush=True)


def python_api(out: pathlib.Path, n: int) -> None:
    # %%
    # 3. The same from Python
    # -----------------------
    # ``Checkpoint.open`` checks config.json and the tokenizer and collects the EOS ids;
    # ``build`` reads the weights and compiles a decoder (``sampling=True``: SAMPLE, not ARGMAX);
    # ``generate_text`` yields the text as it becomes final (never half a character, never a stop
    # string) and keeps the counts and timings.
    from interp.runtime import teardown
    from interp.textgen import Checkpoint, generate_text
    ck = Checkpoint.open(out)
    ids = ck.encode("Once upon")
    print(f"\nprompt ids {ids}; EOS ids {ck.eos_token_ids}")
    h = ck.build(max_seq=len(ids) + n, sampling=True)
    try:
        for seed in (1, 1, 2):
            gen = generate_text(h, ck.tokenizer, ids, n, temperature=1.0, top_p=0.9, seed=seed,
                                eos_token_ids=ck.eos_token_ids, stop=["\n"])
            pieces = list(gen)
            print(f"seed {seed}: {len(pieces)} pieces {pieces!r}; stopped by {gen.stats.stop_reason} after "
                  f"{gen.stats.new_tokens} tokens")
    finally:
        teardown(h.layer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--out", default=None, help="directory for the tiny checkpoint (created; default: a temporary directory)")
    ap.add_argument("--new-tokens", type=int, default=8)
    a = ap.parse_args()
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="megatape-04-"))
    out.mkdir(parents=True, exist_ok=True)
    make_checkpoint(out)
    command_line(out, a.new_tokens)
    python_api(out, a.new_tokens)


if __name__ == "__main__":
    main()
