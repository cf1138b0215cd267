"""
Compile a layer to an instruction tape and read it
===================================================

megatape runs a decoder layer as one persistent kernel that walks a *tape*: per-SM queues of
tile-sized instructions that wait on and signal global counters. Everything about that tape is
decided before the GPU runs, on the host, by ``schedule.compile_model``. In this tutorial you will
learn how to:

* compile a model config to a verified tape for N SMs and read its summary (instructions per
  opcode, counters, the planned makespan beside the bandwidth lower bound);
* read the listing of a few SMs' queues, and what the ``wait`` / ``signal`` columns mean;
* watch the verifier reject a broken tape, naming the culprit instruction;
* save the tape as JSON and load it back;
* run the tape in the tape VM (plain torch, no Triton) under several interleavings of the SMs and
  compare the result with the eager reference.

Run it with ``python examples/01_compile_a_layer.py`` (CPU: the ``tiny`` preset on 3 SMs, a few
seconds) or ``--preset llama70b-layer --sms 132`` (a 70B-class layer; the default on a GPU, where it
also runs the tape in the real kernel).
"""
from __future__ import annotations

import argparse
import collections
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                      # run from a clone: no install needed

import torch  # noqa: E402  (torch does not import triton)

CUDA = torch.cuda.is_available()
if not CUDA:                                       # no GPU: kernels (if any) run in the Triton interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")

