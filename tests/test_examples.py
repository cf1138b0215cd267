"""The numbered tutorials in examples/ run as written (CPU presets) and print what they promise."""
from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _run(script: str, *args: str, timeout: int = 300) -> str:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, str(ROOT / "examples" / script), *args], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]
    return p.stdout


def _errs(out: str, what: str) -> list[float]:
    return [float(v) for v in re.findall(rf"{what}: rel err vs reference ([\d.e+-]+)", out)]


def test_01_compile_a_layer(tmp_path):
    out = _run("01_compile_a_layer.py", "--preset", "tiny", "--sms", "3", "--out", str(tmp_path))
    assert re.search(r"^== 1\. compiled tiny .* for 3 SMs", out, re.M)
    assert re.search(r"^verified: \d+ instructions on 3 SMs", out, re.M)
    assert "sm 0:" in out and "sm 1:" in out and "pool:" in out and "wait " in out and "signal " in out
    assert re.search(r"waits for counter \S+ to reach \d+ per call; \d+ instructions signal it", out)
    assert re.search(r"the broken tape: rejected: instruction \d+ \(\w+, (sm \d+|pool)\)", out)
    assert "loaded back identical: True" in out and (tmp_path / "tiny-3sms.json").is_file()
    errs = [float(v) for v in re.findall(r"interleaving seed \d: rel err vs reference ([\d.e+-]+)", out)]
    assert len(errs) == 3 and max(errs) <= 1.5e-2


def test_02_schedule_graph(tmp_path):
    pytest.importorskip("matplotlib")
    out = _run("02_schedule_graph.py", "--preset", "small-2layer", "--sms", "8", "--out", str(tmp_path))
    for tag in ("1. compiled", "2. aggregated DAG", "3. zoom stage-gate_up", "3. zoom sm-0", "4. full DAG", "5. plan"):
        assert f"== {tag}" in out, tag
    assert "critical path" in out
    for name in ("dag.png", "dag_zoom_stage-gate_up.png", "dag_zoom_sm-0.png", "dag.graphml", "plan_gantt.png",
                 "plan_trace.json"):
        assert (tmp_path / name).stat().st_size > 0, name
        assert f"wrote {tmp_path / name}" in out


def test_03_models():
    pytest.importorskip("transformers")
    pytest.importorskip("safetensors")
    out = _run("03_models.py", "--preset", "small-2layer", "--steps", "1", "--new-tokens", "4", timeout=600)
    assert "== 1. build_model: small-2layer, 2 layers in one tape" in out
    errs = _errs(out, r"model_step pos \d+")
    assert len(errs) == 1 and errs[0] <= 1.5e-2
    assert "'vocab': 256" in out
    m = re.search(r"greedy tokens equal: (\d+)/4", out)
    assert m and m.group(1) == "4", out[-1000:]


def test_04_text_generation(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    pytest.importorskip("safetensors")
    out = _run("04_text_generation.py", "--out", str(tmp_path), "--new-tokens", "2")
    for f in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja"):
        assert (tmp_path / f).is_file(), f
    assert out.count("(exit status 0)") == 2
    seeds = re.findall(r"^seed (\d): (.*); stopped by (\w+) after (\d) tokens$", out, re.M)
    assert [s[0] for s in seeds] == ["1", "1", "2"] and seeds[0][1] == seeds[1][1]       # the same seed, the same text


def test_05_many_rows():
    out = _run("05_many_rows.py")
    assert "== 1. tiny: 2 layers" in out
    assert re.findall(r"^prefill slot (\d): (\d+) tokens in (\d) launch(?:es)?;", out, re.M) == [("0", "13", "2"), ("2", "6", "1")]
    rows = re.findall(r"^step \d slot \d pos \d+: err ([\d.e+-]+) vs the bf16 reference's ([\d.e+-]+): (\w+)", out, re.M)
    assert len(rows) == 4 and all(float(e) <= 1.1 * float(r) and v == "meets" for e, r, v in rows), out
    assert "slot 0 alone and beside slot 2: bitwise equal True" in out
    assert "refused: pos[1]: expected a position in [0, max_seq_len=48)" in out
    assert "cache untouched: True" in out
