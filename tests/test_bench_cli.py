"""The lab's command line, ``python -m bench layer|decoder`` (bench/cli.py), and the decoder bench's
CPU-side pieces."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

from bench.cli import main
from opcodes import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_layer_parses_here_and_runs_the_driver(monkeypatch):
    """bench.cli parses the layer bench's arguments and calls bench.driver.run with them and the views."""
    import bench.driver
    import megatape.views
    seen = []
    monkeypatch.setattr(bench.driver, "run", lambda a, views=None: seen.append((a, views)) or 7)
    assert main(["layer", "--preset", "tiny", "--baselines", ""]) == 7
    (a, views), = seen
    assert (a.preset, a.baselines, a.steps, a.policy, a.out) == ("tiny", "", 32, "cost", "bench/results/latest")
    assert views is megatape.views


def test_decoder_parses_here(monkeypatch):
    import bench.decoder_bench
    seen = []
    monkeypatch.setattr(bench.decoder_bench, "run", lambda a, views=None: seen.append(a) or 0)
    assert main(["decoder", "--steps", "4", "--out", "x"]) == 0
    assert (seen[0].preset, seen[0].steps, seen[0].out, seen[0].prefill) == ("llama3.2-1b", 4, "x", 1024)
    assert main(["decoder", "--pos", "128"]) == 0 and seen[1].prefill == 128


def test_rows_and_serve_parse_here_and_run_their_benches(monkeypatch):
    """``rows`` and ``serve`` check their arguments here and hand them to bench/rows_bench.py and
    bench/serve_bench.py as those modules' own command lines (which they parse back)."""
    import bench.rows_bench
    import bench.serve_bench
    seen = []
    monkeypatch.setattr(bench.rows_bench, "main", lambda argv: seen.append(("rows", argv)) or 0)
    monkeypatch.setattr(bench.serve_bench, "main", lambda argv: seen.append(("serve", argv)) or 3)
    assert main(["rows", "--preset", "llama3.1-8b", "--B", "16,32", "--chunks", "0,512", "--skip", "decode,ttft",
                 "--no-hf"]) == 0
    assert main(["serve", "--clients", "4", "--out", "x"]) == 3
    (k1, a1), (k2, a2) = seen
    assert k1 == "rows" and a1 == ["--preset", "llama3.1-8b", "--B", "16,32", "--pos", "1024", "--prompts",
                                   "128,1024,4096", "--chunks", "0,512", "--reps", "10", "--skip", "decode,ttft", "--out",
                                   "bench/results/latest", "--no-hf"]
    assert k2 == "serve" and a2 == ["--preset", "llama3.2-1b", "--clients", "4", "--prompt", "128", "--new", "64",
                                    "--requests-per-client", "2", "--out", "x"]


def test_bench_max_seq(monkeypatch, capsys):
    """Without --max-seq a bench sizes the cache for its positions (a long --pos works as given); a
    --max-seq too small for them, or a negative --pos, is one line naming the argument, before any GPU work."""
    import bench.decoder_bench
    import bench.driver
    seen = []
    monkeypatch.setattr(bench.decoder_bench, "run", lambda a, views=None: seen.append(a) or 0)
    monkeypatch.setattr(bench.driver, "run", lambda a, views=None: seen.append(a) or 0)
    assert main(["decoder"]) == 0 and seen[-1].max_seq == 1152              # the default cache
    assert main(["decoder", "--pos", "4096"]) == 0 and seen[-1].max_seq == 4224
    assert main(["decoder", "--pos", "4096", "--steps", "200"]) == 0 and seen[-1].max_seq == 4480
    assert main(["layer"]) == 0 and seen[-1].max_seq == 4224                # the layer bench's default cache
    assert main(["decoder", "--pos", "100", "--max-seq", "132"]) == 0 and seen[-1].max_seq == 132
    n = len(seen)
    for cmd, args, what in (("decoder", ["--pos", "4096"], "--max-seq 1152"),
                            ("decoder", ["--pos", "100"], "--max-seq 131"),
                            ("layer", ["--prefill", "4096"], "--max-seq 1152"),
                            ("decoder", ["--pos", "-1"], "--pos -1"),
                            ("layer", ["--prefill", "-3"], "--prefill -3")):
        extra = ["--max-seq", what.split()[1]] if what.startswith("--max-seq") else []
        rc, out, err = run_main(capsys, cmd, *args, *extra)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and what in err, err
        assert err.startswith(f"python -m bench {cmd}: error: "), err
    assert len(seen) == n