from opcodes import REGISTRY, ModelConfig  # noqa: E402
from opcodes.reference import make_kv_cache, make_weights, model_ref, rel_err  # noqa: E402
from schedule import Tape, TapeError, compile_model, decode, verify  # noqa: E402
from schedule.vm import run_tape  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    ap.add_argument("--preset", default="llama70b-layer" if CUDA else "tiny")
    ap.add_argument("--sms", type=int, default=None, help="SMs to compile for (default: the GPU's, or 3)")
    ap.add_argument("--out", default=None, help="where the tape JSON goes (default: a temporary directory)")
    a = ap.parse_args(argv)
    sms = a.sms or (torch.cuda.get_device_properties(0).multi_processor_count if CUDA else 3)
    out = pathlib.Path(a.out or tempfile.mkdtemp(prefix="megatape-01-"))
    out.mkdir(parents=True, exist_ok=True)

    # %%
    # 1. Compile
    # ----------
    # ``compile_model`` lowers the config to tiles with their counters, orders them into per-SM
    # queues with a cost model (list scheduling), moves the plan's last microseconds into a pool
    # taken by atomic ticket at run time, encodes the tape and verifies it. A small KV length keeps
    # the tape VM fast below; the kernel reads the prefix length at run time, so one tape serves
    # every position up to ``max_seq``. The pool is the plan's last 60 us by default; a tiny layer
    # takes less than that altogether, so here it gets the last 10 us.
    cfg = ModelConfig.from_name(a.preset)
    small = cfg.d < 1024
    max_seq = 64 if small else 4224
    comp = compile_model(cfg, sms, max_seq=max_seq, pool_us=10.0 if small else None)
    prog, sched, tape = comp.prog, comp.sched, comp.tape
    print(f"== 1. compiled {cfg.name} (d={cfg.d}, ffn={cfg.ffn}, {cfg.layers} layer(s)) for {sms} SMs "
          f"in {comp.seconds:.2f} s")
    counts = collections.Counter(ins.NAME for ins in prog.instrs)
    print("instructions per opcode: " + ", ".join(f"{n} {counts[n]}" for n in REGISTRY if counts[n]))
    print(f"counters: {tape.n_counters}; queued {len(tape) - tape.pool_len}, pool {tape.pool_len}")
    lb = comp.model.lower_bound(prog)
    print(f"planned makespan {sched.makespan * 1e6:.2f} us vs bandwidth lower bound {lb * 1e6:.2f} us "
          f"(ratio {sched.makespan / lb:.3f})")
    print(comp.report)                               # what the verifier proved

    # %%
    # 2. Read the queues
    # ------------------
    # ``tape.listing()`` prints every SM's queue in order: slot, the instruction with its operands,
    # the counters it waits for (``wait name>=target``: producers per call) and the counter it
    # signals once its stores are visible. Here are the first instructions of two SMs and the pool.
    print("\n== 2. listing (first lines of sm 0, sm 1 and the pool)")
    section, shown = None, collections.Counter()
    for line in tape.listing().splitlines():
        if not line.startswith(" "):
            section = line
            if section.startswith(("sm 0:", "sm 1:", "pool:", "# tape")):
                print(line)
            continue
        if section.startswith(("sm 0:", "sm 1:", "pool:")) and shown[section] < 5:
            print(line)
            shown[section] += 1

    # %%
    # 3. Waits and signals
    # --------------------
    # ``decode(tape)`` gives each slot back as (sm, instruction, waits, signal). A counter's target
    # is the number of instructions that signal it, so the consumer of a counter runs once all of
    # its producers have finished (call ``e`` waits for ``target * e``: counters are never reset).
    dec = decode(tape)
    d = next(d for d in dec if len(d.waits) == 2) if any(len(d.waits) == 2 for d in dec) else \
        next(d for d in dec if d.waits)
    producers = collections.Counter(x.signal for x in dec)
    print(f"\n== 3. slot {d.slot} ({d.ins}) on {tape.where(d.sm)}")
    for c, t in d.waits:
        print(f"   waits for counter {tape.counters[c]} to reach {t} per call; "
              f"{producers[c]} instructions signal it")
    if d.signal >= 0:
        print(f"   then signals {tape.counters[d.signal]}")

    # %%
    # 4. The verifier
    # ---------------
    # The verifier proves the tape complete, race-free and deadlock-free under any interleaving.
    # Break one wait target and it names the instruction at fault.
    print("\n== 4. verifier")
    print("the compiled tape:", verify(tape, prog))
    broken = Tape.from_json(tape.to_json())
    broken.words[d.slot, 2] += 1                    # word 2: target of the first wait
    try:
        verify(broken, prog)
        print("the broken tape: accepted (unexpected)")
    except TapeError as e:
        print("the broken tape: rejected:", str(e).splitlines()[-1].strip()[:160])

    # %%
    # 5. Save and load
    # ----------------
    # A tape is JSON: the words, the queue offsets, counter names, the opcode table it was built
    # with, the config, tiling and max_seq. ``Tape.load`` refuses a file from another opcode table.
    path = out / f"{cfg.name}-{sms}sms.json"
    tape.save(path)
    back = Tape.load(path)
    same = torch.equal(back.words, tape.words) and torch.equal(back.offsets, tape.offsets)
    print(f"\n== 5. saved {path} ({path.stat().st_size:,} bytes); loaded back identical: {same}")

    # %%
    # 6. Run it in the tape VM
    # ------------------------
    # The VM executes each instruction's torch semantics in an order a real GPU could have chosen
    # (``seed`` picks a random valid interleaving of the SMs), so every interleaving must give the
    # reference's answer. The KV cache is prefilled up to ``prefill``; the step writes row ``prefill``.
    prefill = min(37, max_seq - 1)
    w = make_weights(cfg, seed=0)
    x = torch.randn(1, cfg.d, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = model_ref(w, make_kv_cache(cfg, max_seq, prefill, seed=1), cfg, x, prefill)
    print(f"\n== 6. tape VM, pos {prefill}")
    for seed in (0, 1, 2) if cfg.d < 1024 else (0,):
        got = run_tape(back, w, make_kv_cache(cfg, max_seq, prefill, seed=1), x, prefill, seed=seed)
        print(f"interleaving seed {seed}: rel err vs reference {rel_err(got, ref):.2e}")
    if CUDA:
        # the same tape in the real kernel
        from interp import build_layer, layer_step, teardown
        dev = torch.device("cuda")
        wd = make_weights(cfg, seed=0, device=dev)
        h = build_layer(wd, make_kv_cache(cfg, max_seq, prefill, seed=1, device=dev), cfg.to_dict(), max_seq,
                        tape=back)
        got = layer_step(h, x.to(dev), prefill)
        print(f"the kernel on {torch.cuda.get_device_name()}: rel err vs reference "
              f"{rel_err(got.cpu(), ref):.2e}")
        teardown(h)
    return 0


if __name__ == "__main__":
    sys.exit(main())
