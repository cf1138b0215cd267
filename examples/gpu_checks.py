"""GPU reliability checks (issues 3 and 7): broken tapes fail fast and leave the process usable,
random valid schedules give bitwise-identical results, repeated runs are bitwise identical.

    python3 examples/gpu_checks.py [--preset llama70b-layer] [--schedules 20]

Prints one line per check and a summary table; exits 1 if any check fails.
"""
from __future__ import annotations

import argparse
import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from interp import MegakernelError, build_layer, layer_step, teardown  # noqa: E402
from opcodes import PRESETS  # noqa: E402
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err  # noqa: E402
from schedule import compile_model  # noqa: E402

RESULTS: list[tuple[str, bool, str]] = []


def record(name: str, ok: bool, detail: str) -> None:
    RESULTS.append((name, ok, detail))
    print(f"[{'PASS' if ok else 'FAIL'}] {name}: {detail}", flush=True)


def broken_tapes(cfg, max_seq, prefill, dev):
    """Each broken tape must raise MegakernelError naming a stuck instruction within seconds, and a
    valid launch right after must be correct."""
    w = make_weights(cfg, device=dev)
    kv = make_kv_cache(cfg, max_seq, prefill, device=dev)
    good = build_layer(w, kv, cfg.to_dict(), max_seq, num_sms=8)
    x = torch.randn(1, cfg.d, device=dev).to(torch.bfloat16)

    def mutate(kind):
        comp = compile_model(cfg, 8, max_seq=max_seq, pool_us=(1e9 if "pool" in kind else 0.0))
        t = comp.tape
        words = t.words.clone()
        waits = [k for k in range(len(t)) if int(words[k, 1]) >= 0]
        if kind in ("wrong target", "wrong target in an all-pool tape"):
            words[waits[0], 2] += 1
        elif kind == "missing producer":
            c = int(words[waits[0], 1])
            prod = [k for k in range(len(t)) if int(words[k, 5]) == c]
            words[prod[-1], 5] = -1
        elif kind == "cyclic order across two SMs":
            # SM 0 starts with a consumer of what SM 1 produces last, and SM 1 starts with a
            # consumer of what SM 0 produces last: each waits on the other forever
            sm_of = t.sm_of_slot()
            s0 = [k for k in range(len(t)) if sm_of[k] == 0]
            s1 = [k for k in range(len(t)) if sm_of[k] == 1]
            c0, c1 = int(words[s0[-1], 5]), int(words[s1[-1], 5])
            assert c0 >= 0 and c1 >= 0, "both SMs must end with a signalling instruction"
            for first, c in ((s0[0], c1), (s1[0], c0)):
                words[first, 1] = c
                words[first, 2] = sum(1 for k in range(len(t)) if int(words[k, 5]) == c)
        t.words = words
        return t

    for kind in ("wrong target", "missing producer", "cyclic order across two SMs", "wrong target in an all-pool tape"):
        kv_b = make_kv_cache(cfg, max_seq, prefill, device=dev)
        bad = build_layer(w, kv_b, cfg.to_dict(), max_seq, tape=mutate(kind), verify_tape=False)
        t0 = time.perf_counter()
        try:
            layer_step(bad, x, prefill)
            bad.check()
            record(f"broken tape: {kind}", False, "no error raised")
        except MegakernelError as e:
            dt = time.perf_counter() - t0
            first = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
            record(f"broken tape: {kind}", dt < 5.0 and "instruction" in str(e),
                   f"MegakernelError after {dt:.2f} s, {len(e.stuck)} SM(s) stuck; first: {first[:140]}")
        if kind == "wrong target":
            # without check(): the next layer_step sees the pinned failure flag and raises before
            # launching again (the kernel has ended: synchronize, no check)
            bad2 = build_layer(w, kv_b, cfg.to_dict(), max_seq, tape=mutate(kind), verify_tape=False)
            layer_step(bad2, x, prefill)
            torch.cuda.synchronize()
            try:
                layer_step(bad2, x, prefill)
                record("failure seen by the next layer_step", False, "no error raised")
            except MegakernelError as e:
                record("failure seen by the next layer_step", "instruction" in str(e) and len(e.stuck) > 0,
                       f"MegakernelError naming {len(e.stuck)} stuck SM(s)")
            teardown(bad2)
        kv_ref = [tuple(t.clone() for t in p) for p in kv]
        out = layer_step(good, x, prefill)
        good.check()
        err = rel_err(out, model_ref(w, kv_ref, cfg, x, prefill))
        record(f"next launch after '{kind}'", err <= 1.5e-2, f"rel err {err:.2e}")
        teardown(bad)
    teardown(good)


