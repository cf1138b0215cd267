"""GPU reliability checks, on a CUDA device: ``pytest -m gpu tests/test_gpu.py``
(skipped without CUDA; the soak test is also ``slow``: add ``--runslow`` or ``MEGATAPE_SLOW=1``).

* broken tapes (a wrong target, a missing producer, a cyclic order across two SMs, a wrong target in
  an all-pool tape) raise ``interp.MegakernelError`` naming the stuck instruction (``sm <s>`` or
  ``pool``) within seconds, with the default spin limit, and the next launch of a valid handle is
  correct; a failed launch is reported by the next ``layer_step`` without ``check()``;
* pools (the plan's last 60 us, and every instruction), 10 calls each: bitwise the queued tape, the
  ticket counter at exactly calls x (pool + SMs);
* 20 random valid schedules (random SM counts, assignments, queue orders, some with pools) of the
  70B layer and of ``small-gqa4``: output and written KV row bitwise the default schedule's;
  10 repeated runs of one schedule bitwise identical;
* a soak: 20,000 whole-model decode steps with no error, repeated (token, position) pairs giving
  bitwise the same logits, next tokens and KV rows;
* SAMPLE on the GPU draws the token its ``run_torch`` draws from the same logits (4 settings x 16 seeds);
* CUDA graphs (the call count and the position live on the device): a captured step replayed between
  ordinary steps, a block of steps at the device's position replayed at several positions, captured
  decode steps, ``generate`` in graph blocks of 1 / 8 / 32 (greedy and sampled) giving the tokens of
  plain launches, EOS without graph blocks; capture with ``sync_check`` refused; two threads on one
  handle refused, on two handles fine; steps on other streams, beside a GEMM, a rollback;
* the compile-time acceptance timings (the 70B layer in < 5 s, 16 layers in < 30 s, in process and
  through the command line; ``megatape viz`` of the 70B layer in < 30 s), measured on the GPU host
  (CPU tests assert no wall-clock times).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
import random
import re
import subprocess
import sys
import time

import pytest
import torch

from conftest import bump_target, clone_cache, decoder_weights, drop_producer
from interp import generate, layer_step
from opcodes import PRESETS, ModelConfig
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[1]
TOL = 1.5e-2
HANG_SECONDS = 5.0          # "within a few seconds" (2^20 polls are 0.2-1 s on a GPU)
SMALL = "small-gqa4"
CONFIGS = {SMALL: (64, 37), "llama70b-layer": (4224, 4096)}       # preset -> (max_seq, prefill)
N_SCHED = 20


def _dev():
    return torch.device("cuda")


# ---- broken tapes --------------------------------------------------------------------------------
BROKEN_SMS = 8
BROKEN_KINDS = ["wrong target", "missing producer", "cyclic order across two SMs", "wrong target in an all-pool tape"]


def _cyclic_across_two_sms(tape):
    """SM 0 starts with a consumer of what SM 1 produces last, and SM 1 starts with a consumer of
    what SM 0 produces last: each waits on the other forever."""
    words = tape.words.clone()
    sm_of = tape.sm_of_slot()
    s0 = [k for k in range(len(tape)) if sm_of[k] == 0]
    s1 = [k for k in range(len(tape)) if sm_of[k] == 1]
    c0, c1 = int(words[s0[-1], 5]), int(words[s1[-1], 5])
    assert c0 >= 0 and c1 >= 0, "both SMs must end with a signalling instruction"
    for first, c in ((s0[0], c1), (s1[0], c0)):
        words[first, 1] = c
        words[first, 2] = sum(1 for k in range(len(tape)) if int(words[k, 5]) == c)
    return dataclasses.replace(tape, words=words)


def _broken(kind: str, cfg, max_seq: int):
    from schedule import compile_model
    tape = compile_model(cfg, BROKEN_SMS, max_seq=max_seq, pool_us=(1e9 if "pool" in kind else 0.0)).tape
    if kind in ("wrong target", "wrong target in an all-pool tape"):
        return bump_target(tape)[0]
    if kind == "missing producer":
        return drop_producer(tape)[0]
    assert kind == "cyclic order across two SMs"
    return _cyclic_across_two_sms(tape)


@pytest.fixture(scope="module")
def small_layer():
    """small-gqa4 on the GPU: weights, a prefilled cache, x and a valid handle on 8 SMs."""
    from interp import build_layer, teardown
    cfg = PRESETS[SMALL]
    max_seq, prefill = CONFIGS[SMALL]
    w = make_weights(cfg, device=_dev())
    kv = make_kv_cache(cfg, max_seq, prefill, device=_dev())
    x = torch.randn(1, cfg.d, device=_dev()).to(torch.bfloat16)
    good = build_layer(w, kv, cfg.to_dict(), max_seq, num_sms=BROKEN_SMS)
    yield cfg, max_seq, prefill, w, kv, x, good
    teardown(good)


def _next_launch_is_correct(small_layer):
    from interp import layer_step
    cfg, max_seq, prefill, w, kv, x, good = small_layer
    kv_ref = clone_cache(kv)
    out = layer_step(good, x, prefill)
    good.check()
    err = rel_err(out, model_ref(w, kv_ref, cfg, x, prefill))
    assert err <= TOL, f"the next launch after a broken tape: rel err {err:.2e}"


@pytest.mark.parametrize("kind", BROKEN_KINDS)
def test_broken_tape_raises_within_seconds(small_layer, handles, kind):
    from interp import MegakernelError, layer_step
    cfg, max_seq, prefill, w, kv, x, good = small_layer
    kv_b = make_kv_cache(cfg, max_seq, prefill, device=_dev())
    bad = handles.layer(w, kv_b, cfg.to_dict(), max_seq, tape=_broken(kind, cfg, max_seq), verify_tape=False)
    t0 = time.perf_counter()
    with pytest.raises(MegakernelError) as ei:
        layer_step(bad, x, prefill)
        bad.check()
    dt = time.perf_counter() - t0
    msg = str(ei.value)
    assert dt < HANG_SECONDS, f"{kind}: MegakernelError after {dt:.2f} s"
    assert "instruction" in msg and len(ei.value.stuck) > 0, msg
    # every stuck instruction is named with where it ran: a queue (sm <s>) or the pool
    where = r"pool" if "pool" in kind else r"sm \d+"
    for _, slot, desc, *_ in ei.value.stuck:
        assert re.fullmatch(rf"instruction {slot} \(.*, {where}\)", desc), (kind, desc)
        assert desc in msg
    _next_launch_is_correct(small_layer)


def test_failure_is_reported_by_the_next_layer_step(small_layer, handles):
    """Without check(): the next layer_step sees the pinned failure flag and raises before launching
    again (the kernel has ended: synchronize, no check)."""
    from interp import MegakernelError, layer_step
    cfg, max_seq, prefill, w, kv, x, good = small_layer
    kv_b = make_kv_cache(cfg, max_seq, prefill, device=_dev())
    bad = handles.layer(w, kv_b, cfg.to_dict(), max_seq, tape=_broken("wrong target", cfg, max_seq),
                        verify_tape=False)
    layer_step(bad, x, prefill)
    torch.cuda.synchronize()
    with pytest.raises(MegakernelError) as ei:
        layer_step(bad, x, prefill)
    assert "instruction" in str(ei.value) and len(ei.value.stuck) > 0, str(ei.value)
    _next_launch_is_correct(small_layer)


# ---- pools, random schedules, repeatability (small-gqa4 and the 70B layer) -----------------------
@pytest.fixture(scope="module", params=list(CONFIGS))
def race_layer(request):
    """Weights, cache, x, the default schedule's handle, its output at ``prefill`` and the KV row it wrote."""
    from interp import build_layer, layer_step, teardown
    cfg = PRESETS[request.param]
    max_seq, prefill = CONFIGS[request.param]
    w = make_weights(cfg, device=_dev())
    kv = make_kv_cache(cfg, max_seq, prefill, device=_dev())
    x = torch.randn(1, cfg.d, device=_dev()).to(torch.bfloat16)
    h = build_layer(w, kv, cfg.to_dict(), max_seq)
    ref = layer_step(h, x, prefill)
    h.check()
    krow = [p[0][:, :, prefill].clone() for p in kv]
    yield dict(cfg=cfg, max_seq=max_seq, prefill=prefill, w=w, kv=kv, x=x, h=h, ref=ref, krow=krow)
    teardown(h)
    torch.cuda.empty_cache()


