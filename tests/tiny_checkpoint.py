"""A tiny Hugging Face Llama checkpoint directory built with no download, shared by the test modules
that run text in / text out (``test_generate.py``, ``test_serve.py``).

A BPE tokenizer (byte level) trained with the ``tokenizers`` library on :data:`CORPUS` (multi-byte
characters included), wrapped as a ``PreTrainedTokenizerFast`` with a chat template, and a tiny random
``LlamaForCausalLM`` (2 layers, d 64, its vocabulary the tokenizer's; ``interp.hf.random_llama``, whose
weights do not depend on ``max_position_embeddings``) with its final norm scaled by :data:`NORM_SCALE`,
both saved with ``save_pretrained`` into one directory. Needs transformers and tokenizers (import this
module after ``pytest.importorskip`` of both).
"""
from __future__ import annotations

import torch

from conftest import random_llama

CORPUS = ["The café serves crème brûlée and café au lait.", "漢字 and かな are written in Japan; 漢字 came from China.",
          "Once upon a time there was a small model that wrote text.", "Déjà vu: the naïve coöperation of the élite.",
          "Tokens, bytes and characters: é is two bytes, 漢 is three."]
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
KW = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
          head_dim=32, tie_word_embeddings=True, rope_theta=10000.0, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1)
# The seed and prompt were picked so that transformers' top-2 logit margin stays >= 0.3 over the 8
# greedy steps (megatape's logits differ from transformers' by ~0.02): the final norm is scaled by 3,
# which scales the logits (and the margins) without changing the greedy tokens of the model.
SEED, PROMPT, N_NEW, NORM_SCALE, MIN_MARGIN = 3, "The café", 8, 3.0, 0.1
MAX_POS = 64


def tokenizer():
    import tokenizers
    import transformers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>", "</s>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_tiny_checkpoint(path, max_position_embeddings: int = MAX_POS):
    """Write the tokenizer and the model into ``path``; returns the tokenizer."""
    tok = tokenizer()
    tok.save_pretrained(path)
    m = random_llama(dict(KW, vocab_size=len(tok)), SEED, max_position_embeddings=max_position_embeddings)
    with torch.no_grad():
        m.model.norm.weight.mul_(NORM_SCALE)
    m.save_pretrained(path)
    return tok
