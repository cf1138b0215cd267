"""Issue 50's baseline: transformers' forward over a whole prompt (sdpa attention, bf16), the time to
first token a prefill must beat. Random weights of a preset's shape on the GPU; CUDA-event medians.

    python -m bench.ttft_baseline [--presets llama3.2-1b,llama3.1-8b] [--lens 128,1024,4096] [--reps 10]

Prints one Markdown table (preset, prompt length, ms median / min, tokens/s of prefill) and, with --out DIR,
writes ttft-baseline.json there. Needs a CUDA GPU and transformers."""
from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import sys

import torch


def forward_ms(model, ids: torch.Tensor, reps: int) -> list[float]:
    """Milliseconds of ``model(ids)`` (no cache kept, logits of the last position only), ``reps`` times
    after two warm-ups."""
    def once():
        with torch.no_grad():
            try:
                out = model(input_ids=ids, use_cache=False, logits_to_keep=1)
            except TypeError:               # a transformers without logits_to_keep: every position's logits
                out = model(input_ids=ids, use_cache=False)
        return out.logits
    for _ in range(2):
        once()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        logits = once()
        b.record()
        torch.cuda.synchronize()
        if not torch.isfinite(logits).all():
            raise RuntimeError("transformers' forward gave non-finite logits")
        times.append(a.elapsed_time(b))
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ttft_baseline", description=__doc__.splitlines()[0])
    p.add_argument("--presets", default="llama3.2-1b,llama3.1-8b")
    p.add_argument("--lens", default="128,1024,4096")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("python -m bench.ttft_baseline: needs a CUDA GPU", file=sys.stderr)
        return 2
    from interp.hf import hf_config_kwargs, random_llama_on
    from opcodes.config import ModelConfig
    lens = [int(x) for x in a.lens.split(",")]
    rows = []
    name = torch.cuda.get_device_name()
    for preset in a.presets.split(","):
        cfg = ModelConfig.from_name(preset)
        kw = hf_config_kwargs(cfg)
        kw["max_position_embeddings"] = max(kw["max_position_embeddings"], max(lens) + 8)
        kw["attn_implementation"] = "sdpa"
        model = random_llama_on(kw, "cuda", seed=0)
        g = torch.Generator().manual_seed(1)
        for n in lens:
            ids = torch.randint(0, cfg.vocab, (1, n), generator=g).cuda()
            t = forward_ms(model, ids, a.reps)
            med = statistics.median(t)
            rows.append(dict(card=name, preset=preset, prompt=n, ms_median=med, ms_min=min(t), reps=a.reps,
                             prefill_tokens_per_s=n / med * 1e3))
            print(f"{preset} prompt {n}: {med:.2f} ms median ({min(t):.2f} min) over {a.reps}", flush=True)
        del model
        torch.cuda.empty_cache()
    print(f"\n{name}, transformers forward over the prompt (sdpa, bf16, random weights)\n")
    print("| preset | prompt tokens | ms (median) | ms (min) | prefill tokens/s |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['preset']} | {r['prompt']} | {r['ms_median']:.2f} | {r['ms_min']:.2f} | {r['prefill_tokens_per_s']:.0f} |")
    if a.out:
        d = pathlib.Path(a.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "ttft-baseline.json").write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
