"""Text in, text out: a Hugging Face Llama checkpoint directory, its tokenizer and streamed text.

    from interp.textgen import Checkpoint, generate_text
    ck = Checkpoint.open("path/to/checkpoint")          # config.json (a Llama), tokenizer.json, EOS ids
    ids = ck.encode("Once upon a time", chat=False)      # chat=True: the tokenizer's chat template
    h = ck.build(max_seq=len(ids) + 64, sampling=True)   # weights (load_hf_llama) + a fresh KV cache
    gen = generate_text(h, ck.tokenizer, ids, 64, temperature=0.8, top_p=0.95, seed=1,
                        eos_token_ids=ck.eos_token_ids, stop=["\\n\\n"])
    for piece in gen:                                    # text as the tokens arrive
        print(piece, end="", flush=True)
    gen.text, gen.stats                                  # the whole text; token counts and timings

``megatape generate`` (``megatape/cli.py``) is this, on the command line. The tokens come from
``interp.decoder.generate_stream`` (one launch per token; greedy ARGMAX or the on-device SAMPLE);
:class:`TextStream` turns them into text: it decodes the whole list of new tokens each time and
hands out only the new suffix, once the text does not end in U+FFFD (a character whose bytes are
still arriving) and without any text that could be the start of a stop string, so the pieces add
up to the final text exactly, multi-byte characters included, and never contain a stop string.

transformers (``AutoTokenizer``, reading ``tokenizer.json``) is needed for the tokenizer only.
"""
from __future__ import annotations

import math
import pathlib
import time
from dataclasses import dataclass, field

import torch

from .decoder import DecoderHandle, build_decoder, generate_stream
from .hf import load_hf_llama, read_checkpoint_config, read_json

TOKENIZER_FILE = "tokenizer.json"
GENERATION_CONFIG = "generation_config.json"
REPLACEMENT = "\ufffd"


