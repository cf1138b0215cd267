"""The ``megatape`` command line (megatape/cli.py)."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from collections import Counter

import pytest

from megatape import cli
from megatape.cli import main
from opcodes import REGISTRY, ModelConfig
from schedule import CostModel, Tape, compile_model, verify

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_main(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def tiny3():
    cfg = ModelConfig.from_name("tiny")
    return {p: compile_model(cfg, 3, policy=p) for p in ("cost", "round-robin")}


def test_compile_listing_and_lower_bound(capsys, tiny3):
    rc, out, err = run_main(capsys, "compile", "--preset", "tiny", "--sms", "3", "--listing")
    assert rc == 0, err
    cost, rr = tiny3["cost"], tiny3["round-robin"]
    # the listing of the cost-model tape, verbatim
    assert cost.tape.listing() in out
    assert f"# tape: {len(cost.tape)} instructions, 3 SMs, {cost.tape.n_counters} counters" in out
    # instructions per opcode
    counts = Counter(ins.NAME for ins in cost.prog.instrs)
    for name, cls in REGISTRY.items():       # a row per opcode of the program, the others named once
        row = re.search(rf"^\s+{name}\s+{cls.OPCODE}\s+{counts[name]}\s", out, re.M)
        assert bool(row) == bool(counts[name]), name
    other = re.search(r"^\s+\(not in this program: (.*)\)$", out, re.M)
    assert other and other.group(1).split(", ") == [n for n in REGISTRY if not counts[n]]
    assert re.search(rf"^\s+total\s+{len(cost.prog)}\s", out, re.M)
    # counters and the verifier
    assert f"counters used: {len(cost.prog.counters)} (" in out
    assert str(cost.report) in out and str(rr.report) in out          # both schedules verified
    # the cost tape ends in a pool (default: the plan's last 60 us), round-robin does not
    assert cost.tape.pool_len > 0 and rr.tape.pool_len == 0
    assert f"pool    cost: the plan's last 60us: {cost.tape.pool_len} instructions taken by atomic ticket" in out
    assert "pool    round-robin: none (static queues only)" in out
    # the makespan beside the lower bound, for both policies
    lb = CostModel().lower_bound(cost.prog)
    for pol, c in (("cost", cost), ("round-robin", rr)):
        m = re.search(rf"^\s+{pol}\s+makespan\s+([\d.]+) us\s+lower bound\s+([\d.]+) us\s+ratio\s+([\d.]+)", out, re.M)
        assert m, f"no makespan line for {pol}"
        assert float(m.group(1)) == pytest.approx(c.sched.makespan * 1e6, abs=0.051)
        assert float(m.group(2)) == pytest.approx(lb * 1e6, abs=0.051)
        assert float(m.group(3)) == pytest.approx(c.sched.makespan / lb, abs=5.1e-4)
    # per-SM busy time: min / median / max, not one line per SM
    busy = [b * 1e6 for b in cost.sched.busy(CostModel())]
    m = re.search(r"^\s+cost\s+busy\s+([\d.]+) /\s+([\d.]+) /\s+([\d.]+)", out, re.M)
    assert m and float(m.group(1)) == pytest.approx(min(busy), abs=0.051)
    assert float(m.group(3)) == pytest.approx(max(busy), abs=0.051)
    assert "time taken:" in out
    # progress lines go to stderr
    assert "cost:" in err and "round-robin:" in err


def test_compile_without_listing_is_short(capsys):
    rc, out, _ = run_main(capsys, "compile", "--preset", "small-gqa4", "--sms", "132")
    assert rc == 0
    assert "# tape:" not in out
    assert len(out.splitlines()) < 60          # a summary, not a line per SM


def test_compile_writes_tape(capsys, tmp_path, tiny3):
    path = tmp_path / "tape.json"
    rc, out, err = run_main(capsys, "compile", "--preset", "tiny", "--sms", "3", "-o", str(path))
    assert rc == 0, err
    loaded = Tape.load(path)
    want = tiny3["cost"].tape
    assert loaded.lay == want.lay and loaded.num_sms == 3
    assert loaded.words.equal(want.words) and loaded.offsets.equal(want.offsets)
    assert loaded.counters == want.counters and loaded.prog_index == want.prog_index
    verify(loaded, tiny3["cost"].prog)
    meta = loaded.meta
    assert meta["policy"] == "cost" and meta["preset"] == "tiny" and meta["num_sms"] == 3
    assert meta["predicted_makespan_us"] == pytest.approx(tiny3["cost"].sched.makespan * 1e6)
    assert meta["lower_bound_us"] == pytest.approx(CostModel().lower_bound(tiny3["cost"].prog) * 1e6)


def test_compile_round_robin_policy_writes_round_robin(capsys, tmp_path, tiny3):
    path = tmp_path / "rr.json"
    rc, _, _ = run_main(capsys, "compile", "--preset", "tiny", "--sms", "3", "--policy", "round-robin",
                        "-o", str(path))
    assert rc == 0
    loaded = Tape.load(path)
    assert loaded.meta["policy"] == "round-robin"
    assert loaded.words.equal(tiny3["round-robin"].tape.words)


def test_compile_layers_and_max_seq(capsys, tmp_path):
    path = tmp_path / "t.json"
    rc, out, _ = run_main(capsys, "compile", "--preset", "small-gqa4", "--sms", "4", "--layers", "3",
                          "--max-seq", "96", "-o", str(path))
    assert rc == 0
    t = Tape.load(path)
    assert t.lay.cfg.layers == 3 and t.lay.max_seq == 96 and t.num_sms == 4
    assert "max_seq 96" in out


def test_compile_a_rows_program(capsys, tmp_path):
    """``--rows R`` compiles the many-rows kernel's tape of an R-row step (the bucket that holds R) over ``--batch``
    cache slots: the rows opcodes, the bucket and slots in the layout line, a tape that loads back as such."""
    path = tmp_path / "rows.json"
    rc, out, err = run_main(capsys, "compile", "--preset", "llama3.2-1b", "--layers", "1", "--sms", "8", "--max-seq",
                            "256", "--rows", "20", "--batch", "4", "-o", str(path))
    assert rc == 0, err
    assert "rows 32 a step (a bucket), batch 4 slots" in out and "gate_up_r" in out and "lm_head_r" in out
    assert "a step of 20 row(s) in the 32-row bucket, 4 cache slot(s)" in err
    t = Tape.load(path)
    assert (t.lay.rows, t.lay.batch, t.lay.max_seq, t.num_sms) == (32, 4, 256, 8)


BAD_ARGS = [
    (["compile", "--preset", "nope", "--sms", "3"], "--preset"),
    (["compile", "--preset", "tiny", "--sms", "0"], "--sms"),
    (["compile", "--preset", "tiny", "--sms", "-4"], "--sms"),
    (["compile", "--preset", "tiny", "--sms", "many"], "--sms"),
    (["compile", "--preset", "tiny"], "--sms"),
    (["compile", "--sms", "3"], "--preset"),
    (["compile", "--preset", "tiny", "--sms", "3", "--layers", "0"], "--layers"),
    (["compile", "--preset", "tiny", "--sms", "3", "--max-seq", "0"], "--max-seq"),
    (["compile", "--preset", "tiny", "--sms", "3", "--policy", "fastest"], "--policy"),
    (["compile", "--preset", "tiny", "--sms", "3", "--tiling", "foo=1"], "--tiling"),
    (["compile", "--preset", "tiny", "--sms", "3", "--tiling", "gu_rows=x"], "--tiling"),
    (["compile", "--preset", "tiny", "--sms", "3", "--rows", "4"], "--rows"),             # no vocabulary
    (["compile", "--preset", "llama3.2-1b", "--sms", "3", "--rows", "0"], "--rows"),
    (["compile", "--preset", "llama3.2-1b", "--sms", "3", "--rows", "1025"], "--rows"),
    (["compile", "--preset", "tiny", "--sms", "3", "--batch", "2"], "--batch"),           # without --rows
    (["compile", "--preset", "llama3.2-1b", "--sms", "3", "--max-seq", "100", "--rows", "1024"], "--rows"),  # > slots x seq
    (["compile", "--preset", "tiny", "--sms", "3", "-o", "/nonexistent-dir/x/t.json"], "-o"),
    (["run", "--sms", "0"], "--sms"),
    (["frobnicate"], "frobnicate"),
    (["bench"], "bench"),                      # the benchmarks are the lab's: python -m bench layer
    (["bench-decoder"], "bench-decoder"),      # python -m bench decoder
]


@pytest.mark.parametrize("argv,arg", BAD_ARGS, ids=[" ".join(a) for a, _ in BAD_ARGS])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, arg):
    rc, out, err = run_main(capsys, *argv)
    assert rc == 2
    assert "Traceback" not in err and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert arg in lines[0] and "error" in lines[0]


def test_bad_arguments_through_the_console_entry_point():
    """As a process: exit status 2, one line on stderr, no traceback."""
    p = subprocess.run([sys.executable, "-m", "megatape.cli", "compile", "--preset", "llama-9000", "--sms", "3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and "--preset" in p.stderr and "Traceback" not in p.stderr


def test_no_command_prints_help(capsys):
    rc, out, err = run_main(capsys)
    assert rc == 2 and "compile" in err and "run" in err and "viz" in err and "generate" in err
    assert "bench" not in err


def test_help_exits_0(capsys):
    rc, out, _ = run_main(capsys, "compile", "--help")
    assert rc == 0 and "--preset" in out and "llama70b-layer" in out


# ---- forwarding and the main job ---------------------------------------------------------------
def test_viz_bad_arguments(capsys):
    rc, out, err = run_main(capsys, "viz", "--preset", "tiny", "--sms", "0", "--out", "x")
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "--sms" in err


def test_viz_calls_render(monkeypatch, tmp_path):
    import megatape.views.viz as viz
    seen = []
    monkeypatch.setattr(viz, "render", lambda cfg, sms, out, **kw: seen.append((cfg.name, sms, out, kw)))
    assert main(["viz", "--preset", "tiny", "--sms", "3", "--out", str(tmp_path), "--no-svg"]) == 0
    (name, sms, out, kw), = seen
    assert (name, sms, out, kw["svg"], kw["policy"]) == ("tiny", 3, str(tmp_path), False, "cost")


def test_viz_without_matplotlib_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.delitem(sys.modules, "megatape.views.viz", raising=False)
    monkeypatch.setitem(sys.modules, "matplotlib", None)        # import raises ModuleNotFoundError
    rc, out, err = run_main(capsys, "viz", "--preset", "tiny", "--sms", "3", "--out", str(tmp_path))
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "matplotlib" in err


def test_an_output_path_that_cannot_be_made_is_one_line(capsys, tmp_path):
    """viz's --out under a regular file (mkdir fails with an OSError): one error line naming the path,
    exit 1, no traceback."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = blocker / "pictures"
    rc, out, err = run_main(capsys, "viz", "--preset", "tiny", "--sms", "3", "--out", str(bad), "--no-svg")
    assert rc == 1 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("megatape viz: error: ") and str(bad) in err and "Traceback" not in err


