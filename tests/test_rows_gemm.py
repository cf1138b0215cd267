"""``opcodes.common_rows.rows_stream`` (issue 50's R-row GEMM tile) under the Triton interpreter, through the
GPU probe's own launcher (bench/probes/rows_gemm.py ``launch``), against torch in fp32; and the probe's kernel
compiled for sm_90 (no GPU) at a decode and a prefill tile."""
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from conftest import H200_SMEM_PER_BLOCK, require_interpreter

from bench.probes import rows_gemm as rg

require_interpreter()

K = 256
#: the interpreter's fp32 dot of bf16-rounded operands vs torch's fp32 matmul of the same: summation order only
RTOL = 1e-5


def _case(rows, n, xs, seed, xdtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(rows, K, generator=g) * 0.1).to(torch.bfloat16)
    xt = torch.zeros(K, xs, dtype=xdtype)
    xt[:, :n] = torch.randn(K, n, generator=g).to(xdtype)
    return w, xt


def _check(yt, w, xt, n):
    ref = rg.reference(w, xt, n)
    err = (yt[:, :n] - ref).abs().max() / ref.abs().max()
    assert err <= RTOL, float(err)


# (rows, n, xs, m, n_tile, bk, grid): N not a multiple of 16, a ragged last column tile, ragged weight rows,
# K in several blocks, more tiles than programs
CASES = [
    (32, 1, 1, 32, 16, 64, 1),        # N 1, padded to a 16-column tile (masked)
    (32, 5, 5, 16, 16, 128, 3),       # N 5: two weight blocks, three programs (one idle)
    (32, 16, 16, 16, 16, 64, 2),      # N 16: no masks (EVEN)
    (32, 40, 40, 32, 16, 64, 2),      # N 40: three column tiles, the last 8 wide
    (48, 40, 48, 32, 32, 256, 3),     # 48 rows in 32-row blocks (ragged), xs > n, one K block
]


@pytest.mark.parametrize("rows,n,xs,m,n_tile,bk,grid", CASES)
def test_rows_stream_matches_torch(rows, n, xs, m, n_tile, bk, grid):
    w, xt = _case(rows, n, xs, seed=rows + n)
    yt = torch.full((rows, xs), float("nan"))
    even = rg.launch(w, xt, yt, n, m=m, n_tile=n_tile, bk=bk, stages=2, warps=4, grid=grid)
    assert even == (rows % m == 0 and n % n_tile == 0)
    _check(yt, w, xt, n)
    # columns past n are never written (the masks hold), so NaN stays there
    assert torch.isnan(yt[:, n:]).all()


def test_rows_stream_padded_columns_as_the_decode_buckets_hold_them():
    # the design's layout: X^T [K, N_TILE] zero past the R real rows, every column computed (EVEN), bf16 in and out
    n, npad = 5, 16
    w, xt = _case(64, n, npad, seed=7, xdtype=torch.bfloat16)
    yt = torch.zeros(64, npad, dtype=torch.bfloat16)
    assert rg.launch(w, xt, yt, npad, m=32, n_tile=16, bk=64, stages=3, warps=4, grid=2)
    ref = rg.reference(w, xt, n)
    assert float((yt[:, :n].float() - ref).abs().max() / ref.abs().max()) <= 2 ** -8
    assert (yt[:, n:] == 0).all()                     # zero columns stay zero (finite, unmixed)


def test_rows_stream_two_pairs_rows_r_and_r_plus_half():
    # TWO (QKV's RoPE halves, gate/up): one tile streams rows r and r + rows/2; 24 rows a half in 16-row blocks
    n = 7
    w, xt = _case(48, n, n, seed=11)
    yt = torch.full((48, n), float("nan"))
    assert not rg.launch(w, xt, yt, n, m=16, n_tile=16, bk=64, stages=2, warps=4, grid=2, two=True)
    _check(yt, w, xt, n)


def test_rows_stream_columns_are_independent():
    # a column's result does not depend on the other columns (the batch invariance of rows-design sec. 5)
    w, xt = _case(32, 16, 16, seed=3)
    y_all = torch.zeros(32, 16)
    rg.launch(w, xt, y_all, 16, m=32, n_tile=16, bk=64, stages=2, warps=4, grid=1)
    alone = torch.zeros_like(xt)
    alone[:, 4] = xt[:, 4]
    y_one = torch.zeros(32, 16)
    rg.launch(w, alone, y_one, 16, m=32, n_tile=16, bk=64, stages=2, warps=4, grid=1)
    assert torch.equal(y_one[:, 4], y_all[:, 4])
    assert (y_one[:, :4] == 0).all() and (y_one[:, 5:] == 0).all()


