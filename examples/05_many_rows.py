"""
Many rows per step: chunked prefill and batched decode
======================================================

One decode step of the megakernel can carry R rows, each a (sequence slot, position): a prefill chunk is
R consecutive positions of one slot, batched decode is one row per slot, and both are one launch of a rows
kernel (buckets of 16 to 1024 rows). In this tutorial you will learn how to:

* build a decoder over a KV cache of B sequence slots (``build_decoder(..., batch=B)``);
* fill two slots with prompts of different lengths (``prefill``), in chunks;
* decode the slots together (``decode_step`` with one row a slot, at each slot's own position) and check
  every row against the fp32 reference with the multi-layer criterion;
* see that a row's logits do not depend on what else is in the step (bitwise), and that a bad call
  (a position past ``max_seq_len``) is refused before the cache is touched.

Run it with ``python examples/05_many_rows.py`` (CPU: the Triton interpreter, a tiny random model, about
ten seconds; on a GPU ``--preset llama3.2-1b`` runs the 1B shape).
"""
from __future__ import annotations

import argparse
import math
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # run from a clone: no install needed

import torch  # noqa: E402  (torch does not import triton)

CUDA = torch.cuda.is_available()
if not CUDA:                                       # no GPU: the kernel runs in the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from interp import build_decoder, decode_step, prefill, teardown  # noqa: E402
from opcodes import ModelConfig  # noqa: E402
from opcodes.decoder import decoder_ref_rows, decoder_ref_rows_fp32, random_model_weights  # noqa: E402
from opcodes.reference import make_kv_cache, rel_err  # noqa: E402

DEV = torch.device("cuda" if CUDA else "cpu")
TINY = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    p.add_argument("--preset", default="", help="a model shape (ModelConfig.from_name); default: a tiny one")
    a = p.parse_args(argv)
    cfg = ModelConfig.from_name(a.preset) if a.preset else TINY
    B, max_seq = 4, (48 if cfg is TINY else 1152)
    # %%
    # 1. Weights and a cache of B slots
    # ---------------------------------
    # A whole model's weights: random layers plus the embedding, the final norm and the LM head. The cache:
    # per layer a (k, v) pair, each ``(B, n_kv, max_seq_len, hd)`` bf16, written in place.
    w = random_model_weights(cfg, device=DEV)
    kv = make_kv_cache(cfg, max_seq, 0, device=DEV, batch=B)           # every slot empty
    h = build_decoder(w, kv, cfg.to_dict(), max_seq, batch=B)
    kv32 = [tuple(t.float() for t in pair) for pair in kv]              # the fp32 reference's own cache
    kvbf = [tuple(t.clone() for t in pair) for pair in kv]              # the bf16 reference's
    print(f"== 1. {cfg.name}: {cfg.layers} layers, d {cfg.d}, vocab {cfg.vocab}; {B} slots x {max_seq} positions")

    # %%
    # 2. Prefill two slots
    # --------------------
    # ``prefill(h, tokens, start_pos, slot)`` writes the prompt's K/V into the slot's cache a chunk a launch
    # (``chunk`` rows; by default 1024 while that many remain, then 512s) and returns the last position's
    # logits ``(1, vocab)``.
    g = torch.Generator().manual_seed(7)
    prompts = {0: torch.randint(0, cfg.vocab, (13,), generator=g).tolist(),
               2: torch.randint(0, cfg.vocab, (6,), generator=g).tolist()}
    nxt = {}
    for slot, prompt in prompts.items():
        lg = prefill(h, prompt, start_pos=0, slot=slot, chunk=8)
        n = len(prompt)
        ref32 = decoder_ref_rows_fp32(w, kv32, cfg, prompt, [slot] * n, list(range(n)))[-1:]
        ref = decoder_ref_rows(w, kvbf, cfg, prompt, [slot] * n, list(range(n)))[-1:]
        nxt[slot] = int(lg.argmax())
        k = math.ceil(n / 8)
        print(f"prefill slot {slot}: {n} tokens in {k} launch{'es' if k > 1 else ''}; logits {tuple(lg.shape)}; "
              f"err vs fp32 {rel_err(lg, ref32):.2e} (the bf16 reference's {rel_err(ref, ref32):.2e}); "
              f"next token {nxt[slot]}")

    # %%
    # 3. Decode the slots together
    # ----------------------------
    # ``decode_step(h, tokens, pos, slots)``: row r is ``tokens[r]`` of slot ``slots[r]`` at ``pos[r]``;
    # one launch for all of them, ``(R, vocab)`` fp32 logits back. The criterion for a whole model: each row's
    # error against the fp32 reference at most 1.1x the bf16 reference's own.
    slots = [0, 2]
    pos = [len(prompts[s]) for s in slots]
    for step in range(2):
        toks = [nxt[s] for s in slots]
        lg = decode_step(h, toks, pos, slots=slots)
        ref32 = decoder_ref_rows_fp32(w, kv32, cfg, toks, slots, pos)
        ref = decoder_ref_rows(w, kvbf, cfg, toks, slots, pos)
        for r, s in enumerate(slots):
            e, e_ref = rel_err(lg[r], ref32[r]), rel_err(ref[r], ref32[r])
            print(f"step {step} slot {s} pos {pos[r]}: err {e:.2e} vs the bf16 reference's {e_ref:.2e}: "
                  f"{'meets' if e <= 1.1 * e_ref else 'MISSES'} the criterion")
            nxt[s] = int(lg[r].argmax())
        pos = [q + 1 for q in pos]

    # %%
    # 4. A row does not depend on the others
    # --------------------------------------
    # The columns of a tile are independent and attention is per row: slot 0's row alone and beside slot 2's
    # gives the same bits (the same token at the same position writes the same K/V again).
    alone = decode_step(h, [nxt[0]], [pos[0]], slots=[0])
    both = decode_step(h, [nxt[0], nxt[2]], pos, slots=slots)
    print(f"slot 0 alone and beside slot 2: bitwise equal {torch.equal(alone[0], both[0])}")

    # %%
    # 5. Bad calls fail before anything is written
    # --------------------------------------------
    before = [tuple(t.clone() for t in pair) for pair in kv]
    try:
        decode_step(h, [nxt[0], 5], [pos[0], max_seq], slots=[0, 1])
    except ValueError as e:
        print(f"refused: {e}")
    same = all(torch.equal(t, t0) for pair, pair0 in zip(kv, before) for t, t0 in zip(pair, pair0))
    print(f"cache untouched: {same}; rows kernels built: {sorted(h.rows)}")
    teardown(h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