def test_help_from_a_clone():
    """``python -m megatape.cli --help`` from the repository root, no install."""
    p = subprocess.run([sys.executable, "-m", "megatape.cli", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    for cmd in ("compile", "run", "viz", "generate"):
        assert cmd in p.stdout
    assert "bench" not in p.stdout


def test_run_on_cpu(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(cli, "_gpu_available", lambda: False)
    path = tmp_path / "main.json"
    rc, out, err = run_main(capsys, "run", "-o", str(path))
    assert rc == 0, err
    assert "model   llama70b-layer" in out and "132 SMs" in out
    assert re.search(r"^\s+cost\s+makespan .* ratio", out, re.M)
    m = re.search(r"tape VM check .* max rel err ([\d.e+-]+) .*: PASS", out)
    assert m and float(m.group(1)) <= 1.5e-2
    assert "GPU benchmark not run" in out
    assert Tape.load(path).num_sms == 132


def _measured(cfg, correct: bool) -> dict:
    return dict(device="GPU-X", preset=cfg.name, instructions=1234, num_sms=132, stream_copy_Bps=4.0e12,
                bytes_per_step=2_000_000_000, floor_us=500.0, correct=correct, rel_err_max=3e-3,
                kv_rows_rel_err=2e-3, kv_untouched_bitwise=correct, us_event=600.0, us_wall=620.0, x_floor=1.2)


@pytest.mark.parametrize("correct", [True, False])
def test_run_with_gpu_runs_the_benchmark(capsys, monkeypatch, correct):
    """On a GPU, after the CPU checks, ``megatape run`` checks and times the main layer with the
    product's own measuring code (megatape.measure; no bench), and fails if the check fails."""
    import megatape.measure
    seen = []
    monkeypatch.setattr(cli, "_gpu_available", lambda: True)
    monkeypatch.setattr(megatape.measure, "measure_layer",
                        lambda cfg, **kw: seen.append((cfg.name, kw)) or _measured(cfg, correct))
    rc, out, err = run_main(capsys, "run", "--sms", "16")
    assert rc == (0 if correct else 1), err
    assert seen == [("llama70b-layer", {"prefill": 4096, "steps": 32})]
    assert "16 SMs" in out
    assert "GPU-X: 1234 instructions on 132 SMs; stream copy 4.000 TB/s; 2,000,000,000 bytes/step; floor 500.0 us" in out
    assert f"other rows untouched: {correct}: {'PASS' if correct else 'FAIL'}" in out
    assert "600.0 us/step (median of CUDA events), 620.0 us with a host sync; 1667 tokens/s; x floor 1.200" in out


def test_pyproject_console_script_points_at_main():
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["scripts"]["megatape"] == "megatape.cli:main"
    assert meta["project"]["name"] == "megatape"
    assert set(meta["tool"]["setuptools"]["packages"]) == {"megatape", "megatape.views", "megatape.serve", "interp",
                                                           "schedule", "opcodes"}         # not bench: the lab
    for pkg in meta["tool"]["setuptools"]["packages"]:
        assert (ROOT / pkg.replace(".", "/") / "__init__.py").is_file(), pkg


def test_conftest_sets_triton_interpret_before_triton_is_imported():
    code = ("import os, sys; os.environ.pop('TRITON_INTERPRET', None); import conftest; "
            "print('triton' in sys.modules, conftest.HAS_CUDA, os.environ.get('TRITON_INTERPRET'))")
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    imported, has_cuda, value = p.stdout.split()
    assert imported == "False"
    assert value == ("None" if has_cuda == "True" else "1")


# ---- the README stays true ---------------------------------------------------------------------
README = (ROOT / "README.md").read_text()


def test_readme_opens_with_the_two_commands():
    head = README.splitlines()[:12]
    a = head[head.index("# (a) set up and run the main job") + 1]
    b = head[head.index("# (b) set up and run the tests") + 1]
    install = "python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 triton==3.6.0 'numpy<2.4' -e '.[test,serve]'"
    assert a == f"{install} && .venv/bin/megatape run"
    assert b == f"{install} && .venv/bin/python -m pytest -q"
    ci = (ROOT / ".ci" / "run").read_text()
    assert "# (b) set up and run the tests" in ci and os.access(ROOT / ".ci" / "run", os.X_OK)


def test_readme_opcode_table_matches_the_registry():
    rows = re.findall(r"^\| (\d+) \| `([a-z_]+)` \| `([a-z0-9_, ]+)` \| .+ \|$", README, re.M)
    assert [(int(n), name) for n, name, _ in rows] == [(cls.OPCODE, name) for name, cls in REGISTRY.items()]
    for _, name, ops in rows:
        assert tuple(o.strip() for o in ops.split(",")) == REGISTRY[name].operand_names(), name


def test_readme_tape_format_matches_the_word_layout():
    from opcodes import HEADER, MAX_OPERANDS, WORDS
    assert f"[opcode, wait_a, target_a, wait_b, target_b, signal, operand0 .. operand{MAX_OPERANDS - 1}]" in README
    assert HEADER == 6 and f"{WORDS} int32 words" in README


def test_readme_python_examples_run():
    """The quick start's Python blocks, run as written (the Triton interpreter on the CPU)."""
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert len(blocks) == 2
    code = "\n".join(blocks)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    err = float(re.search(r"rel err vs reference: ([\d.e+-]+)", p.stdout).group(1))
    assert err <= 1.5e-2


# ---- compile_model picks the decoder lowering (no copy of that choice in the CLI or the views) --
def test_compile_model_picks_the_decoder_lowering():
    from schedule.decoder_program import decoder_lowering
    cfg = ModelConfig(layers=1, d=64, ffn=160, n_q=4, n_kv=2, hd=16, vocab=256, name="v")
    names = lambda c: {ins.NAME for ins in c.prog.instrs}          # noqa: E731
    whole = compile_model(cfg, 3, max_seq=64)                       # decoder=None: vocab > 0 -> whole model
    assert {"embed", "lm_head", "argmax"} <= names(whole)
    assert not {"embed", "lm_head", "argmax"} & names(compile_model(cfg, 3, max_seq=64, decoder=False))
    assert not {"embed"} & names(compile_model(ModelConfig.from_name("tiny"), 3, max_seq=64))
    explicit = compile_model(cfg, 3, max_seq=64, lowering=decoder_lowering(lm_rows=16, emb_cols=32), decoder=False)
    assert explicit.tape.lay.lm_rows == 16                          # an explicit lowering wins
    import inspect
    src = inspect.getsource(cli) + inspect.getsource(__import__("megatape.views.viz", fromlist=["x"]))
    assert "decoder_lowering" not in src


def test_compile_tiling_option(tmp_path, capsys):
    """--tiling overrides the preset's Tiling: the written tape carries it (and unfolding the residual,
    folded by default at this size, puts layer 0's RESIDUAL back); a malformed or unknown field is one error line naming it, exit 2."""
    out = tmp_path / "t.json"
    assert main(["compile", "--preset", "small-2layer", "--sms", "4", "--tiling", "res_fold=0, gu_rows=16",
                 "-o", str(out)]) == 0
    tape = Tape.load(out)
    assert (tape.lay.tiling.res_fold, tape.lay.tiling.gu_rows) == (0, 16)
    from schedule.tape import decode
    assert [d.ins.NAME for d in decode(tape)].count("residual") == 2      # one per layer
    capsys.readouterr()
    for spec, word in (("gu_rows=x", "gu_rows"), ("bogus=3", "bogus"), ("res_fold=2", "res_fold")):
        assert main(["compile", "--preset", "tiny", "--sms", "2", "--tiling", spec]) == 2
        err = capsys.readouterr().err
        assert word in err and "Traceback" not in err, err