def test_decoder_tiling(monkeypatch, capsys):
    """--tiling reaches the bench as given; a bad one is one line naming --tiling, before any GPU work."""
    import bench.decoder_bench
    seen = []
    monkeypatch.setattr(bench.decoder_bench, "run", lambda a, views=None: seen.append(a) or 0)
    assert main(["decoder", "--tiling", "o_rows=32,stages=4"]) == 0 and seen[0].tiling == "o_rows=32,stages=4"
    # build options as --variants takes them, alone or with Tiling fields
    assert main(["decoder", "--tiling", "lm_rows=512"]) == 0 and seen[1].tiling == "lm_rows=512"
    assert main(["decoder", "--tiling", "lm_rows=128,stages=4,pool=0"]) == 0
    for bad, what in (("o_rowz=32", "o_rowz"), ("stages", "name=value"), ("qkv_rows=48", "qkv_rows"),
                      ("o_rows=3", "power of two"), ("lm_rows=3", "lm_rows"), ("lm_rows=x", "lm_rows")):
        rc, out, err = run_main(capsys, "decoder", "--tiling", bad)
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "--tiling" in err and what in err, err
        assert err.startswith("python -m bench decoder: error: "), err
    rc, out, err = run_main(capsys, "decoder", "--tp", "2", "--tiling", "stages=4")
    assert rc == 2 and "--tiling" in err
    assert len(seen) == 3


