"""Does ``megatape generate`` decode as fast as the decoder it runs? (issue 15, item 5)

    python3 -m bench.generate_bench [--ckpt DIR] [--out DIR] [--pos 128] [--new-tokens 64]     # on the GPU
    python3 -m bench.generate_bench --preset tiny --pos 12 --new-tokens 6 --out /tmp/gb        # a CPU trial

(``python3 bench/generate_bench.py ...`` works too.) What it does:

1. A random Hugging Face checkpoint directory of the preset's shape (default ``llama3.2-1b``: 16
   layers, hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64, vocab 128256, tied
   embeddings, rope_theta 500000 with Llama 3.2's llama3 RoPE scaling) in ``--ckpt`` (default
   ``$TMPDIR/megatape-genbench-<preset>``), reused when a previous run completed it (the marker
   file ``genbench.json`` is written last and must name the same shape and seed). The weights are
   ``transformers.LlamaForCausalLM(...)`` built on the GPU when there is one (bf16 default dtype),
   every matrix then drawn N(0, 0.02^2) on that device and every norm weight set to 1, saved with
   ``save_pretrained(DIR, safe_serialization=True)``. The tokenizer is the one of
   ``tests/test_generate.py``: a byte-level BPE trained with ``tokenizers`` on a small corpus,
   wrapped as ``PreTrainedTokenizerFast`` and saved in the same directory. Its vocabulary (a few
   hundred tokens) is much smaller than the model's: the random model mostly emits ids the
   tokenizer does not know, which decode to nothing (the text printed is short; the tokens are
   all made and counted).
   A preset without a vocabulary (``tiny``, ``small-2layer``...: the CPU trial) gets ``--vocab``.

   EOS: ``megatape generate`` has no option to ignore EOS; it stops at any id in
   generation_config.json's or config.json's ``eos_token_id`` or the tokenizer's EOS token, and
   with random weights any id can come out. So this checkpoint has no EOS at all: config.json says
   ``"eos_token_id": null`` (so generation_config.json has none) and the tokenizer has a BOS but no
   EOS token. (An id outside the model's vocabulary would do too, as ARGMAX and SAMPLE only make
   ids in [0, vocab), but transformers warns about such a config.) The CLI takes the same path
   either way (``generate_stream`` with an empty EOS set). Every run therefore makes exactly
   ``--new-tokens`` tokens; the script checks that the CLI says "stopped by --max-new-tokens".

2. ``python -m megatape.cli generate --model DIR --prompt TEXT --max-new-tokens N`` as a
   subprocess, greedy (``--temperature 0``) and sampled (``--temperature 0.8 --top-k 50
   --top-p 0.95 --seed 1``). TEXT is cut to about ``--pos`` tokens (P, the count is printed), so
   the prompt fills positions 0..P-1, the first new token comes from the step at P-1 and the
   decode rate the CLI reports ((N - 1) tokens over the time from the first new token to the last)
   covers the steps at positions P..P+N-2. Its stderr summary is parsed: prompt tokens, new tokens,
   why it stopped, time to first token, decode tokens/s, x floor (GPU only).

3. In this process, the same checkpoint through the same path the CLI takes
   (``interp.textgen.Checkpoint``: ``load_hf_llama`` weights, ``Checkpoint.build`` with the CLI's
   ``max_seq`` and ``sampling``), the prompt run with ``generate(h, ids, 0, ...)`` (which also
   writes the sampling parameters), then ``decode_step`` at positions P..P+N-2 timed as ``python -m bench
   decoder`` does (``bench.driver._events_median``: 3 warm-up calls, the median of CUDA-event
   times; on a CPU the wall clock).

Prints a Markdown table (setting, CLI decode tokens/s, bench-decoder tokens/s at those positions,
their ratio, the ratio expected, and the CLI's time to first token and x floor) and writes it to
``<out>/generate_bench.md`` with ``<out>/generate_bench.json`` beside it (default
``bench/results/latest``). Exit status 1 if a ratio is off the expected one by more than
``--tolerance`` (5%), 2 if a CLI run failed or did not make N tokens.

The expected ratio is 1 on a GPU: ``generate_stream`` launches step j + 1 before the host waits
for token j, so the CLI's interval from the first token to the last holds the N - 1 steps at
P..P+N-2. On a CPU (Triton interpreter, tiny presets only; the numbers only show that the script
runs) a launch runs to completion before it returns, so when the first token is handed out the
step at P has already run: the interval holds N - 2 steps for N - 1 tokens and the expected ratio
is (N - 1) / (N - 2).
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:                   # run as a file: python3 bench/generate_bench.py
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (torch does not import triton)

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")   # as megatape generate does: before opcodes imports triton

from interp.hf import hf_config_kwargs, random_llama_on  # noqa: E402
from opcodes import PRESETS, ModelConfig, next_pow2  # noqa: E402

DEFAULT_OUT = "bench/results/latest"
MARKER = "genbench.json"          # written last: the checkpoint directory is complete
SETTINGS = (("greedy", dict(temperature=0.0)),
            ("sampled (T 0.8, top-k 50, top-p 0.95, seed 1)", dict(temperature=0.8, top_k=50, top_p=0.95, seed=1)))
CORPUS = ["The café serves crème brûlée and café au lait.", "漢字 and かな are written in Japan; 漢字 came from China.",
          "Once upon a time there was a small model that wrote text.", "Déjà vu: the naïve coöperation of the élite.",
          "Tokens, bytes and characters: é is two bytes, 漢 is three."]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- 1. the checkpoint -----------------------------------------------------------------------------
def make_tokenizer():
    """tests/test_generate.py's tokenizer (byte-level BPE on CORPUS), with a BOS but no EOS token."""
    import tokenizers
    import transformers
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=384, special_tokens=["<s>"], show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>")


