"""bench/probes/chain_probe.py under the Triton interpreter: its plans and its four kernels compute the
sums they are timed for (one SM, two layers of three small stages, two calls), so the GPU numbers in
bench/NOTES.md (runs 91-93) rest on kernels that do the stated work."""
import pytest
import torch

from conftest import H200_SMEM_PER_BLOCK, StepClock, require_interpreter

from bench.probes import chain_probe as cp

require_interpreter()

SHAPES = ((1, 32, 2048), (1, 16, 2048), (1, 64, 2048))


def _i64(v):
    return torch.tensor(v, dtype=torch.int64)


def _reference(planner, tab, w, x, nout):
    """Every output row group's sum from the table alone (torch, fp32)."""
    if planner in (cp.plan, cp.plan_decoder):
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


def test_chain_probe_gap_spins_after_its_counter_and_changes_no_output(monkeypatch):
    # the gap after each layer's first stage (chain_probe.gaps; --gap-us of the Gluon probe): per_tile and
    # flat compute the same sums with it, and each call spins at least its gaps on the clock it reads (the
    # interpreter's host clock; a stand-in here that advances 1 ms a read)
    import interp.sync
    clock = StepClock(1_000_000, start=10**12)
    monkeypatch.setattr(interp.sync, "_host_clock_ns", clock)
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan(2, 1, SHAPES)
    assert cp.gaps(ncnt, len(SHAPES), 7) == [7, 0, 0, 7, 0, 0]       # counters 0 and 3: the two layers' first stage
    g = torch.Generator().manual_seed(4)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    tables = (_i64(tab).reshape(-1), _i64(start), _i64(tiles), _i64(tstart))
    ns = 40_000_000                                                   # 40 ms, far above the interpreter's noise
    gap = _i64(cp.gaps(ncnt, len(SHAPES), ns))
    ref = _reference(cp.plan, tab, w, x, nout)
    for name in cp.GAPPED:
        for epoch in (1, 2):
            cnt, err, out = torch.zeros(ncnt, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(nout * cp.ROWS_)
            for e in range(1, epoch + 1):
                t0 = clock.now
                cp.launch(name, tables, x, w, out, cnt, err, e, 1, 3, gap=gap)
                assert clock.now - t0 >= 2 * ns, name    # two O-stage tiles waited, each spun ns of its clock
            assert int(err) == 0 and cnt.tolist() == [epoch] * ncnt
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="takes no gap"):
        cp.launch("rows_flat", tables, x, w, torch.zeros(1), torch.zeros(ncnt, dtype=torch.int32),
                  torch.zeros(1, dtype=torch.int32), 1, 1, 3, gap=gap)


def test_chain_probe_plan_is_one_wave_per_stage():
    with pytest.raises(ValueError, match="one wave"):
        cp.plan(1, 1, ((2, 16, 1024),))
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan(1, 2, ((2, 32, 2048), (1, 16, 2048)))
    assert ncnt == 2 and start[-1] == len(tab) and tiles[-1] == len(tab)
    # the second stage's tile waits for both tiles of the first; every tile's last block signals
    assert [r[2:4] for r in tab if r[2] >= 0] == [[0, 2]]
    assert sorted(r[5] for r in tab if r[5] >= 0) == [0, 0, 1]


def test_chain_probe_decoder_plan_splits_each_stage_evenly():
    # --plan decoder (issue 53's fair ring probe): a stage's 16-row groups over its tiles as evenly as they go
    # (5 groups on 2 tiles: 2 + 3; 4 on 3: 1 + 1 + 2), tile t on SM t, in the table format every kernel reads
    shapes = ((2, 80, 2048), (3, 48, 1024), (3, 64, 4096))
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_decoder(2, 3, shapes)
    sizes = [tiles[i + 1] - tiles[i] for i in range(len(tiles) - 1)]
    # per SM and layer: stage 0's 2 / 3 groups of 2 blocks, stage 1's one block, stage 2's 1 / 1 / 2 groups of 4
    assert sizes == [4, 1, 4] * 2 + [6, 1, 4] * 2 + [1, 8] * 2
    assert nout == 2 * (5 + 3 + 4) and nw == len(tab) * cp.ROWS_ * cp.COLS_ and ncnt == 6
    assert [r[2:4] for r in tab if r[2] >= 0][:3] == [[0, 2], [1, 3], [2, 3]]     # SM 0: each stage waits the one before


