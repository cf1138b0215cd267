"""bench/probes/chain_probe.py under the Triton interpreter: its plans and its four kernels compute the
sums they are timed for (one SM, two layers of three small stages, two calls), so the GPU numbers in
bench/NOTES.md (runs 91-93) rest on kernels that do the stated work."""
import pytest
import torch

from conftest import require_interpreter

from bench.probes import chain_probe as cp

require_interpreter()

SHAPES = ((1, 32, 2048), (1, 16, 2048), (1, 64, 2048))


def _i64(v):
    return torch.tensor(v, dtype=torch.int64)


def _reference(planner, tab, w, x, nout):
    """Every output row group's sum from the table alone (torch, fp32)."""
    if planner is cp.plan:
        ref, acc = torch.zeros(nout * cp.ROWS_), torch.zeros(cp.ROWS_)
        for r in tab:
            blk = w[r[0]:r[0] + cp.ROWS_ * cp.COLS_].float().view(cp.ROWS_, cp.COLS_)
            acc += blk @ x[r[1]:r[1] + cp.COLS_]
            if r[4] >= 0:
                ref[r[4] * cp.ROWS_:(r[4] + 1) * cp.ROWS_] = acc
                acc = torch.zeros(cp.ROWS_)
        return ref
    ref = torch.zeros(nout * cp.RR_)
    for r in tab:
        blk = w[r[0]:r[0] + cp.RR_ * 2048].float().view(cp.RR_, 2048)
        ref[r[4] * cp.RR_:(r[4] + 1) * cp.RR_] = blk @ x[:2048]
    return ref


@pytest.mark.parametrize("name", list(cp.VARIANTS))
def test_chain_probe_kernels(name):
    _, planner, orows, _ = cp.VARIANTS[name]
    tab, start, tiles, tstart, nw, nout, ncnt = planner(2, 1, SHAPES)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    tables = (_i64(tab).reshape(-1), _i64(start), _i64(tiles), _i64(tstart))
    cnt = torch.zeros(ncnt, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(nout * orows)
    for epoch in (1, 2):
        cp.launch(name, tables, x, w, out, cnt, err, epoch, 1, 3)
    assert int(err) == 0
    assert cnt.tolist() == [2] * ncnt                 # every tile signalled once per call
    torch.testing.assert_close(out, _reference(planner, tab, w, x, nout), rtol=1e-5, atol=1e-5)


def test_chain_probe_plan_is_one_wave_per_stage():
    with pytest.raises(ValueError, match="one wave"):
        cp.plan(1, 1, ((2, 16, 1024),))
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan(1, 2, ((2, 32, 2048), (1, 16, 2048)))
    assert ncnt == 2 and start[-1] == len(tab) and tiles[-1] == len(tab)
    # the second stage's tile waits for both tiles of the first; every tile's last block signals
    assert [r[2:4] for r in tab if r[2] >= 0] == [[0, 2]]
    assert sorted(r[5] for r in tab if r[5] >= 0) == [0, 0, 1]