@pytest.mark.parametrize("argv,arg", [
    (["layer", "--policy", "fluid"], "--policy"),                 # fluid is a predictor only
    (["layer", "--prefetch"], "--prefetch"),                      # no such option
    (["layer", "--steps", "0"], "--steps"),
    (["decoder", "--preset", "tiny"], "--preset"),                # not a whole model
    (["decoder", "--tp", "3"], "--tp"),
    (["frobnicate"], "frobnicate"),
    (["rows", "--B", "0,16"], "--B"),                           # a batch of no rows
    (["rows", "--B", "2048"], "--B"),                           # past the largest bucket (1024)
    (["rows", "--skip", "speed"], "--skip"),
    (["rows", "--pos", "-1"], "--pos"),
    (["rows", "--prompts", "128,x"], "--prompts"),
    (["rows", "--preset", "tiny"], "--preset"),
    (["serve", "--clients", "0"], "--clients"),
    (["serve", "--new", "0"], "--new"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, arg):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and arg in lines[0] and "error" in lines[0], err
    assert lines[0].startswith("python -m bench"), err


def test_no_command_prints_help(capsys):
    rc, out, err = run_main(capsys)
    assert rc == 2 and "layer" in err and "decoder" in err


def test_help_as_a_module_from_a_clone():
    """``python -m bench --help`` and ``python -m bench decoder --help`` from the repository root;
    a bad argument through ``python -m bench``: exit status 2, one line, no traceback."""
    p = subprocess.run([sys.executable, "-m", "bench", "--help"], cwd=ROOT, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr
    assert "layer" in p.stdout and "decoder" in p.stdout
    p = subprocess.run([sys.executable, "-m", "bench", "decoder", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0 and "--tp" in p.stdout and "--pos" in p.stdout, p.stderr
    p = subprocess.run([sys.executable, "-m", "bench", "layer", "--preset", "llama-9000"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "--preset" in p.stderr and "Traceback" not in p.stderr


def test_bench_variant_policy_fluid_is_refused():
    from bench.driver import parse_variant
    with pytest.raises(ValueError, match="policy"):
        parse_variant(ModelConfig.from_name("tiny"), "policy=fluid")


# ---- the decoder bench's CPU-side pieces ---------------------------------------------------------
def test_bench_decoder_report_format(tmp_path):
    """decoder-<preset>-pos<P>.json: the latency issue's top-level keys and row objects."""
    import json
    from bench.decoder_bench import write_report
    rep = dict(card="H", date="2026-11-30", preset="llama3.2-1b", pos=128, bytes_per_step=10, copy_TBps=4.0,
               floor_us=500.0, accuracy={"logits_rel_err_max_vs_bf16_ref": 0.02, "greedy_same": 16, "greedy_n": 16})
    rows = [("floor", 500.0, None, None, None), ("megatape", 1000.0, 1020.0, 1, None)]
    path, txt = write_report(rep, rows, tmp_path)
    assert path.name == "decoder-llama3.2-1b-pos128.json" and (tmp_path / "decoder-llama3.2-1b-pos128.md").exists()
    got = json.loads(path.read_text())
    assert {"card", "date", "preset", "pos", "bytes_per_step", "copy_TBps", "floor_us", "accuracy", "rows"} <= set(got)
    mt = got["rows"][1]
    assert (mt["name"], mt["us_per_step"], mt["x_floor"], mt["fraction_of_bw"], mt["kernels_per_step"]) == \
        ("megatape", 1000.0, 2.0, 0.5, 1)
    assert "| megatape | 1000.0 | 1020.0 | 1000 | 2.000 | 50.0% | 1 |" in txt
    assert "(random weights, tied embeddings)" in txt
    _, txt = write_report(dict(rep, preset="llama3.1-8b", tied=False), rows, tmp_path)
    assert "(random weights, untied LM head)" in txt and "part" not in txt
    parted = dict(rep["accuracy"], greedy_same=6, greedy_first_diff=6, greedy_first_diff_margin=0.0042)
    _, txt = write_report(dict(rep, accuracy=parted), rows, tmp_path)
    assert "greedy 6/16 (the chains part at token 6: a 0.42% top-2 margin)" in txt


def test_bench_decoder_untied_presets():
    """The 8B and 70B checkpoints have an LM head of their own (the 1B ties it): the bench's random
    weights follow them, and an untied head is a tensor of its own."""
    import torch
    from bench.decoder_bench import UNTIED, make_decoder_weights
    assert {"llama3.1-8b", "llama3.1-70b"} == UNTIED and "llama3.2-1b" not in UNTIED
    assert all(ModelConfig.from_name(n).vocab for n in UNTIED)
    cfg = ModelConfig(layers=1, d=32, ffn=64, n_q=2, n_kv=1, hd=16, vocab=50)
    tied, untied = make_decoder_weights(cfg, 0, "cpu"), make_decoder_weights(cfg, 0, "cpu", tied=False)
    from bench.decoder_bench import top2_margin
    lg = torch.tensor([[0.0, 3.0, -1.0, 2.5, 1.0]])
    assert abs(top2_margin(lg) - 0.5 / float(lg.std())) < 1e-6
    assert tied["lm_head"] is tied["embed"]
    assert untied["lm_head"].shape == untied["embed"].shape and not torch.equal(untied["lm_head"], untied["embed"])


def test_bench_decoder_greedy_chain_on_cpu():
    """The bench's greedy check: the reference's chain (each token the argmax of the logits before it),
    the count of equal tokens, where two chains part, and the reference's margin there."""
    from bench.decoder_bench import greedy_compare, make_decoder_weights, reference_greedy, top2_margin
    from opcodes.decoder import decoder_ref, greedy_token
    from opcodes.reference import make_kv_cache
    cfg = ModelConfig(layers=2, d=32, ffn=64, n_q=2, n_kv=1, hd=16, vocab=40)
    w = make_decoder_weights(cfg, 0, "cpu", tied=False)
    toks, margins = reference_greedy(w, make_kv_cache(cfg, 32, 5, seed=1), cfg, [3, 7], 4, 5)
    kv = make_kv_cache(cfg, 32, 5, seed=1)
    decoder_ref(w, kv, cfg, 3, 5)
    lg = decoder_ref(w, kv, cfg, 7, 6)
    assert toks[0] == greedy_token(lg) and abs(margins[0] - top2_margin(lg)) < 1e-6
    lg = decoder_ref(w, kv, cfg, toks[0], 7)
    assert toks[1] == greedy_token(lg) and len(toks) == len(margins) == 4 and min(margins) >= 0
    assert greedy_compare(toks, toks, margins) == (4, None, None)
    other = toks[:2] + [(toks[2] + 1) % cfg.vocab] + toks[3:]
    assert greedy_compare(other, toks, margins) == (3, 2, margins[2])