def test_launch_names_the_bad_argument():
    w, xt = _case(32, 5, 5, seed=1)
    yt = torch.zeros(32, 5)
    kw = dict(m=32, n_tile=16, bk=64, stages=2, warps=4, grid=1)
    with pytest.raises(ValueError, match="n_tile must be a power of two >= 16"):
        rg.launch(w, xt, yt, 5, **dict(kw, n_tile=8))
    with pytest.raises(ValueError, match="bk must be"):
        rg.launch(w, xt, yt, 5, **dict(kw, bk=96))
    with pytest.raises(ValueError, match=r"n must be an int in \[1, min\(xs, ys\) = 5\]"):
        rg.launch(w, xt, yt, 6, **kw)
    with pytest.raises(ValueError, match="xt must be"):
        rg.launch(w, xt[:128].contiguous(), yt, 5, **kw)
    with pytest.raises(ValueError, match="w must be"):
        rg.launch(w.float(), xt, yt, 5, **kw)


def test_tile_config_follows_the_design():
    from opcodes import PRESETS
    b8, b1 = PRESETS["llama3.1-8b"], PRESETS["llama3.2-1b"]
    # decode: M 32, N_TILE the next power of two >= 16, the preset's BK and warps, the STAGES - 1 buffered
    # stages within 200 KB
    assert rg.tile_config(b8, 4096, 16) == dict(m=32, n_tile=16, bk=512, warps=8, stages=5)     # 4 x 48 KB
    assert rg.tile_config(b8, 4096, 32) == dict(m=32, n_tile=32, bk=512, warps=8, stages=4)     # 3 x 64 KB
    assert rg.tile_config(b1, 2048, 1) == dict(m=32, n_tile=16, bk=256, warps=4, stages=5)
    # prefill: the 128x128x64 tile, 8 warps, 4 stages; options win
    assert rg.tile_config(b1, 2048, 2048) == dict(m=128, n_tile=128, bk=64, warps=8, stages=4)
    assert rg.tile_config(b8, 4096, 16, m=64, stages=2)["m"] == 64
    assert [s[0] for s in rg.gemm_shapes(b8)] == ["qkv", "o", "gate_up", "down"]
    assert rg.gemm_shapes(b8)[0][1:] == (4096 + 2 * 1024, 4096) and rg.gemm_shapes(b8)[3][1:] == (4096, 14336)


def test_rows_gemm_compiles_for_sm90(tmp_path):
    """The probe's kernel for sm_90 (no GPU): the decode tile (N_TILE 16) on mma.sync, the prefill tile (N_TILE 128)
    on wgmma, both pipelined with async copies, within an H200's shared memory, no spills at the defaults."""
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, "-m", "bench.probes.rows_gemm", "--compile"], capture_output=True, text=True,
                       env=env, cwd=root, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    print(json.dumps(got, indent=1))
    for name, v in got.items():
        assert 0 < v["shared"] <= H200_SMEM_PER_BLOCK, (name, v)
        assert v["cp.async"] > 0 and v["registers"] is not None, (name, v)
    assert got["decode16"]["mma_sync"] > 0 and got["decode16"]["wgmma"] == 0
    assert got["prefill128"]["wgmma"] > 0 and got["prefill128"]["mma_sync"] == 0
    for name in ("decode16", "decode32", "prefill128"):
        assert got[name]["spill_stores"] == 0, (name, got[name])


def test_cli_names_bad_arguments_and_table_has_a_cell_per_column(capsys):
    for argv, what in ((["--shapes", "2b"], "--shapes"), (["--n", "0,16"], "--n"), (["--reps", "5"], "--reps")):
        with pytest.raises(SystemExit):
            rg.main(argv)
        assert what in capsys.readouterr().err
    r = dict(preset="8b", gemm="o", rows=4096, K=4096, N=16, m=32, n_tile=16, bk=512, stages=5, warps=8, us=12.0,
             cublas_us=13.0, gemv_us=11.5, tbps=2.8, tflops=44.7, x_cublas=1.08, copy_frac=0.9, vs_gemv=0.96,
             vs_n1=1.01, err=1e-3)
    lines = rg.table([r, dict(r, N=1, vs_n1=None)]).splitlines()
    assert len(lines) == 4 and len({ln.count("|") for ln in lines}) == 1
    assert "| 0.96 (11.5) |" in lines[2] and lines[3].endswith("|  |")