def make_checkpoint(path: pathlib.Path, cfg: ModelConfig, seed: int, device: torch.device) -> bool:
    """Write the checkpoint into ``path`` unless a complete one of the same shape and seed is there.
    Returns True if it was (re)written."""
    kw = hf_config_kwargs(cfg)
    spec = {"hf_config": kw, "seed": seed, "init": "matrices N(0, 0.02^2), norms 1"}
    marker = path / MARKER
    if marker.is_file():
        try:
            if json.loads(marker.read_text()) == spec:
                return False
        except ValueError:
            pass
    if path.exists():
        if not path.is_dir():
            raise SystemExit(f"--ckpt {path}: not a directory")
        if any(path.iterdir()) and not marker.is_file():
            raise SystemExit(f"--ckpt {path}: a non-empty directory that this script did not write (no {MARKER})")
        shutil.rmtree(path)
    path.mkdir(parents=True)
    t0 = time.perf_counter()
    make_tokenizer().save_pretrained(str(path))
    model = random_llama_on(kw, device, seed)
    try:
        model.save_pretrained(str(path), safe_serialization=True)
    except TypeError:            # a transformers without the argument: safetensors is its only format
        model.save_pretrained(str(path))
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    marker.write_text(json.dumps(spec, indent=1))
    log(f"wrote {path} in {time.perf_counter() - t0:.1f} s")
    return True


def prompt_text(ck, n: int) -> tuple[str, list[int]]:
    """The longest run of CORPUS words (repeated) that encodes to at most ``n`` tokens, and its ids."""
    words = " ".join(CORPUS).split()
    text, ids = "", []
    i = 0
    while True:
        w = words[i % len(words)]
        cand = f"{text} {w}" if text else w
        cids = ck.encode(cand)
        if len(cids) > n:
            return text, ids
        text, ids = cand, cids
        i += 1


# ---- 2. megatape generate --------------------------------------------------------------------------
SUMMARY = {
    "prompt_tokens": (r"prompt tokens (\d+)", int),
    "new_tokens": (r"new tokens (\d+)", int),
    "stopped_by": (r"\(stopped by ([^)]*)\)", str),
    "built_s": (r"built in ([\d.]+) s", float),
    "instructions": (r"(\d+) instructions on", int),
    "sms": (r"instructions on (\d+) SM", int),
    "first_token_s": (r"time to first token ([\d.]+) s", float),
    "decode_tokens_per_s": (r"decode ([\d.]+|nan) tokens/s", float),
    "x_floor": (r"x floor ([\d.]+)", float),
}


def parse_summary(err: str) -> dict:
    """The numbers of ``megatape generate``'s stderr summary (None where a line is absent, e.g. x floor on a CPU)."""
    out = {}
    for key, (pat, typ) in SUMMARY.items():
        m = re.search(pat, err)
        out[key] = typ(m.group(1)) if m else None
    return out


