"""Where a decode row's bits part between the rows buckets (bench/notes/s49.md: runs 317-318 found row 0 of a 32-row
step not bitwise row 0 alone, R1 = R16 still bitwise, and the R32 kernel's output the same at 5 and 8 stages).

    python -m bench.probes.bucket_probe [--preset llama3.2-1b] [--pos 1024]      (a GPU)
    python -m bench.probes.bucket_probe --tiny                                    (CPU, the Triton interpreter)

One handle of 32 slots (``rows_bench``'s weights and cache, seeds 0 / 1). Row 0 (slot 0, token 1234, position
pos + 40) is run: (a) alone (the 16-row bucket), (b) alone in the 32-row bucket (``min_rows=32``: nobody else in the
step), (c) beside 31 other slots' rows (the 32-row bucket), (d) alone again. For each run: the logits, slot 0's K/V
at that position (every layer), and row 0's values in every scratch buffer of the bucket's kernel (flat buffers:
feature-major ``[.., features, R]``, but ``attn_r``'s ``[layers, R, features]``). Printed: which of (b)-(d) equal
(a) bitwise, and for each tensor that differs the first element (and layer) where it does: the first opcode
whose output parts the buckets.
"""
from __future__ import annotations

import argparse
import sys

import torch


#: scratch buffers a row's features contiguous in ([layers, R, features]: opcodes.rows_attn); the others
#: feature-major ([.., features, R])
ROW_MAJOR = ("attn_r",)


def snapshot(h, dh, lg, slot: int, p: int, R: int) -> dict:
    """The logits row 0, slot ``slot``'s K/V at ``p`` (each layer), and row 0 of each [.., R] scratch buffer."""
    snap = {"logits": lg[0].float().cpu()}
    for i, (k, v) in enumerate(dh.kv_rows):
        snap[f"k{i}"] = k[slot, :, p].float().cpu()
        snap[f"v{i}"] = v[slot, :, p].float().cpu()
    for name, t in h.scratch.items():     # flat buffers, [.., features, R] (one column block in a decode bucket)
        if name in ROW_MAJOR:
            snap["scratch:" + name] = t.view(h.lay.cfg.layers, R, -1)[:, 0].flatten().float().cpu()
        elif t.numel() % R == 0:
            snap["scratch:" + name] = t.view(-1, R)[:, 0].float().cpu()
    return snap


def first_diff(a: torch.Tensor, b: torch.Tensor, layers: int) -> str:
    """"equal", or where the first element of row 0's vector differs (with the layer, where the vector is
    ``layers`` or ``layers + 1`` equal parts), how many do and by how much."""
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} / {tuple(b.shape)}"
    d = (a != b) & ~(torch.isnan(a) & torch.isnan(b))
    if not d.any():
        return "equal"
    i, n = int(d.nonzero()[0, 0]), a.numel()
    where = next((f" (layer part {i // (n // p)} of {p})" for p in (layers, layers + 1) if n % p == 0 and n > p), "")
    return f"first at {i} of {n}{where}, {int(d.sum())} elements, max |diff| {float((a - b).abs()[d].max()):.3e}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.probes.bucket_probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="llama3.2-1b")
    ap.add_argument("--pos", type=int, default=1024)
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU (the Triton interpreter)")
    a = ap.parse_args(argv)
    from bench.decoder_bench import make_decoder_weights
    from interp import build_decoder
    from interp.rows import decode_rows
    from opcodes.config import ModelConfig
    from opcodes.reference import make_kv_cache
    if a.tiny:
        cfg, dev, pos = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200,
                                    name="tiny-rows"), "cpu", 8
    else:
        if not torch.cuda.is_available():
            print("bucket_probe: needs a GPU (or --tiny)", file=sys.stderr)
            return 2
        cfg, dev, pos = ModelConfig.from_name(a.preset), "cuda", a.pos
    max_seq = -(-(pos + 64) // 128) * 128
    w = make_decoder_weights(cfg, seed=0, device=dev)
    kv = make_kv_cache(cfg, max_seq, pos, seed=1, device=dev, batch=32)
    dh = build_decoder(w, kv, cfg, max_seq, batch=32)
    p0, t0 = pos + 40, 1234 % cfg.vocab
    runs = {}
    for name, R, min_rows in (("a: alone, R16", 1, 1), ("b: alone, R32", 1, 32), ("c: 32 rows, R32", 32, 1),
                              ("d: alone, R16 again", 1, 1)):
        toks = [t0] + [(29 * r + 3) % cfg.vocab for r in range(1, R)]
        lg = decode_rows(dh, toks, [p0] * R, list(range(R)), min_rows=min_rows)
        b = 16 if max(R, min_rows) <= 16 else 32
        runs[name] = snapshot(dh.rows[b], dh, lg, 0, p0, b)
    base = runs["a: alone, R16"]
    for name, snap in runs.items():
        if name.startswith("a:"):
            continue
        diffs = {k: first_diff(base[k], snap[k], cfg.layers) for k in base if k in snap}
        bad = {k: v for k, v in diffs.items() if v != "equal"}
        verdict = "bitwise equal to (a) in every compared tensor" if not bad else f"{len(bad)} of {len(diffs)} differ"
        print(f"{name}: {verdict}")
        for k, v in bad.items():
            print(f"    {k}: {v}")
    print(f"scratch compared: {sorted(k for k in base if k.startswith('scratch:'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
