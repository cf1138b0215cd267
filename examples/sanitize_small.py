"""A few decode steps of a small config, for compute-sanitizer (memcheck / racecheck). Needs an NVIDIA GPU
(CUDA): it does not run on a CPU, not even in the Triton interpreter (compute-sanitizer checks GPU code):

    compute-sanitizer --tool memcheck python3 examples/sanitize_small.py
    compute-sanitizer --tool racecheck python3 examples/sanitize_small.py
"""
from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from interp import build_layer, layer_step, teardown  # noqa: E402
from opcodes import PRESETS  # noqa: E402
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err  # noqa: E402


def main() -> int:
    name = sys.argv[1] if len(sys.argv) > 1 else "small-2layer"
    if not torch.cuda.is_available():
        print("examples/sanitize_small.py needs an NVIDIA GPU (CUDA): torch sees none here. It is what "
              "compute-sanitizer runs; on a CPU run examples/01_compile_a_layer.py instead.", file=sys.stderr)
        return 2
    cfg = PRESETS[name]
    dev = torch.device("cuda")
    w = make_weights(cfg, device=dev)
    kv = make_kv_cache(cfg, 64, 37, device=dev)
    kv_ref = [tuple(t.clone() for t in p) for p in kv]
    h = build_layer(w, kv, cfg.to_dict(), 64, num_sms=16)
    worst = 0.0
    g = torch.Generator(device=dev).manual_seed(7)          # the same inputs under every tool
    for pos in range(37, 41):
        x = torch.randn(1, cfg.d, device=dev, generator=g).to(torch.bfloat16)
        out = layer_step(h, x, pos)
        worst = max(worst, rel_err(out, model_ref(w, kv_ref, cfg, x, pos)))
    h.check()
    teardown(h)
    print(f"sanitize_small {name}: 4 steps, max rel err {worst:.2e}", flush=True)
    return 0 if worst <= 1.5e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