def run_cli(ckpt: pathlib.Path, prompt: str, n_new: int, kw: dict) -> dict:
    argv = [sys.executable, "-m", "megatape.cli", "generate", "--model", str(ckpt), "--prompt", prompt,
            "--max-new-tokens", str(n_new), "--temperature", str(kw["temperature"])]
    for k in ("top_k", "top_p", "seed"):
        if k in kw:
            argv += [f"--{k.replace('_', '-')}", str(kw[k])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=str(ROOT), env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    shown = " ".join(a if a != prompt else "<prompt>" for a in argv[1:])
    if p.returncode != 0:
        raise RuntimeError(f"{shown}: exit status {p.returncode}:\n{p.stderr}")
    res = parse_summary(p.stderr)
    res.update(argv=shown, wall_s=wall, stderr=p.stderr, stdout_chars=len(p.stdout))
    return res


# ---- 3. decode_step timed as bench decoder times it- --------------------------------------------
def cli_max_seq(ck, n_prompt: int, n_new: int) -> int:
    """The KV cache length ``megatape generate`` builds (cmd_generate, no --max-seq)."""
    ctx = ck.context or n_prompt + n_new
    n_new = min(n_new, ctx - n_prompt + 1)
    return min(ctx, next_pow2(max(n_prompt + n_new, 16)))


def time_decoder(ck, ids: list[int], n_new: int, kw: dict, seed: int) -> dict:
    """Median time of ``decode_step`` at positions P..P+n_new-2 on the decoder the CLI builds."""
    from interp.decoder import decode_step, generate, teardown_decoder
    from bench.driver import _events_median
    P = len(ids)
    max_seq = cli_max_seq(ck, P, n_new)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    h = ck.build(max_seq, sampling=kw["temperature"] > 0, device=device)
    try:
        generate(h, ids, 0, **kw)                 # the prompt into the KV cache; SAMPLE's parameters
        g = torch.Generator().manual_seed(seed + 3)
        toks = torch.randint(0, ck.cfg["vocab"], (n_new - 1,), generator=g)
        args = [(h, toks[i:i + 1].to(torch.int32).to(device), P + i) for i in range(n_new - 1)]
        ev, wall, allev = _events_median(decode_step, args)
        h.layer.check()
        return {"max_seq": max_seq, "positions": [P, P + n_new - 2], "us_event": ev, "us_wall": wall,
                "all_event_us": allev, "tokens_per_s": 1e6 / ev, "instructions": len(h.layer.tape),
                "sms": h.layer.num_sms}
    finally:
        teardown_decoder(h)


# ---- main --------------------------------------------------------------------------------------------
def _fmt(v, spec: str, none: str = "n/a") -> str:
    return none if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def expected_ratio(cuda: bool, n_new: int) -> float:
    """CLI tokens/s over decode_step tokens/s when the CLI adds no time of its own (module docstring)."""
    return 1.0 if cuda else (n_new - 1) / (n_new - 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m bench.generate_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama3.2-1b", choices=list(PRESETS), metavar="NAME",
                    help=f"model shape, one of {', '.join(PRESETS)} (default llama3.2-1b)")
    ap.add_argument("--vocab", type=int, default=512, help="vocabulary of a preset without one (default 512)")
    ap.add_argument("--ckpt", default=None, metavar="DIR",
                    help="checkpoint directory, made if absent (default $TMPDIR/megatape-genbench-<preset>)")
    ap.add_argument("--pos", type=int, default=128, help="prompt tokens, about: decoding starts there (default 128)")
    ap.add_argument("--new-tokens", type=int, default=64, help="--max-new-tokens of the CLI (default 64)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    ap.add_argument("--tolerance", type=float, default=0.05, help="largest |ratio / expected - 1| that passes (default 0.05)")
    ap.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help=f"results directory (default {DEFAULT_OUT})")
    a = ap.parse_args(argv)
    cuda = torch.cuda.is_available()
    if a.new_tokens < (2 if cuda else 3) or a.pos < 1:
        ap.error("--new-tokens must be >= 2 (>= 3 on a CPU) and --pos >= 1")
    if not cuda and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        raise SystemExit("no CUDA device and TRITON_INTERPRET is not set: the kernel cannot run here")
    missing = [m for m in ("transformers", "tokenizers", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"needs {', '.join(missing)}: pip install transformers (it brings the other two)")
    from interp.textgen import Checkpoint

    cfg = PRESETS[a.preset]
    if not cfg.vocab:
        cfg = ModelConfig.from_dict({**cfg.to_dict(), "vocab": a.vocab}, name=f"{cfg.name}-v{a.vocab}")
    ckpt = pathlib.Path(a.ckpt or pathlib.Path(tempfile.gettempdir()) / f"megatape-genbench-{cfg.name}")
    device = torch.device("cuda" if cuda else "cpu")
    card = torch.cuda.get_device_name() if cuda else "CPU (Triton interpreter)"
    made = make_checkpoint(ckpt, cfg, a.seed, device)
    log(f"{card}; {cfg.name}; checkpoint {ckpt} ({'written' if made else 'reused'})")
    ck = Checkpoint.open(ckpt)
    prompt, ids = prompt_text(ck, a.pos)
    P, N = len(ids), a.new_tokens
    if ck.eos_token_ids:
        raise SystemExit(f"{ckpt}: EOS ids {ck.eos_token_ids}: generation could stop early (delete the directory)")
    log(f"prompt: {P} tokens; {N} new tokens each; decode steps at positions {P}..{P + N - 2}")

    expect = expected_ratio(cuda, N)
    rows, failed = [], []
    for name, kw in SETTINGS:                      # the CLI first: this process holds no decoder meanwhile
        log(f"megatape generate, {name} ...")
        try:
            c = run_cli(ckpt, prompt, N, kw)
        except RuntimeError as e:
            log(str(e))
            failed.append(name)
            c = None
        if c is not None:
            bad = [f"{k} {c[k]!r}, expected {v!r}" for k, v in (("prompt_tokens", P), ("new_tokens", N),
                                                                  ("stopped_by", "--max-new-tokens")) if c[k] != v]
            if bad:
                log(f"megatape generate, {name}: " + "; ".join(bad) + f"\n{c['stderr']}")
                failed.append(name)
            log(f"  {_fmt(c['decode_tokens_per_s'], '.2f')} tokens/s, first token {_fmt(c['first_token_s'], '.3f')} s, "
                f"x floor {_fmt(c['x_floor'], '.3f')} ({c['wall_s']:.1f} s in all)")
        rows.append({"setting": name, "sampling": kw, "cli": c})
    ck.load_weights(device.type)
    for r in rows:
        log(f"decode_step timed, {r['setting']} ...")
        b = time_decoder(ck, ids, N, r["sampling"], a.seed)
        r["bench"] = b
        cli_tps = r["cli"]["decode_tokens_per_s"] if r["cli"] else None
        r["ratio"] = cli_tps / b["tokens_per_s"] if cli_tps else None
        r["expected_ratio"] = expect
        r["ok"] = r["setting"] not in failed and r["ratio"] is not None and abs(r["ratio"] / expect - 1) <= a.tolerance
        log(f"  {b['us_event']:.1f} us/step, {b['tokens_per_s']:.2f} tokens/s; ratio {_fmt(r['ratio'], '.3f')} "
            f"(expected {expect:.3f})")

    md = [f"{card}, {datetime.date.today().isoformat()}, {cfg.name} (random weights, tied embeddings), "
          f"checkpoint {ckpt}: prompt {P} tokens, {N} new tokens; the CLI's decode rate covers the steps at "
          f"positions {P}..{P + N - 2}, decode_step is timed at the same positions (max_seq "
          f"{rows[0]['bench']['max_seq']}, median of {N - 1} steps, "
          f"{'CUDA events' if cuda else 'wall clock'}); ratio = CLI / decode_step, pass within "
          f"{a.tolerance:.0%} of the expected ratio" + ("" if cuda else f" ((N - 1) / (N - 2) = {expect:.3f} on a CPU: "
                                                       "the interpreter's launches are synchronous)"), "",
          f"| setting | CLI decode tokens/s | bench-decoder tokens/s at pos {P}..{P + N - 2} | ratio | "
          "expected | CLI time to first token (s) | CLI x floor |",
          "|---|---|---|---|---|---|---|"]
    for r in rows:
        c = r["cli"] or {}
        md.append(f"| {r['setting']} | {_fmt(c.get('decode_tokens_per_s'), '.2f', 'failed')} | "
                  f"{r['bench']['tokens_per_s']:.2f} | {_fmt(r['ratio'], '.3f')}{'' if r['ok'] else ' (FAIL)'} | "
                  f"{expect:.3f} | {_fmt(c.get('first_token_s'), '.3f')} | {_fmt(c.get('x_floor'), '.3f')} |")
    ok = all(r["ok"] for r in rows)
    md += ["", "PASS: every ratio within tolerance" if ok else "FAIL: a ratio is outside tolerance"
           + (f" (CLI runs failed: {', '.join(failed)})" if failed else "")]
    txt = "\n".join(md) + "\n"
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rep = {"card": card, "date": datetime.date.today().isoformat(), "preset": cfg.name, "cfg": ck.cfg,
           "checkpoint": str(ckpt), "prompt": prompt, "prompt_tokens": P, "new_tokens": N,
           "tolerance": a.tolerance, "pass": ok, "rows": rows}
    (out / "generate_bench.json").write_text(json.dumps(rep, indent=1, default=str))
    (out / "generate_bench.md").write_text(txt)
    print(txt)
    if failed:
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