@pytest.mark.parametrize("name", ["per_tile", "flat"])
def test_chain_probe_decoder_plan_kernels(name):
    # the decoder plan's tiles of several row groups and K 4096 through the interpreter's kernels (one SM: the
    # interpreter runs programs one after another, so a plan over several SMs would wait on SMs not yet run)
    shapes = ((1, 80, 2048), (1, 48, 1024), (1, 32, 4096))
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_decoder(2, 1, shapes)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    tables = (_i64(tab).reshape(-1), _i64(start), _i64(tiles), _i64(tstart))
    cnt, err, out = torch.zeros(ncnt, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(nout * cp.ROWS_)
    for epoch in (1, 2):
        cp.launch(name, tables, x, w, out, cnt, err, epoch, 1, 3)
    assert int(err) == 0 and cnt.tolist() == [2] * ncnt
    torch.testing.assert_close(out, _reference(cp.plan_decoder, tab, w, x, nout), rtol=1e-5, atol=1e-5)


def test_chain_probe_decoder_plan_cuts_the_1b_as_the_decoder():
    # DECODER_STAGES: the chain's bytes in the decoder's tiles (opcodes.tiling's 1B defaults), gate/up on all 132
    # SMs in 7 or 8 groups of 16 rows, each stage waiting for every tile of the one before
    from opcodes.config import PRESETS
    from opcodes.tiling import Tiling
    c, t = PRESETS["llama3.2-1b"], Tiling.for_config(PRESETS["llama3.2-1b"], max_seq=256)
    assert cp.DECODER_STAGES == (((c.q_dim + 2 * c.kv_dim) // t.qkv_rows, c.q_dim + 2 * c.kv_dim, c.d),
                                 (c.d // t.o_rows, c.d, c.q_dim), (t.gu_tiles, 2 * c.ffn, c.d),
                                 (c.d // t.down_rows, c.d, t.down_k))
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_decoder(1, 132)
    assert nw == cp.plan(1, 132)[4] and ncnt == 4
    groups = {}
    for r in tab:
        if r[5] >= 0:
            groups.setdefault(r[5], 0)
            groups[r[5]] += 1                     # tiles a stage (one signal each)
    assert groups == {0: 96, 1: 128, 2: 132, 3: 128}
    waits = [r[2:4] for r in tab if r[2] >= 0]
    assert sorted(set(map(tuple, waits))) == [(0, 96), (1, 128), (2, 132)]
    gu = [tiles[i + 1] - tiles[i] for i in range(len(tiles) - 1) if tab[tiles[i + 1] - 1][5] == 2]
    assert len(gu) == 132 and set(gu) == {14, 16} and sum(gu) == 2 * c.ffn * 2 // cp.ROWS_
    with pytest.raises(ValueError, match="whole 16-row groups"):
        cp.plan_decoder(1, 4, ((4, 48, 1024),))


# ---- bench/probes/gluon_chain_probe.py: the chain streamed by a warp-specialized TMA loader (Gluon) ----------
# Gluon kernels do not run under the interpreter: on this CPU host the kernel is compiled for sm_90 (in a
# process without TRITON_INTERPRET) and its TTGIR / PTX checked for the structure the probe claims; the
# fp32 reference the GPU run checks its outputs against is checked here against the loop reference above.


def test_gluon_chain_reference_matches_the_loop_reference():
    from bench.probes import gluon_chain_probe as gcp
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan(2, 2, SHAPES)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    got = gcp.reference(tab, w, x, nout, chunk=5)          # several chunks
    torch.testing.assert_close(got, _reference(cp.plan, tab, w, x, nout), rtol=1e-5, atol=1e-5)
    bad = [list(r) for r in tab]
    bad[1][0] += 1                                          # not packed in table order: the TMA rows would be wrong
    with pytest.raises(ValueError, match="table order"):
        gcp.reference(bad, w, x, nout)


def test_gluon_chain_check_accepts_the_chain_and_rejects_errors():
    # the GPU run's check of every variant (counters, error word, outputs), here on chain_probe's flat kernel
    from bench.probes import gluon_chain_probe as gcp
    assert gcp.signals_per_call(cp.plan(1, 2, ((2, 32, 2048), (1, 16, 2048)))[0], 2).tolist() == [2, 1]
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan(2, 1, SHAPES)
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    cnt, err = torch.zeros(ncnt, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(nout * cp.ROWS_)
    tables = (_i64(tab).reshape(-1), _i64(start), _i64(tiles), _i64(tstart))
    for epoch in (1, 2):
        cp.launch("flat", tables, x, w, out, cnt, err, epoch, 1, 3)
    ref, per_call = gcp.reference(tab, w, x, nout), gcp.signals_per_call(tab, ncnt)
    assert gcp.check("flat", out, cnt, err, 2, ref, per_call) < 1e-5
    with pytest.raises(RuntimeError, match="counters"):
        gcp.check("flat", out, cnt, err, 3, ref, per_call)
    with pytest.raises(RuntimeError, match="gave up"):
        gcp.check("flat", out, cnt, torch.ones(1, dtype=torch.int32), 2, ref, per_call)
    bad = out.clone()
    bad[-1] += 1e-2
    with pytest.raises(RuntimeError, match="reference"):
        gcp.check("flat", bad, cnt, err, 2, ref, per_call)


def test_gluon_chain_descriptor_is_the_compiled_signature():
    from triton.runtime.jit import mangle_type
    from bench.probes import gluon_chain_probe as gcp
    w = torch.zeros(6 * gcp.ROWS_ * gcp.COLS_, dtype=torch.bfloat16)
    d = gcp.make_desc(w)
    assert list(d.shape) == [6 * gcp.ROWS_, gcp.COLS_] and list(d.strides) == [gcp.COLS_, 1]
    assert list(d.block_shape) == [gcp.ROWS_, gcp.BOX_] and max(d.block_shape) <= 256      # TMA's box limit
    assert gcp.ROWS_ * gcp.BOX_ * 2 * gcp.NSUB_ == gcp.BLOCK_BYTES_ == 32768
    assert mangle_type(d).startswith("tensordesc<bf16[16, 256],NVMMASharedLayout(swizzle_byte_width=0,")
    with pytest.raises(ValueError, match="ring"):
        gcp.launch_ws((None, None), None, d, None, None, None, 1, 1, gcp.MAX_RING + 1)


def _without_interpreter(tmp_path, *argv):
    """``python ARGV`` from the repository root in a process without TRITON_INTERPRET (Gluon kernels are
    compiled, never interpreted), its own Triton cache under ``tmp_path``; asserts it succeeded."""
    import os
    import pathlib
    import subprocess
    import sys
    root = pathlib.Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(root), TRITON_CACHE_DIR=str(tmp_path / "cache"))
    r = subprocess.run([sys.executable, *map(str, argv)], capture_output=True, text=True, env=env, cwd=root,
                       timeout=300)
    assert r.returncode == 0, f"{argv[:3]} failed (do the kernels compile for sm_90?):\n{r.stderr[-3000:]}"
    return r


def _compile_probe(tmp_path, module, *args):
    """``python -m bench.probes.<module> --compile ARGS`` (:func:`_without_interpreter`): the JSON of its
    last line."""
    import json
    r = _without_interpreter(tmp_path, "-m", f"bench.probes.{module}", "--compile", *args)
    return json.loads(r.stdout.strip().splitlines()[-1])


def _partitions(ttgir: str) -> tuple[str, str]:
    """A warp-specialized kernel's TTGIR: (its default partition, its one worker partition)."""
    default = ttgir.split("ttg.warp_specialize(", 1)[1].split("partition0(", 1)[0]
    worker = ttgir.split("partition0(", 1)[1].split("ttg.warp_return", 1)[0]
    return default, worker


def _ws_compile(tmp_path, ring, gap_us=0):
    got = _compile_probe(tmp_path, "gluon_chain_probe", ring, tmp_path, *(["--gap-us", gap_us] if gap_us else []))
    return got, (tmp_path / "chain_ws.ptx").read_text(), (tmp_path / "chain_ws.ttgir").read_text()


# the gapped variant: slow (3 s; the suite's 300 s, s41): the default run compiles the ungapped one
@pytest.mark.parametrize("gap_us", [0, pytest.param(6, marks=pytest.mark.slow)], ids=["no-gap", "gap"])
def test_gluon_chain_ws_compiles_for_sm90(tmp_path, gap_us):
    import re
    ring = 5
    got, ptx, ttgir = _ws_compile(tmp_path, ring, gap_us)
    # the gap (--gap-us): the consumer spins on the globaltimer after an O tile's wait; none without it
    assert got["gap"] == int(gap_us > 0)
    assert ("%globaltimer" in ptx) == (gap_us > 0)
    # shared memory: the ring (5 slots of 4 [16, 256] bf16 boxes), the vector (16 KB) and the barriers
    assert ring * 32768 + 16384 <= got["shared"] <= H200_SMEM_PER_BLOCK, got["shared"]
    assert got["tensordesc_meta"][0]["block_size"] == [16, 256] and got["tensordesc_meta"][0]["swizzle"] == 0
    # the partitions (TTGIR): a default region of 4 warps and one 1-warp worker at 24 registers
    assert '"ttg.num-warps" = 4 : i32' in ttgir
    assert "ttg.warp_specialize(" in ttgir and "requestedRegisters = array<i32: 24>" in ttgir
    default, worker = _partitions(ttgir)
    assert worker.split("{", 1)[0].rstrip().endswith("num_warps(1)")
    # the loader: slot waits, the expected bytes, the block's 4 TMA boxes; never a counter, never a global load
    assert worker.count("ttng.async_tma_copy_global_to_local") == 4
    assert "ttng.wait_barrier" in worker and "ttng.barrier_expect" in worker and ", 32768," in worker
    assert "tt.atomic_rmw" not in worker and "tt.load" not in worker
    # the consumer: the acquire poll, the ready wait, the slot release, the release signal; no TMA
    assert "tt.atomic_rmw add, acquire, gpu" in default and "tt.atomic_rmw add, release, gpu" in default
    assert "ttng.wait_barrier" in default and "ttng.arrive_barrier" in default and "ttng.fence_async_shared" in default
    assert "async_tma_copy" not in default
    # the vector: staged in shared memory once a tile (a local store), read back a slice a block
    assert "ttg.local_store" in default and "ttg.local_load" in default
    # PTX: TMA loads, mbarriers, the warp groups' register hand-over, 8 warps launched for num_warps=4 + 1
    tma_load = r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global\.mbarrier::complete_tx::bytes"
    assert len(re.findall(tma_load, ptx)) == 4
    assert "mbarrier.arrive.expect_tx.shared.b64" in ptx and "mbarrier.arrive.shared::cta.b64" in ptx
    assert ptx.count("mbarrier.try_wait.parity") >= 2 and ptx.count("mbarrier.init.shared") == 2 * ring
    assert re.search(r"setmaxnreg\.dec\.sync\.aligned\.u32\s+24;", ptx) and re.search(r"setmaxnreg\.inc\.sync", ptx)
    assert ".reqntid 256" in ptx and got["num_warps"] == 8
    assert re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx) and "atom.global.gpu.release.add" in ptx
    assert "fence.proxy.async.shared::cta" in ptx
    # ptxas (bundled, sm_90a): no spills
    m = re.fullmatch(r"(\d+) registers, (\d+) / (\d+) bytes spill stores / loads", got["resources"])
    assert m, got["resources"]
    print(f"gluon chain_ws ring {ring} gap {gap_us}: {got['shared']} bytes shared, {got['resources']}")
    assert int(m.group(2)) == 0 and int(m.group(3)) == 0, got["resources"]


@pytest.mark.slow     # 6 s: the halves of the probe above (the suite's 300 s, s41)
@pytest.mark.parametrize("mode", ["NO_TMA", "NO_MATH", "LOADER"])
def test_gluon_chain_ws_halves_compile_for_sm90(tmp_path, mode):
    """--halves: NO_TMA's loader copies nothing and arrives on the slot's ready barrier itself; NO_MATH's
    consumer never reads the ring (its only shared-memory reads are gone, the vector's store stays);
    LOADER's consumer neither reads the ring nor polls nor stages the vector (no acquire, no local store)."""
    code = ("import sys; from bench.probes import gluon_chain_probe as g; "
            "sys.stdout.write(g.compile_sm90(5, 0, getattr(g, sys.argv[1] + '_')).asm['ttgir'])")
    ttgir = _without_interpreter(tmp_path, "-c", code, mode).stdout
    default, worker = _partitions(ttgir)
    if mode == "NO_TMA":
        assert "async_tma_copy" not in ttgir and "ttng.barrier_expect" not in worker
        assert "ttng.arrive_barrier" in worker and "ttg.local_load" in default
    else:
        assert worker.count("ttng.async_tma_copy_global_to_local") == 4
        assert "ttg.local_load" not in default
        assert ("ttg.local_store" in default) == (mode == "NO_MATH")
        assert ("acquire" in default) == (mode == "NO_MATH")
        assert "ttng.wait_barrier" in default and "ttng.arrive_barrier" in default


def test_gluon_chain_probe_arguments(capsys, monkeypatch):
    """--help prints the usage and exits 0; a depth that is not an integer >= 1, or a bad --gap-us, is one
    line and exit 2, before any GPU work."""
    from bench.probes import gluon_chain_probe as gcp
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(gcp, "run", lambda **kw: pytest.fail(f"ran {kw}"))
    assert gcp.main(["--help"]) == 0 and "--gap-us G" in capsys.readouterr().out
    for bad, what in ((["x"], "'x'"), (["0"], "'0'"), (["6", "--gap-us", "-1"], "--gap-us"), (["--gap-us"], "--gap-us"),
                      (["--halves", "y"], "'y'"), (["--plan", "70b"], "--plan"), (["--plan"], "--plan")):
        assert gcp.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and what in err, err


# ---- bench/probes/steal_probe.py: a stage's row blocks taken by ticket inside the pipelined loop -------------
STEAL_SHAPES = ((1, 32, 2048), (1, 16, 2048), (1, 64, 2048))


@pytest.mark.parametrize("hold,slack", [(0, 4), (2, 4), (3, 0), (5, 1)])
def test_steal_probe_does_every_block_once_whatever_the_slack(hold, slack):
    # one SM under the interpreter: its own blocks, then the pool by ticket (the pipelined loop's SLACK
    # iterations, then the plain loop over what remains); every block's sums, every counter once a call
    from bench.probes import steal_probe as sp
    tab, nblocks, nst = sp.plan(2, 1, hold, STEAL_SHAPES, slack=slack)
    assert [r[0] for r in tab] == [4, 2, 8] * 2 and [r[1] for r in tab] == [0, 4, 6, 14, 18, 20]
    assert all(r[2] == max(1, r[0] - hold) and r[3] == r[2] + slack for r in tab)
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(nblocks * cp.RR_ * 2048, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    stab = torch.tensor(tab, dtype=torch.int32).reshape(-1)
    tk = torch.zeros(nst, dtype=torch.int32)
    cnt, err = torch.zeros(nst, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    out = torch.full((nblocks * cp.RR_,), float("nan"))
    for epoch in (1, 2):
        sp.launch(stab, tk, x, w, out, cnt, err, epoch, 1, nst, 3)
        assert int(err) == 0 and cnt.tolist() == [epoch] * nst
        # the pool's tickets: the pipelined loop's takes, plus one past the pool for the plain loop's exit
        for r, t in zip(tab, tk.tolist()):
            pool, takes = r[0] - r[2], r[3] - r[2] + 1
            assert t == (takes if takes > pool else pool + 1), (r, t)
    torch.testing.assert_close(out, sp.reference(w, x, nblocks), rtol=1e-5, atol=1e-5)


def test_steal_probe_plan_rejects_what_it_cannot_schedule():
    from bench.probes import steal_probe as sp
    with pytest.raises(ValueError, match="block of its own"):
        sp.plan(1, 8, 0, ((1, 32, 2048),))
    with pytest.raises(ValueError, match="blocks are 8 x 2048"):
        sp.plan(1, 1, 0, ((1, 32, 1024),))


def test_steal_probe_static_shares_do_every_block_once():
    # rows_static: SM p's contiguous share [p * nb // P, (p + 1) * nb // P) of each stage (one SM: all of it)
    from bench.probes import steal_probe as sp
    tab, nblocks, nst = sp.plan(2, 1, 0, STEAL_SHAPES)
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(nblocks * cp.RR_ * 2048, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    cnt, err = torch.zeros(nst, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    out = torch.full((nblocks * cp.RR_,), float("nan"))
    for epoch in (1, 2):
        sp.rows_static[(1,)](torch.tensor(tab, dtype=torch.int32).reshape(-1), x, w, out, cnt, err, epoch, nst,
                             STAGES=3, num_warps=8)
        assert int(err) == 0 and cnt.tolist() == [epoch] * nst
    torch.testing.assert_close(out, sp.reference(w, x, nblocks), rtol=1e-5, atol=1e-5)


def test_steal_probe_arguments(capsys, monkeypatch):
    """--help prints the usage and exits 0; a depth that is not an integer >= 1 is one line and exit 2, before
    any GPU work."""
    from bench.probes import steal_probe as sp
    monkeypatch.setattr(sp, "run", lambda **kw: pytest.fail(f"ran {kw}"))
    assert sp.main(["--help"]) == 0 and "steal_probe [DEPTH...]" in capsys.readouterr().out
    for bad in (["x"], ["0"], ["5", "-1"]):
        assert sp.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and repr(bad[-1]) in err, err


# ---- bench/probes/tma_wait_probe.py: the row chain with its wait after a cp.async or TMA prologue ---------
@pytest.mark.parametrize("name", ["rows_per_tile", "rows_in_cp", "rows_tma", "rows_in_tma"])
def test_tma_wait_probe_kernels(name):
    """Each of the probe's four loops (one SM, two layers of three stages, two calls) computes the row
    chain's sums and signals every tile once a call, whether it waits before its loop or inside it."""
    from bench.probes import tma_wait_probe as tw
    tab, start, tiles, tstart, nw, nout, ncnt = cp.plan_rows(2, 1, SHAPES)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    tables = (_i64(tab).reshape(-1), _i64(start), _i64(tiles), _i64(tstart))
    desc = tw.TensorDescriptor.from_tensor(w.view(-1, tw.BOX_C), [tw.BOX_R, tw.BOX_C])
    cnt = torch.zeros(ncnt, dtype=torch.int32)
    err = torch.zeros(1, dtype=torch.int32)
    out = torch.zeros(nout * cp.RR_)
    for epoch in (1, 2):
        tw.launch(name, tables, x, w, desc, out, cnt, err, epoch, 1, 3)
    assert int(err) == 0
    assert cnt.tolist() == [2] * ncnt
    torch.testing.assert_close(out, _reference(cp.plan_rows, tab, w, x, nout), rtol=1e-5, atol=1e-5)


def test_probe_arguments_are_checked_before_any_gpu_work(capsys, monkeypatch):
    from bench.probes import poll_probe as pp
    from bench.probes import tma_wait_probe as tw
    monkeypatch.setattr(pp, "run", lambda *a, **kw: pytest.fail("poll_probe ran"))
    monkeypatch.setattr(tw, "run", lambda *a, **kw: pytest.fail("tma_wait_probe ran"))
    for main, bad, named in ((pp.main, ["0"], "'0'"), (pp.main, ["x"], "'x'"), (tw.main, ["1"], "'1'"),
                             (tw.main, ["a"], "'a'"), (pp.main, ["--polls", "relaxed,nope"], "'relaxed,nope'"),
                             (pp.main, ["--polls"], "--polls ''")):
        assert main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and named in err, err


@pytest.mark.slow     # 4 s: a concluded probe's sm_90 compile (the suite's 300 s, s41)
def test_poll_probe_compiles_for_sm90(tmp_path):
    """The poll probe's kernels (sm_90, no GPU): the TMA one issues its 4 blocks as 4 bulk tensor
    copies, the cp.async one as 64 16-byte copies a thread, the plain one neither; 128 KB of blocks
    within an H200 block's shared memory."""
    got = _compile_probe(tmp_path, "poll_probe")
    assert (got["none"]["tma"], got["none"]["cp.async"]) == (0, 0)
    assert (got["tma"]["tma"], got["tma"]["cp.async"]) == (4, 0)
    assert (got["cpasync"]["tma"], got["cpasync"]["cp.async"]) == (0, 64)
    # the warp-specialized one: the loader's copies in a loop (4 sites, one a block), 4 + 1 warps (8 launched)
    assert (got["cpasync_ws"]["tma"], got["cpasync_ws"]["cp.async"], got["cpasync_ws"]["num_warps"]) == (0, 4, 8)
    for mode in got.values():
        assert 4 * 32768 <= mode["shared"] <= H200_SMEM_PER_BLOCK, mode
    # --polls: the cp.async prologue with each other poll instruction, and only that one
    assert got["cpasync"]["poll"] == ["ld.global.gpu.acquire"]
    assert got["cpasync/relaxed"]["poll"] == ["ld.relaxed.gpu.global.b32"]
    assert got["cpasync/volatile"]["poll"] == ["ld.volatile.global.b32"]
    assert got["cpasync/atom_or"]["poll"] == ["atom.relaxed.gpu.global.or.b32"]
    assert got["cpasync/relaxed_fence"]["poll"] == ["fence.acq_rel.gpu", "ld.relaxed.gpu.global.b32"]
    for q in ("relaxed", "volatile", "atom_or", "relaxed_fence"):
        assert got[f"cpasync/{q}"]["cp.async"] == 64


# ---- bench/probes/inloop_probe.py: the row chain, each stage's wait before or inside its loop -------------
@pytest.mark.parametrize("mask", [0, 2, 7])
def test_inloop_probe_kernel_computes_the_chain(mask):
    """One kernel, every mask (one SM, two layers of three stages, two calls): each block's sum, every
    tile signalled once a call, whichever stages wait inside their loop."""
    from bench.probes import inloop_probe as ip
    tab, tiles, tstart, nw, nout, ncnt = ip.plan(2, 1, mask, SHAPES)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(nw, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4096, generator=g)
    tables = (_i64(tab).reshape(-1), _i64(tiles), _i64(tstart))
    cnt, err, out = torch.zeros(ncnt, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), torch.zeros(nout * cp.RR_)
    for epoch in (1, 2):
        ip.launch(tables, x, w, out, cnt, err, epoch, 1, 3)
    assert int(err) == 0 and cnt.tolist() == [2] * ncnt
    torch.testing.assert_close(out, _reference(cp.plan_rows, tab, w, x, nout), rtol=1e-5, atol=1e-5)


def test_inloop_probe_plan_marks_the_masked_stages():
    from bench.probes import inloop_probe as ip
    shapes = ((3, 16, 2048), (4, 8, 2048), (2, 24, 2048))
    base = cp.plan_rows(2, 4, shapes)[0]
    for mask in (0, 5, 7):
        tab, tiles, *_ = ip.plan(2, 4, mask, shapes)
        modes = [tab[tiles[t]][1] for t in range(len(tiles) - 1)]
        stages = [tab[tiles[t + 1] - 1][5] % 3 for t in range(len(tiles) - 1)]
        assert modes == [ip.INSIDE if mask >> s & 1 else ip.BEFORE for s in stages]
        # nothing else of chain_probe's plan changes
        assert [r[:1] + r[2:] for r in tab] == [r[:1] + r[2:] for r in base]
    for bad in (-1, 8, True, "1"):
        with pytest.raises(ValueError, match="mask"):
            ip.plan(1, 4, bad, shapes)


def test_inloop_probe_arguments(capsys, monkeypatch):
    from bench.probes import inloop_probe as ip
    monkeypatch.setattr(ip, "run", lambda *a, **kw: pytest.fail("inloop_probe ran"))
    for bad in (["16"], ["x"], ["3", "-1"]):
        assert ip.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "mask" in err, err


def test_gu_probe_layouts_compute_gate_up():
    # bench/probes/gu_probe.py (run 181): each layout's kernel computes the gate/up activation (or, for
    # `one`, the rows' dots) of its tiles, and the packed layout holds gate and up where its kernel reads
    from bench.probes import gu_probe
    for name, (call, check) in gu_probe.cases("cpu", 2, 2).items():
        call()
        assert check() < 1e-4, name


def test_power_probe_reads_nvidia_smi_rows_and_summarizes_a_window():
    from bench.probes import power_probe as pp
    text = ("2026/12/02 13:50:01.020, 512.30, 700.00, 1980, 3201, 51, 0x0000000000000004\n"
            "2026/12/02 13:50:01.040, 530.10, 700.00, 1965, 3201, 52, 0x0000000000000000\n"
            "garbage line\n"
            "2026/12/02 13:50:09.000, 90.00, 700.00, 345, 3201, 45, 0x0000000000000001\n")
    s = pp.parse_samples(text)
    assert len(s) == 3 and s[0][1:6] == (512.3, 700.0, 1980.0, 3201.0, 51.0) and s[0][6] == 4
    assert abs((s[1][0] - s[0][0]) - 0.02) < 1e-6
    win = pp.summarize(s, s[0][0], s[1][0])
    assert win["n"] == 2 and win["power_max_W"] == 530.1 and win["reasons"] == {"sw_power_cap": 0.5}
    assert pp.summarize(s, s[2][0], s[2][0])["reasons"] == {"gpu_idle": 1.0}
    assert pp.summarize(s, 0, 1)["n"] == 0


# ---- bench/probes/icache_probe.py: instruction fetch between large code bodies -------------------------
@pytest.mark.slow     # 3 s: a concluded probe's sm_90 compile (runs 193-195)
def test_icache_probe_compiles_every_block_for_sm90(tmp_path):
    """Every block's chain is in the kernel (sm_90, no GPU): blocks x FMAs fma instructions, none folded."""
    from bench.probes import icache_probe as ip
    got = _compile_probe(tmp_path, "icache_probe", 48)
    assert got["fma"] == got["blocks"] * 48 and got["blocks"] >= max(ip.ROTATIONS)
    # --stream's programs: 16-byte loads of the buffer, a relaxed look at the visitors' count each pass, which
    # the visitor releases once
    assert got["streamer_loads"] > 0 and got["relaxed_polls"] == 1 and got["release"] == 1


def test_icache_probe_orders_and_arguments(capsys, monkeypatch):
    from bench.probes import icache_probe as ip
    seqs = ip.orders()
    assert set(seqs["hot"]) == {0} and all(len(s) == ip.VISITS for s in seqs.values())
    for k in ip.ROTATIONS:       # rotK: every one of K blocks equally often, never the same twice running
        s = seqs[f"rot{k}"]
        assert sorted(set(s)) == list(range(k)) and all(a != b for a, b in zip(s, s[1:]))
    assert ip.STREAMERS + 1 == 132 and ip.STREAM_WORDS % ip.PASS_WORDS == 0 and ip.PASS_WORDS % 8192 == 0
    ran = []
    monkeypatch.setattr(ip, "run", lambda fmas, stream=False: ran.append((fmas, stream)))
    assert ip.main(["--stream", "512"]) == 0 and ip.main([]) == 0
    assert ran == [((512,), True), ((256, 512, 1024, 2048), False)]
    monkeypatch.setattr(ip, "run", lambda *a, **kw: pytest.fail("icache_probe ran"))
    for bad in (["0"], ["x"], ["512", "-3"], ["--stream", "x"]):
        assert ip.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "FMAs" in err, err


@pytest.mark.slow     # 9 s: a concluded probe (the suite's 300 s, s45)
def test_stage_probe_layouts_compute_their_stage():
    # bench/probes/stage_probe.py: both layouts and every loader of each stage cover every row block once
    # (uneven splits over 3 programs: 128 / 16 gate/up blocks, 64 / 16 down blocks; QKV and O in the
    # decoder's tiles of 32 and 16 rows) and compute the stage
    from bench.probes import stage_probe as ip
    cs = ip.cases("cpu", 3, layers=2, ffn=512, d=256, syncs=(False,))
    # gate/up and down: ptr and rows in both layouts, the three mma loaders; QKV and O: ptr, rows, col
    assert len(cs) == 2 * 7 + 2 * 3
    assert {k[1] for k in cs if k[0] == "qkv"} == {"ptr", "rows", "col"}
    assert cs[("qkv", "col", "contiguous", False)][2:] == (2 * 384 * 256, 12)
    for name, (call, check, _, _) in cs.items():
        call(fresh=True)
        assert check() < 1e-4, name


@pytest.mark.slow     # 3 s: a concluded probe (the suite's 300 s, s45)
def test_sm_probe_shares_cover_the_stage():
    # bench/probes/sm_probe.py: equal, rotated and weighted shares each cover every row block once and compute
    # the gate/up stage; each program records its SM (its program id under the interpreter) and its layer
    # times; weighted shares follow the rates and sum to the blocks; bad shares are named
    from bench.probes import sm_probe as sp
    st = sp.Stage("cpu", nprog=3, layers=2, ffn=512, d=256)
    eq = sp.equal_shares(st.nblk, 3)
    assert eq == [43, 43, 42]
    for sh in (eq, eq[1:] + eq[:1], sp.weighted_shares(st.nblk, [1.0, 2.0, 1.0])):
        rec = st.run(st.shares(sh), fresh=True)
        assert st.check() < 1e-4
        assert rec[:, 0].tolist() == [0, 1, 2] and (rec[:, 1:] > 0).all()
    assert sp.weighted_shares(st.nblk, [1.0, 2.0, 1.0]) == [32, 64, 32]
    assert sp.weighted_shares(10, [1.0, 1.0, 1.0]) == [4, 3, 3]
    with pytest.raises(ValueError, match="shares"):
        st.shares([100, 0, 0])


@pytest.mark.slow     # 2 s: a concluded probe (the suite's 300 s, s45)
def test_gu8_probe_loaders_compute_the_stage():
    # bench/probes/gu8_probe.py: the column-loop tiles and the split-row loop cover every unit of 16 rows once
    # (uneven over 3 programs: 16 units) and compute the gate/up stage
    from bench.probes import gu8_probe as gp
    cs = gp.cases("cpu", 3, layers=2, ffn=256, d=1024, syncs=(False,))
    assert set(cs) == {("col", False), ("split", False)}
    for name, (call, check) in cs.items():
        call(fresh=True)
        assert check() < 1e-4, name


# ---- bench/probes/launch_gap_probe.py: an empty persistent grid's launch cost ------------------------------
def test_launch_gap_probe_kernel_runs_its_loop_only_when_asked(capsys):
    """The timed launches run no iteration (each program writes 0); with n iterations the loop sums its
    blocks, so the loop (and the shared memory it is given) is in the kernel, not folded away."""
    from bench.probes import launch_gap_probe as lp
    buf = torch.arange(8 * 16384, dtype=torch.float32).remainder(7).to(torch.bfloat16)
    for mode in lp.MODES:
        out = torch.full((3,), -1.0)
        lp.launch(mode, 3, buf, out)
        assert torch.equal(out, torch.zeros(3))
        lp.launch(mode, 3, buf, out, n=2, spin_ns=20000)        # the spin ends (20 us of the host's clock here)
        want = float(buf[:2 * 16384].float().sum())
        torch.testing.assert_close(out, torch.full((3,), want))
    for bad in (["0"], ["x"]):
        assert lp.main(bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "launches" in err, err


# ---- bench/probes/attn_probe.py: the merged attention's links, timed after its wait ------------------------
@pytest.mark.slow     # 7 s: a concluded probe (s35, run 268); the attention it copies compiles in test_kernels_compile
def test_attn_probe_compiles_for_sm90(tmp_path):
    """The attention probe's kernels (sm_90, no GPU, pointers aligned as at a launch): each mode reads the clock
    more than the one before it (its stamps), the pollers sleep only when asked to, every mode polls with
    acquire loads, and the key loop's prefix is async copies, as in the decoder's kernel."""
    got = _compile_probe(tmp_path, "attn_probe")
    clocks = [got[f"mode{m}"]["clock_reads"] for m in (0, 1, 2)]
    assert clocks == sorted(clocks) and len(set(clocks)) == 3, clocks
    assert got["mode0/sleep100"]["nanosleep"] >= 1 and all(got[f"mode{m}"]["nanosleep"] == 0 for m in (0, 1, 2))
    assert all(v["acquire"] >= 2 for v in got.values())
    assert all(0 < v["shared"] <= H200_SMEM_PER_BLOCK for v in got.values())
    # --cold's blob is 8 FFMA a step (16 steps here) on top of the attention's; --opcode polls through tape_waits
    assert got["twice"]["fma"] - got["twice/noblob"]["fma"] == 8 * 16, (got["twice"], got["twice/noblob"])
    assert got["opcode"]["acquire"] > got["mode0"]["acquire"]        # tape_waits' two polls beside the releaser's
    assert all(v["cp.async"] > 0 for v in got.values()), {k: v["cp.async"] for k, v in got.items()}
    # --fresh: the releaser writes q and the new key and value before its release
    assert got["opcode/fresh"]["stores"] > got["opcode"]["stores"], (got["opcode"], got["opcode/fresh"])
    # --fresh's streamers: 123 programs reading the HBM before they poll
    assert got["opcode/busy"]["loads"] > got["opcode"]["loads"], (got["opcode"], got["opcode/busy"])
    assert got["opcode/pages"]["loads"] > got["opcode"]["loads"], (got["opcode"], got["opcode/pages"])


def test_attn_probe_reference_is_softmax_attention_over_keys_0_to_pos():
    import math
    import torch
    from bench.probes import attn_probe as a
    torch.manual_seed(1)
    kc = torch.randn(a.GROUPS, a.MAX_SEQ, a.HD).to(torch.bfloat16)
    vc = torch.randn(a.GROUPS, a.MAX_SEQ, a.HD).to(torch.bfloat16)
    q = torch.randn(a.GROUPS * a.GROUP, a.HD)
    out = a.reference(kc, vc, q, 5)
    h = 2 * a.GROUP + 1                                   # a query head of group 2
    w = torch.softmax(kc[2, :6].float() @ q[h] / math.sqrt(a.HD), dim=0)
    assert torch.allclose(out[h], w @ vc[2, :6].float(), atol=1e-5)
    assert not torch.allclose(a.reference(kc, vc, q, 6)[h], out[h])       # the key at pos counts


# ---- bench/probes/rows_profile.py: a variant's output against the first variant's ---------------------------
def test_rows_profile_compare_names_equal_different_nonfinite_and_shape():
    from bench.probes.rows_profile import compare
    a = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    assert compare(a, a.clone()) == "bitwise equal"
    b = a.clone()
    b[0, 0] += a.abs().max()
    assert compare(a, b) == "max difference 1.000e+00 of the largest value"
    b[1, 1] = float("nan")
    assert compare(a, b).endswith("; 1 values finite in one only")
    assert compare(a, a[:4]) == "shapes differ: (8, 16) against (4, 16)"


def test_rows_profile_lm_rows_are_checked_before_any_gpu_work(capsys):
    from bench.probes import rows_profile as rp
    for bad in (["--lm-rows", "8"], ["--tiling", ";", "--lm-rows", "128;32;64"], ["--lm-rows", "x"]):
        with pytest.raises(SystemExit) as ei:
            rp.main(bad)
        assert ei.value.code == 2 and "--lm-rows: one number >= 16" in capsys.readouterr().err


def test_rows_profile_accuracy_line_applies_the_multi_layer_criterion():
    import argparse

    from bench.probes.rows_profile import accuracy_line, step_rows
    from opcodes import ModelConfig
    g = torch.Generator().manual_seed(1)
    ref32 = torch.randn(3, 50, generator=g)
    ref32[:, 7] += 10.0                                    # a decisive top-2 margin, token 7
    ref = ref32 + 1e-2 * torch.randn(3, 50, generator=g)  # the bf16 reference's error
    good = accuracy_line("v", [0, 5, 9], ref32 + 5e-3 * torch.randn(3, 50, generator=g), ref, ref32)
    assert good.startswith("v: accuracy against the fp32 reference") and good.endswith("meets the criterion")
    assert "row 0 0." in good and "row 9 " in good
    bad = ref32.clone()
    bad[1] += 0.1 * torch.randn(50, generator=g)          # row 5: 10x the bf16 reference's error
    bad[2, 7] -= 20.0                                     # row 9: the greedy token lost where the margin is decisive
    line = accuracy_line("v", [0, 5, 9], bad, ref, ref32)
    assert line.endswith("FAILS the criterion in 2 row(s)") and "row 9 " in line and "(greedy differs)" in line
    cfg = ModelConfig(layers=1, d=64, ffn=128, n_q=4, n_kv=2, hd=16, vocab=100)
    pre = argparse.Namespace(R=4, B=1, pos=10, prefill=True, tokens="distinct")
    assert step_rows(pre, cfg) == ([0] * 4, [10, 11, 12, 13], [5, 22, 39, 56])
    dec = argparse.Namespace(R=16, B=3, pos=10, prefill=False, tokens="same")
    assert step_rows(dec, cfg) == ([0, 1, 2], [10, 10, 10], [7, 7, 7])


# ---- bench/probes/gemm_tiles.py and bucket_probe.py (session 49) ------------------------------------------------

@pytest.mark.parametrize("two", [False, True])
def test_gemm_tiles_kernel_computes_the_gemm_at_each_tile_shape(two):
    """The tile-shape probe's loop (rows_stream's, alone, by rows_gemm's kernel) computes W . X at every tile it
    times: bf16 operands (under the interpreter rows_stream's dots go up to fp32), several weight and column
    blocks a program."""
    from bench.probes import gemm_tiles as gt
    torch.manual_seed(0)
    rows, K, XS = 256, 128, 256
    w, x = torch.randn(rows, K).bfloat16(), torch.randn(K, XS).bfloat16()
    ref = w.float() @ x.float()
    for M, NT in ((32, 128), (64, 64), (16, 256)):
        y = torch.zeros(rows, XS)
        gt.run(w, x, y, rows // 2 if two else rows, K, two, 3, M=M, NT=NT, BK=32, ST=2, warps=4)
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-3)


def test_gemm_tiles_stages_and_arguments(capsys):
    from bench.probes import gemm_tiles as gt
    # the 1024-row bucket's: gate/up 64 + 64 rows x 256 columns, 48 KB a stage; a down tile of 128 x 128 32 KB
    assert gt.stages_for(64, 256, True) == 4 and gt.stages_for(128, 128, False) == 4
    assert gt.stages_for(256, 256, True) == 2
    for bad in ("64", "64x100", "8x256", "axb"):
        with pytest.raises(SystemExit) as e:
            gt.main(["--tiles", bad])
        assert e.value.code == 2 and "--tiles" in capsys.readouterr().err


def test_bucket_probe_first_diff_names_the_element_and_the_layer():
    from bench.probes import bucket_probe as bp
    a = torch.arange(12, dtype=torch.float32)
    assert bp.first_diff(a, a.clone(), 3) == "equal"
    b = a.clone()
    b[5] += 0.5
    b[9] -= 2.0
    got = bp.first_diff(a, b, 3)
    assert got.startswith("first at 5 of 12 (layer part 1 of 3), 2 elements") and "2.000e+00" in got, got
    assert bp.first_diff(a, a[:6], 3).startswith("shapes")


def test_bucket_probe_tiny_row0_is_bitwise_in_every_bucket(capsys):
    """The interpreter's decode buckets: row 0 alone (16 rows), alone in the 32-row bucket and beside 31 other rows,
    bitwise equal in its logits, its K/V and every scratch buffer's column (the CPU half of runs 317-318's question)."""
    from bench.probes import bucket_probe as bp
    assert bp.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert out.count("bitwise equal to (a) in every compared tensor") == 3, out
    assert "scratch:attn_r" in out and "scratch:logits_r" in out