def test_repeated_runs_bitwise_identical(race_layer):
    from interp import layer_step
    r = race_layer
    reps = [layer_step(r["h"], r["x"], r["prefill"]) for _ in range(10)]
    r["h"].check()
    differ = [i for i, o in enumerate(reps) if not torch.equal(o.view(torch.int16), r["ref"].view(torch.int16))]
    assert not differ, f"{r['cfg'].name}: repeated runs {differ} differ from the first"


def test_pools_bitwise_the_queued_tape(race_layer, handles):
    """The plan's tail (or all of it) taken by ticket; 10 calls each, bitwise the default, and the
    ticket counter exactly (pool length + SMs) per call."""
    from interp import layer_step
    r = race_layer
    bad = []
    for pool_us in (60.0, 1e9):
        hp = handles.layer(r["w"], r["kv"], r["cfg"].to_dict(), r["max_seq"], pool_us=pool_us)
        outs = [layer_step(hp, r["x"], r["prefill"]) for _ in range(10)]
        hp.check()
        tick = int(hp.counters[hp.tape.pool_counter])
        if not all(torch.equal(o.view(torch.int16), r["ref"].view(torch.int16)) for o in outs) or \
                tick != 10 * hp.tape.tickets_per_call():
            bad.append((pool_us, hp.tape.pool_len, tick, 10 * hp.tape.tickets_per_call(), rel_err(outs[-1], r["ref"])))
    assert not bad, f"{r['cfg'].name}: (pool_us, pool_len, tickets, expected, rel err) {bad}"