def race(cfg, max_seq, prefill, dev, n_sched: int, seed: int = 0):
    """Random valid schedules (random SM counts, assignment and queue orders) vs the default one:
    the output and the written KV row must be bitwise identical; repeated runs too."""
    w = make_weights(cfg, device=dev)
    kv = make_kv_cache(cfg, max_seq, prefill, device=dev)
    x = torch.randn(1, cfg.d, device=dev).to(torch.bfloat16)
    h = build_layer(w, kv, cfg.to_dict(), max_seq)
    ref = layer_step(h, x, prefill)
    h.check()
    krow = [p[0][:, :, prefill].clone() for p in kv]
    reps = [layer_step(h, x, prefill) for _ in range(10)]
    h.check()
    same = all(torch.equal(r.view(torch.int16), ref.view(torch.int16)) for r in reps)
    record(f"{cfg.name}: 10 repeated runs of one schedule", same, "bitwise identical" if same else "DIFFER")
    teardown(h)
    # the pool: the plan's tail (or all of it) taken by ticket; 10 calls each, bitwise the default,
    # and the ticket counter exactly (pool length + SMs) per call
    bad = []
    for pool_us in (60.0, 1e9):
        hp = build_layer(w, kv, cfg.to_dict(), max_seq, pool_us=pool_us)
        outs = [layer_step(hp, x, prefill) for _ in range(10)]
        hp.check()
        tick = int(hp.counters[hp.tape.pool_counter])
        if not all(torch.equal(o.view(torch.int16), ref.view(torch.int16)) for o in outs) or \
                tick != 10 * hp.tape.tickets_per_call():
            bad.append((pool_us, hp.tape.pool_len, tick, rel_err(outs[-1], ref)))
        teardown(hp)
    record(f"{cfg.name}: pools of the last 60 us and of everything, 10 calls each", not bad,
           "bitwise identical to the queued tape; ticket counter = calls x (pool + SMs)" if not bad
           else f"differ: {bad}")
    rng = random.Random(seed)
    dev_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    bad = []
    for k in range(n_sched):
        sms = rng.choice([1, 2, 7, 33, 64, 100, dev_sms, rng.randint(1, dev_sms)])
        pool_us = rng.choice([0.0, 0.0, 20.0, 100.0, 1e9])
        hk = build_layer(w, kv, cfg.to_dict(), max_seq, num_sms=sms, policy="random", seed=rng.randrange(1 << 30),
                         pool_us=pool_us)
        out = layer_step(hk, x, prefill)
        hk.check()
        ok = torch.equal(out.view(torch.int16), ref.view(torch.int16)) and all(
            torch.equal(p[0][:, :, prefill], r) for p, r in zip(kv, krow))
        if not ok:
            bad.append((k, sms, pool_us, rel_err(out, ref)))
        teardown(hk)
    record(f"{cfg.name}: {n_sched} random valid schedules (some with pools) vs the default", not bad,
           "all bitwise identical (output and KV row)" if not bad else f"differ: {bad[:4]}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="llama70b-layer")
    ap.add_argument("--small", default="small-gqa4")
    ap.add_argument("--schedules", type=int, default=20)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_checks needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; torch {torch.__version__}", flush=True)
    small = PRESETS[a.small]
    broken_tapes(small, 64, 37, dev)
    race(small, 64, 37, dev, a.schedules)
    race(PRESETS[a.preset], 4224, 4096, dev, a.schedules)
    n_ok = sum(ok for _, ok, _ in RESULTS)
    print("\n| check | result | detail |\n|---|---|---|")
    for name, ok, detail in RESULTS:
        print(f"| {name} | {'PASS' if ok else 'FAIL'} | {detail} |")
    print(f"\n{n_ok}/{len(RESULTS)} checks passed")
    return 0 if n_ok == len(RESULTS) else 1


if __name__ == "__main__":
    sys.exit(main())