def _ids(v) -> list[int]:
    """An eos_token_id value (int, list of ints or None) as a list."""
    if v is None:
        return []
    if isinstance(v, int) and not isinstance(v, bool):
        return [v]
    if isinstance(v, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
        return list(v)
    return []


def load_tokenizer(path):
    """transformers' ``AutoTokenizer`` of a checkpoint directory (which must hold tokenizer.json)."""
    root = pathlib.Path(path)
    if not (root / TOKENIZER_FILE).is_file():
        raise FileNotFoundError(f"{root}: no tokenizer ({TOKENIZER_FILE} is missing)")
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise ImportError("reading the tokenizer needs transformers (pip install transformers)") from None
    try:
        return AutoTokenizer.from_pretrained(str(root))
    except Exception as e:         # transformers raises OSError / ValueError / its own types
        raise ValueError(f"{root}: the tokenizer does not load: {type(e).__name__}: {e}") from None


@dataclass
class Checkpoint:
    """A Hugging Face Llama checkpoint directory: its config (checked), tokenizer and EOS ids;
    the weights are read by :meth:`build` (or :meth:`load_weights`)."""

    path: pathlib.Path
    conf: dict                      # config.json
    cfg: dict                       # megatape's cfg (interp.hf.config_from_hf)
    tokenizer: object
    eos_token_ids: list[int]        # generation_config.json, config.json and the tokenizer's, in that order
    weights: dict | None = field(default=None, repr=False)

    @classmethod
    def open(cls, path) -> "Checkpoint":
        """Check the directory, config.json (a Llama megatape runs) and the tokenizer; no weights
        are read yet. FileNotFoundError / ValueError name the file."""
        root, conf, cfg = read_checkpoint_config(path)
        tok = load_tokenizer(root)
        eos: list[int] = []
        gpath = root / GENERATION_CONFIG
        for v in ((read_json(gpath).get("eos_token_id") if gpath.is_file() else None), conf.get("eos_token_id"),
                  getattr(tok, "eos_token_id", None)):
            eos += [t for t in _ids(v) if t not in eos]
        return cls(root, conf, cfg, tok, eos)

    @property
    def context(self) -> int | None:
        """config.json's max_position_embeddings (None if absent)."""
        v = self.conf.get("max_position_embeddings")
        return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None

    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """The prompt's token ids; ``chat``: wrapped in the tokenizer's chat template as one user
        message with the generation prompt (ValueError naming ``chat`` if there is no template)."""
        if not isinstance(prompt, str):
            raise TypeError(f"prompt: expected a str, got {type(prompt).__name__}")
        tok = self.tokenizer
        if chat:
            if not getattr(tok, "chat_template", None):
                raise ValueError(f"chat: the tokenizer in {self.path} has no chat template")
            ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                          tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):      # a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tok(prompt)["input_ids"]
        ids = [int(t) for t in ids]
        if not ids:
            raise ValueError("prompt: no tokens (an empty prompt and a tokenizer that adds no BOS)")
        vocab = self.cfg["vocab"]
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token ids {bad[:4]} are outside the model's vocabulary [0, {vocab})")
        return ids

    def load_weights(self, device="cpu") -> dict:
        if self.weights is None:
            self.weights, _ = load_hf_llama(self.path, device=device)
        return self.weights

    def build(self, max_seq: int, sampling: bool = False, device=None, **options) -> DecoderHandle:
        """A decoder for this checkpoint with a fresh (zero) KV cache of ``max_seq`` positions on
        ``device`` (default: CUDA if available, else the CPU through the Triton interpreter, with
        :func:`interpreter_options` unless ``tiling`` / ``lm_rows`` are given); ``options`` go to
        ``build_decoder``."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if torch.device(device).type == "cpu" and not {"tiling", "lm_rows"} & set(options):
            options = {**interpreter_options(self.cfg), **options}
        w = self.load_weights(device)
        mc = self.cfg
        hd = mc["hd"]
        kv = [tuple(torch.zeros(1, mc["n_kv"], max_seq, hd, dtype=torch.bfloat16, device=device) for _ in range(2))
              for _ in range(mc["layers"])]
        return build_decoder(w, kv, mc, max_seq, sampling=sampling, **options)


def interpreter_options(cfg) -> dict:
    """``build_decoder`` options for the Triton interpreter: the fewest instructions (the
    interpreter runs the SMs' programs one after another, so on a CPU the number of instructions
    counts, not their parallelism): whole heads per QKV tile, 2 attention splits, large row tiles
    and one LM head tile for a small vocabulary."""
    from opcodes import ModelConfig, Tiling, next_pow2
    mc = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    qkv = mc.hd & -mc.hd                 # the largest power of two dividing hd
    d = next_pow2(mc.d)
    tiling = Tiling.for_config(mc, attn_splits=2, qkv_rows=min(qkv, 64), gu_rows=min(128, next_pow2(mc.ffn)),
                               gu_tiles=0, o_rows=min(256, d), down_rows=min(256, d), red_rows=min(1024, d))
    return {"tiling": tiling, "lm_rows": min(512, next_pow2(mc.vocab))}


class TextStream:
    """Token ids in, text out, as it becomes final: :meth:`push` a token, get the new text ('' if
    none yet); :meth:`finish` hands out the rest. The pieces add up to ``decode(ids)`` (cut before
    the first stop string, if one appears)."""

    def __init__(self, tokenizer, stop=()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop]
        self.ids: list[int] = []
        self.printed = ""
        self.stopped = False

    def _decode(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def _cut(self, text: str) -> str | None:
        hits = [text.find(s) for s in self.stop]
        hits = [h for h in hits if h >= 0]
        return text[:min(hits)] if hits else None

    def _emit(self, upto: str) -> str:
        if not upto.startswith(self.printed) or len(upto) <= len(self.printed):
            return ""
        new = upto[len(self.printed):]
        self.printed = upto
        return new

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(int(token_id))
        text = self._decode()
        cut = self._cut(text)
        if cut is not None:
            self.stopped = True
            return self._emit(cut)
        if text.endswith(REPLACEMENT):         # a character whose bytes are still arriving
            return ""
        hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
        return self._emit(text[:len(text) - hold])

    def finish(self) -> str:
        """The rest of the text (what was held back); the stream is final after this."""
        if self.stopped:
            return ""
        text = self._decode()
        cut = self._cut(text)
        return self._emit(text if cut is None else cut)

    @property
    def text(self) -> str:
        return self.printed


@dataclass
class GenerationStats:
    prompt_tokens: int
    new_tokens: int = 0
    first_token_s: float = float("nan")    # from the first prompt launch to the first new token on the host
    decode_s: float = float("nan")         # from the first new token to the last
    stop_reason: str = ""                  # 'eos', 'stop', 'max_new_tokens'
    last_pos: int = 0                      # the position whose step made the last token

    @property
    def decode_tokens_per_s(self) -> float:
        if self.new_tokens < 2 or not self.decode_s > 0:
            return float("nan")
        return (self.new_tokens - 1) / self.decode_s


class TextGeneration:
    """What :func:`generate_text` returns: iterate it for the text pieces as they come; then
    ``text`` is the whole text, ``tokens`` the new token ids (an EOS that ended it included) and
    ``stats`` a :class:`GenerationStats`."""

    def __init__(self, handle, tokenizer, prompt_ids, max_new_tokens, sampling: dict, eos_token_ids, stop):
        self.stream = TextStream(tokenizer, stop)
        self.eos = set(eos_token_ids)
        self.prompt_len = len(prompt_ids)
        self.max_new_tokens = max_new_tokens
        self.stats = GenerationStats(prompt_tokens=self.prompt_len)
        self.tokens: list[int] = []
        self._tokens = generate_stream(handle, list(prompt_ids), max_new_tokens, eos_token_ids=sorted(self.eos),
                                       **sampling)           # checks every argument now
        self._used = False

    def __iter__(self):
        if self._used:
            raise RuntimeError("a TextGeneration can be iterated once")
        self._used = True
        st = self.stats
        t0 = time.perf_counter()
        t_first = None
        reason = "max_new_tokens"
        for t in self._tokens:
            now = time.perf_counter()
            if t_first is None:
                t_first = now
                st.first_token_s = now - t0
            st.decode_s = now - t_first
            self.tokens.append(t)
            st.new_tokens = len(self.tokens)
            if t in self.eos:
                reason = "eos"
                break
            piece = self.stream.push(t)
            if piece:
                yield piece
            if self.stream.stopped:
                reason = "stop"
                break
        self._tokens.close()
        st.last_pos = self.prompt_len - 1 + max(0, len(self.tokens) - 1)     # where the last token was made
        st.stop_reason = reason
        rest = self.stream.finish()
        if rest:
            yield rest

    @property
    def text(self) -> str:
        return self.stream.text


def generate_text(handle: DecoderHandle, tokenizer, prompt_ids, max_new_tokens: int, *, temperature: float = 0.0,
                  top_k: int = 0, top_p: float = 1.0, seed: int = 0, eos_token_ids=(), stop=()) -> TextGeneration:
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` on a decoder handle and turn
    them into text (:class:`TextGeneration`: iterate it for the pieces). Stops at an EOS id (not
    printed), at the first stop string (not printed) or after ``max_new_tokens``. Sampling
    arguments as ``interp.decoder.generate``; all of them are checked here, before anything runs."""
    if isinstance(stop, str):
        stop = [stop]
    stop = list(stop)
    if not all(isinstance(s, str) and s for s in stop):
        raise ValueError(f"stop: expected non-empty strings, got {stop!r}")
    return TextGeneration(handle, tokenizer, prompt_ids, max_new_tokens,
                          dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                          list(eos_token_ids or ()), stop)


def floor_seconds(cfg, pos: int, bandwidth: float) -> float:
    """The bandwidth floor of one decode step at ``pos``: the bytes it must move (weights, KV,
    LM head) over ``bandwidth`` bytes/s."""
    from opcodes import ModelConfig
    mc = cfg if isinstance(cfg, ModelConfig) else ModelConfig.from_dict(cfg)
    return mc.bytes_per_step(pos) / bandwidth if bandwidth > 0 else math.nan