def test_random_schedules_bitwise_the_default(race_layer, handles):
    """Random valid schedules (random SM counts, assignment and queue orders, some with pools) vs
    the default one: the output and the written KV row bitwise identical."""
    from interp import layer_step, teardown
    r = race_layer
    rng = random.Random(0)
    dev_sms = torch.cuda.get_device_properties(_dev()).multi_processor_count
    bad = []
    for k in range(N_SCHED):
        sms = rng.choice([1, 2, 7, 33, 64, 100, dev_sms, rng.randint(1, dev_sms)])
        pool_us = rng.choice([0.0, 0.0, 20.0, 100.0, 1e9])
        hk = handles.layer(r["w"], r["kv"], r["cfg"].to_dict(), r["max_seq"], num_sms=sms, policy="random",
                           seed=rng.randrange(1 << 30), pool_us=pool_us)
        out = layer_step(hk, r["x"], r["prefill"])
        hk.check()
        ok = torch.equal(out.view(torch.int16), r["ref"].view(torch.int16)) and all(
            torch.equal(p[0][:, :, r["prefill"]], row) for p, row in zip(r["kv"], r["krow"]))
        if not ok:
            bad.append((k, sms, pool_us, rel_err(out, r["ref"])))
        teardown(hk)
    assert not bad, f"{r['cfg'].name}: (schedule, sms, pool_us, rel err) that differ: {bad[:4]}"


# ---- soak: 20,000 whole-model decode steps -------------------------------------------------------
SOAK_STEPS = 20_000
SOAK_WINDOW = 50          # positions 0 .. 49, cycled: 400 cycles
SOAK_CFG = dataclasses.replace(PRESETS["small-2layer"], vocab=1000, name="small-2layer-vocab1000")


