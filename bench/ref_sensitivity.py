"""How far two equally valid bf16 references drift apart: the spec's eager reference (bf16 weights and
activations, fp32 accumulation inside every GEMV) against the same reference with every GEMV summed as
K chunks (still fp32 accumulation, bf16 output), over a model of N layers.

    python3 -m bench.ref_sensitivity [--preset llama70b-layer] [--layers 16] [--chunks 2]

Prints, per layer count, the relative error between the two references and against an all-fp32
reference: the accuracy floor any implementation with a different summation order faces.
"""
from __future__ import annotations

import argparse
import math
import sys

import torch

from opcodes import ModelConfig
from opcodes.reference import layer_ref, make_kv_cache, make_weights, rel_err, rope_tables


class _ChunkedT:
    """``h @ W.T`` computed as the sum of ``chunks`` K slices (fp32), rounded to h's dtype once."""

    def __init__(self, w: torch.Tensor, chunks: int):
        self.w, self.chunks = w, chunks

    @property
    def T(self):
        return self

    def __rmatmul__(self, h):
        K = self.w.shape[1]
        step = math.ceil(K / self.chunks)
        acc = None
        for k0 in range(0, K, step):
            part = h[..., k0:k0 + step].float() @ self.w[:, k0:k0 + step].float().T
            acc = part if acc is None else acc + part
        return acc.to(h.dtype)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama70b-layer")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--chunks", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=4096)
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cfg = ModelConfig.from_name(a.preset).with_layers(a.layers)
    w = make_weights(cfg, seed=0, device=dev)
    kv0 = make_kv_cache(cfg, a.prefill + 8, a.prefill, seed=1, device=dev)
    cs = rope_tables(cfg, a.prefill + 8, device=dev)
    x = torch.randn(1, cfg.d, generator=torch.Generator(device=dev).manual_seed(2), device=dev).to(torch.bfloat16)
    pos = a.prefill

    def run(kind: str):
        kv = [tuple(t.clone() for t in p) for p in kv0]
        outs, y = [], x
        for lw, p in zip(w["layers"], kv):
            if kind == "chunked":
                lw = {k: (_ChunkedT(v, a.chunks) if v.dim() == 2 else v) for k, v in lw.items()}
            if kind == "fp32":
                lw = {k: v.float() for k, v in lw.items()}
                p32 = (p[0].float(), p[1].float())
                y = layer_ref(lw, p32, cfg, y.float(), pos, cs)
            else:
                y = layer_ref(lw, p, cfg, y, pos, cs)
            outs.append(y.float())
        return outs

    plain, chunked, fp32 = run("plain"), run("chunked"), run("fp32")
    name = getattr(torch.cuda, "get_device_name", lambda: "cpu")() if dev.type == "cuda" else "cpu"
    print(f"{name}; {cfg.name}: bf16 reference vs the same with {a.chunks}-chunk GEMVs, and vs all-fp32")
    print("| layers | bf16 ref vs chunked bf16 ref | bf16 ref vs fp32 | chunked vs fp32 |")
    print("|---|---|---|---|")
    for l in range(a.layers):
        if l + 1 in (1, 2, 4, 8, 16, 32, 64, 80) or l + 1 == a.layers:
            print(f"| {l + 1} | {rel_err(chunked[l], plain[l]):.2e} | {rel_err(plain[l], fp32[l]):.2e} | "
                  f"{rel_err(chunked[l], fp32[l]):.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