@pytest.mark.slow
def test_soak_decode_20000_steps_bitwise_repeatable():
    """20,000 decode steps of a two-layer model with a vocabulary (one launch each) cycling over
    positions 0..49. Even cycles feed fixed tokens through ``decode_step``; odd cycles run greedy
    ``generate`` from a fixed prompt (the token stays on the device). Every cycle rewrites the KV rows
    it reads, so each (token, position) must give bitwise the logits, next token and KV rows of the
    first cycle of its kind. Mismatches are counted on the device (no sync per step)."""
    from interp import build_decoder, decode_step, generate, teardown
    cfg, W = SOAK_CFG, SOAK_WINDOW
    assert SOAK_STEPS % (2 * W) == 0
    dev = _dev()
    w = decoder_weights(cfg, seed=3, device=dev)
    kv = make_kv_cache(cfg, W, 0, device=dev)
    h = build_decoder(w, kv, cfg.to_dict(), W)
    g = torch.Generator().manual_seed(4)
    fixed = torch.randint(0, cfg.vocab, (W,), generator=g).to(torch.int32).to(dev)
    prompt = fixed[:5].clone()
    first = {}                       # kind -> (logits (W, vocab), next tokens (W,), KV rows)
    mismatches = torch.zeros((), dtype=torch.int64, device=dev)
    steps = 0
    t0 = time.perf_counter()
    for cycle in range(SOAK_STEPS // W):
        kind = cycle % 2
        if kind == 0:
            lg = torch.stack([decode_step(h, fixed[p:p + 1], p)[0] for p in range(W)])
        else:
            _, gl = generate(h, prompt, W - len(prompt) + 1, return_logits=True)
            lg = gl                                   # logits of positions 4 .. W-1
        steps += W
        toks = h.toks.clone()
        rows = torch.cat([t.reshape(-1) for pair in kv for t in pair])
        if kind not in first:
            first[kind] = (lg.clone(), toks, rows.clone())
            continue
        lg0, toks0, rows0 = first[kind]
        mismatches += (lg.view(torch.int32) != lg0.view(torch.int32)).sum()
        mismatches += (toks != toks0).sum()
        mismatches += (rows.view(torch.int16) != rows0.view(torch.int16)).sum()
    h.layer.check()
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    teardown(h)
    assert steps == SOAK_STEPS
    assert int(mismatches) == 0, f"{int(mismatches)} values differ between cycles over {steps} steps"
    # generate's greedy tokens are the argmax of the logits it returned
    lg1, toks1, _ = first[1]
    assert torch.equal(toks1[len(prompt) - 1:W].to(torch.int64), lg1.argmax(dim=-1))
    print(f"soak: {steps} steps in {dt:.1f} s ({1e6 * dt / steps:.0f} us/step including host work)")


# ---- SAMPLE on the GPU: the token run_torch draws, bit for bit ------------------------------------
SAMPLE_CFG = ModelConfig(layers=2, d=256, ffn=512, n_q=4, n_kv=2, hd=64, theta=10000.0, vocab=50000, name="sample")


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 50, 1.0), (1.2, 0, 0.9), (0.9, 200, 0.8)])
def test_sample_on_the_gpu_draws_the_token_of_run_torch(temperature, top_k, top_p):
    """SAMPLE's weights are exact integers, so the GPU draws what ``opcodes.sample.sample_torch``
    draws from the same logits, for every seed (49 blocks of logits: the block skipping runs)."""
    from interp import build_decoder, generate, teardown
    from opcodes import Sample
    from opcodes.sample import cand_path_torch, chunk_size, n_cands, sample_torch
    cfg, dev, pos = SAMPLE_CFG, _dev(), 2
    w = decoder_weights(cfg, seed=5, device=dev)
    h = build_decoder(w, make_kv_cache(cfg, 16, 0, device=dev), cfg.to_dict(), 16, sampling=True)
    lay = h.lay
    try:
        for seed in range(16):
            tok = generate(h, [11, 22, 33], 1, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
            args = (h.logits[0].cpu(), h.layer.scratch["amax"].cpu(), lay.n_lm_tiles, lay.lm_rows,
                    Sample.CONSTEXPRS["SMP_BLOCK"](lay))
            smp = h.layer.state["smp"].cpu()
            want = sample_torch(*args, smp, pos)
            assert int(tok[0]) == want, (seed, int(tok[0]), want)
            # the path SAMPLE took (candidates or the whole vocabulary) is the one its torch twin names
            path = int(h.layer.scratch["smp_mass"][-1])
            assert path == cand_path_torch(*args, chunk_size(lay), n_cands(lay), smp), (seed, path)
    finally:
        teardown(h)


# ---- compile-time acceptance timings (CPU work, measured on the GPU host) ------------------------
def test_compile_70b_layer_under_5s():
    from schedule import compile_model
    t0 = time.perf_counter()
    c = compile_model(ModelConfig.from_name("llama70b-layer"), 132)
    wall = time.perf_counter() - t0
    assert len(c.tape) == len(c.prog) and c.report.n_sms == 132
    assert wall < 5.0, f"compile_model(llama70b-layer, 132) took {wall:.2f} s"


def test_compile_70b_16_layers_under_30s():
    from schedule import compile_model
    t0 = time.perf_counter()
    c = compile_model(ModelConfig.from_name("llama70b-layer").with_layers(16), 132)
    wall = time.perf_counter() - t0
    assert c.report.n_instructions == len(c.tape)
    assert wall < 30.0, f"compile_model(llama70b-layer x16, 132) took {wall:.2f} s"


@pytest.mark.parametrize("layers,limit", [(None, 5.0), (16, 30.0)])
def test_cli_compile_70b_time(layers, limit):
    """``megatape compile`` as a process, with no GPU visible (compiling needs none): both schedules
    compiled and verified within the limit, as the command times itself (from its start, after the
    imports: on the GPU host importing the CUDA build of torch alone takes ~3 s, the whole process
    5.1 s here against 2.3 s on the 2-core CPU machine)."""
    argv = [sys.executable, "-m", "megatape.cli", "compile", "--preset", "llama70b-layer", "--sms", "132"]
    if layers:
        argv += ["--layers", str(layers)]
    t0 = time.perf_counter()
    p = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    wall = time.perf_counter() - t0
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("verified:") == 2
    m = re.search(r"^time taken: ([\d.]+) s", p.stdout, re.M)
    assert m, p.stdout[-500:]
    took = float(m.group(1))
    assert took < limit, (f"megatape compile {' '.join(argv[4:])} took {took:.1f} s (limit {limit} s; "
                          f"{wall:.1f} s with the imports)")


def test_viz_70b_layer_under_30s(tmp_path, capsys):
    from megatape.cli import main
    t0 = time.perf_counter()
    assert main(["viz", "--preset", "llama70b-layer", "--sms", "132", "--out", str(tmp_path)]) == 0
    dt = time.perf_counter() - t0
    capsys.readouterr()
    assert dt < 30, f"viz of the 70B layer took {dt:.1f} s"


# ---- CUDA graphs: the call count and the position live on the device -------------------------------
def _small_model(handles, layers=1, prefill=20, max_seq=64, **kw):
    cfg = dataclasses.replace(PRESETS[SMALL], layers=layers)
    w = make_weights(cfg, seed=21, device=_dev())
    kv = make_kv_cache(cfg, max_seq, prefill, seed=22, device=_dev())
    ref = clone_cache(kv)
    return cfg, w, kv, ref, handles.model(w, kv, cfg.to_dict(), max_seq, **kw)


def _x(cfg, seed):
    """A (1, d) bf16 input; never called under capture (a generator seeded there is not the graph's)."""
    g = torch.Generator(device=_dev()).manual_seed(seed)
    return torch.randn(1, cfg.d, generator=g, device=_dev()).to(torch.bfloat16)


@pytest.mark.parametrize("layers", [1, 2])
def test_captured_step_replays_mixed_with_ordinary_steps(handles, layers):
    """A step captured in a CUDA graph replays correctly any number of times, mixed with ordinary
    steps before and after (with a host-advanced call number the replays found their counter
    targets met: a silent wrong answer, which main refused to capture)."""
    cfg, w, kv, ref, h = _small_model(handles, layers=layers)
    x0 = _x(cfg, 1)
    assert rel_err(layer_step(h, x0, 20), model_ref(w, ref, cfg, x0, 20)) <= TOL
    xc = _x(cfg, 2)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out_c = layer_step(h, xc, 21)                     # captured, not run
    want = model_ref(w, ref, cfg, xc, 21)
    for k in range(5):
        g.replay()
        torch.cuda.synchronize()
        assert rel_err(out_c, want) <= TOL, k
        if k % 2:
            xo = _x(cfg, 10 + k)                          # an ordinary step in between, at the next position
            refk = clone_cache(ref)
            assert rel_err(layer_step(h, xo, 22), model_ref(w, refk, cfg, xo, 22)) <= TOL
    h.check()
    xe = _x(cfg, 3)
    assert rel_err(layer_step(h, xe, 22), model_ref(w, ref, cfg, xe, 22)) <= TOL


def test_captured_block_at_the_device_position(handles):
    """A graph of 4 model steps at the device's position: each replay writes the next 4 positions."""
    cfg, w, kv, ref, h = _small_model(handles, layers=2)
    from interp.runtime import set_position
    xs = [_x(cfg, 30 + k) for k in range(4)]
    layer_step(h, xs[0], 20)                              # warm: the device now holds position 21
    model_ref(w, ref, cfg, xs[0], 20)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = [layer_step(h, xs[k], None) for k in range(4)]
    for start in (21, 25, 21):
        if start == 21:
            set_position(h, 21)
        g.replay()
        torch.cuda.synchronize()
        refk = clone_cache(ref)
        for k in range(4):
            assert rel_err(outs[k], model_ref(w, refk, cfg, xs[k], start + k)) <= TOL, (start, k)
        if start == 21:
            ref = refk
    h.check()


def test_captured_decode_steps_at_the_device_position(handles):
    """decode_step is capturable too: a graph of 3 steps at the device's position (tokens from a
    device tensor) gives the logits of ordinary steps at explicit positions on another handle."""
    from interp import decode_step
    from interp.runtime import set_position
    cfg = dataclasses.replace(PRESETS[SMALL], layers=2, vocab=1000)
    w = decoder_weights(cfg, seed=4, device=_dev())
    hp = handles.decoder(w, make_kv_cache(cfg, 64, 0, device=_dev()), cfg.to_dict(), 64)
    hg = handles.decoder(w, make_kv_cache(cfg, 64, 0, device=_dev()), cfg.to_dict(), 64)
    toks = torch.tensor([5, 17, 3, 999], dtype=torch.int32, device=_dev())
    want = [decode_step(hp, toks[k:k + 1], k) for k in range(4)]
    decode_step(hg, toks[0:1], 0)                         # position 0 ordinary; the device now holds 1
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        got = [decode_step(hg, toks[k:k + 1], None) for k in range(1, 4)]
    for _ in range(2):                                    # replay twice over the same positions
        set_position(hg, 1)
        g.replay()
        torch.cuda.synchronize()
        for k in range(1, 4):
            assert rel_err(got[k - 1], want[k]) <= 1e-3, k
    hg.layer.check()


@pytest.mark.parametrize("sampling", [False, True])
def test_generate_in_graph_blocks_equals_plain_launches(handles, sampling):
    """generate in CUDA-graph blocks of 1, 8, 32 launches (and the default) makes the tokens of one
    host launch per token, greedy and sampled (SAMPLE's Philox by the position the kernel took from
    the device); with EOS ids the host reads each token (no graph blocks) and stops at the EOS."""
    cfg = dataclasses.replace(PRESETS[SMALL], layers=2, vocab=1000)
    w = decoder_weights(cfg, seed=3, device=_dev())
    kw = dict(temperature=0.8, top_k=50, top_p=0.95, seed=3) if sampling else {}
    out = []
    for block in (0, 1, 8, 32, None):
        kv = make_kv_cache(cfg, 128, 0, device=_dev())
        h = handles.decoder(w, kv, cfg.to_dict(), 128, sampling=sampling)
        toks = generate(h, [5, 17, 3], 70, graph_block=block, **kw)
        out.append(toks.cpu())
        h.layer.check()
        if block == 8:                                    # the same handle again: its graph replays
            again = generate(h, [5, 17, 3], 70, graph_block=block, **kw)
            assert torch.equal(again.cpu(), out[0])
    assert all(torch.equal(t, out[0]) for t in out[1:])
    eos = int(out[0][40])
    kv = make_kv_cache(cfg, 128, 0, device=_dev())
    h = handles.decoder(w, kv, cfg.to_dict(), 128, sampling=sampling)
    with pytest.raises(ValueError, match="graph_block"):
        generate(h, [5, 17, 3], 70, graph_block=8, eos_token_ids=eos, **kw)
    stopped = generate(h, [5, 17, 3], 70, eos_token_ids=eos, **kw).cpu()
    first = out[0].tolist().index(eos)
    assert stopped.tolist() == out[0][:first + 1].tolist()


@pytest.mark.parametrize("sampling", [False, True])
def test_generate_across_the_two_tapes_of_a_decoder(handles, monkeypatch, sampling):
    """A decoder of two tapes (``AttnPartial.MERGED_MAX_SEQ`` lowered to 40: positions below 40 run the
    merged attention's tape) generates in CUDA-graph blocks of 8 across the switch the tokens of one
    host launch per token (each block's replays start at the position the other tape left)."""
    from interp.codegen import CTL_POS
    from opcodes.attn_partial import AttnPartial
    monkeypatch.setattr(AttnPartial, "MERGED_MAX_SEQ", 40)
    cfg = dataclasses.replace(PRESETS[SMALL], layers=2, vocab=1000)
    w = decoder_weights(cfg, seed=5, device=_dev())
    kw = dict(temperature=0.8, top_k=50, top_p=0.95, seed=3) if sampling else {}
    out = []
    for block in (0, 8):
        h = handles.decoder(w, make_kv_cache(cfg, 128, 0, device=_dev()), cfg.to_dict(), 128, sampling=sampling)
        assert h.short is not None and h.short_until == 40
        out.append(generate(h, [5, 17, 3], 70, graph_block=block, **kw).cpu())
        for k in h.handles:
            k.check()
        # the prompt at 0..2, new tokens made at 2..71: the long tape ran last and holds position 72
        assert h.active is h.layer and int(h.layer.ctl[CTL_POS]) == 72 and h.next_pos == 72
        assert int(h.short.ctl[CTL_POS]) == 40
    assert torch.equal(out[0], out[1]), out


def test_capture_misuse_is_refused(handles):
    """sync_check=True synchronises after every step: capturing it is refused with a clear error."""
    cfg, w, kv, ref, h = _small_model(handles, sync_check=True)
    x = _x(cfg, 4)                                        # made before the capture
    g = torch.cuda.CUDAGraph()
    with pytest.raises(ValueError, match="sync_check"):
        with torch.cuda.graph(g):
            layer_step(h, x, 20)
    assert rel_err(layer_step(h, x, 20), model_ref(w, ref, cfg, x, 20)) <= TOL     # the handle still works


def test_two_threads_on_one_handle_raise_and_on_two_handles_work(handles):
    import threading
    cfg, w, kv, ref, h = _small_model(handles)
    assert h.lock.acquire(blocking=False)               # a thread is inside a step of h
    try:
        with pytest.raises(RuntimeError, match="two threads"):
            layer_step(h, _x(cfg, 5), 20)
    finally:
        h.lock.release()
    cfg2, w2, kv2, ref2, h2 = _small_model(handles)
    errs, results = [], {}

    def worker(name, hh, ww, rr):
        try:
            for k in range(20):
                x = _x(cfg, 100 + k)
                y = layer_step(hh, x, 20 + k)
                torch.cuda.synchronize()
                results[(name, k)] = rel_err(y, model_ref(ww, rr, cfg, x, 20 + k))
        except Exception as e:      # reported below
            errs.append(repr(e))

    ts = [threading.Thread(target=worker, args=("a", h, w, ref)), threading.Thread(target=worker, args=("b", h2, w2, ref2))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errs and max(results.values()) <= TOL


def test_steps_on_other_streams_rollback_and_beside_a_gemm(handles):
    """A step on a non-default stream, one beside a large GEMM on another stream, a rollback (the
    same position again with another input), then teardown. (b68ef25's version failed in run 39:
    it took the rollback's reference cache before position 20 was written into it, and did not
    order the streams after the default stream that made the inputs.)"""
    cfg, w, kv, ref, h = _small_model(handles)
    a = torch.randn(8192, 8192, device=_dev(), dtype=torch.bfloat16)
    x, x2, x3 = _x(cfg, 6), _x(cfg, 7), _x(cfg, 8)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())             # the inputs are ready
    with torch.cuda.stream(s):                              # a non-default stream
        y = layer_step(h, x, 20)
    s.synchronize()
    assert rel_err(y, model_ref(w, ref, cfg, x, 20)) <= TOL
    r20 = clone_cache(ref)                                  # the reference cache through position 20
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                           # a large GEMM on another stream meanwhile
        big = a @ a
    y2 = layer_step(h, x2, 21)
    torch.cuda.synchronize()
    assert rel_err(y2, model_ref(w, ref, cfg, x2, 21)) <= TOL and big.isfinite().all()
    # roll back: position 21 again, another input
    assert rel_err(layer_step(h, x3, 21), model_ref(w, r20, cfg, x3, 21)) <= TOL
    from interp import teardown
    teardown(h)
    with pytest.raises(ValueError, match="teardown"):
        layer_step(h, x3, 22)
