"""What a launch of a persistent grid costs in CUDA-event time, with no work in it.
    python3 -m bench.probes.launch_gap_probe [launches]     (a GPU (H200); default 200)

Kernels that do nothing are launched back to back as `bench.baselines.time_step` launches decode steps
(each call between two events), one program an SM of the device (132 on the H200), 4 warps:

    smem0   : no shared memory
    smem128 : 128 KB of shared memory a program (a pipelined loop of 32 KB stages that runs no iteration),
              as the megakernel's ~132 KB, so that a program of the next launch cannot share an SM with
              one of this launch

Each program also spins 100 us of the GPU's clock, so that the host's launches (~12-20 us each through
Triton's launcher) queue ahead of the GPU as a step's do; the spin is subtracted (a row without it times
the host). Reports the median us a launch (what a step's events see) and the us a launch over one span of
all of them (what a stream of steps costs a step). Run 247: ~4.3 and ~2.5 us; the megakernel's own launch,
start and end come from `bench-decoder --profile` (`interp.profile.kernel_span`; run 251: ~6 us of launch).
"""
from __future__ import annotations

import os
import sys

import torch
import triton
import triton.language as tl

from bench.baselines import time_step
from interp.sync import clock_ns

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
SPIN_US = 100       # each program's spin: longer than a host launch, so the GPU's queue never drains
MODES = {"smem0": 1, "smem128": 5}      # the loop's stages: (stages - 1) x 32 KB of shared memory


@triton.jit
def _empty(buf, out, n, spin_ns, STAGES: tl.constexpr, INTERP: tl.constexpr):
    """``n`` iterations (0 when timed) of a pipelined [32, 512] bf16 load loop: its shared memory is
    allocated whatever ``n`` is; then each program spins ``spin_ns`` of the GPU's clock from its start, so
    that the host's launches run ahead of the GPU's (a launch through Triton's launcher takes the host
    ~12-20 us: run 247). Writes one value a program."""
    t0 = clock_ns(INTERP)
    offs = tl.arange(0, 32)[:, None] * 512 + tl.arange(0, 512)[None, :]
    acc = tl.zeros([32, 512], dtype=tl.float32)
    for i in tl.range(0, n, num_stages=STAGES):
        acc += tl.load(buf + i * 16384 + offs).to(tl.float32)
    t = clock_ns(INTERP)
    while t - t0 < spin_ns:
        t = clock_ns(INTERP)
    tl.store(out + tl.program_id(0), tl.sum(tl.sum(acc, axis=1), axis=0))


def launch(mode: str, programs: int, buf, out, n: int = 0, spin_ns: int = 0):
    return _empty[(programs,)](buf, out, n, spin_ns, STAGES=MODES[mode], INTERP=INTERP, num_warps=4)


def shared_bytes(mode: str, programs: int, buf, out) -> int:
    """The compiled kernel's shared memory a program."""
    return int(launch(mode, programs, buf, out).metadata.shared)


def time_mode(mode: str, programs: int, launches: int, buf, out, spin_ns: int) -> tuple[float, float]:
    """(median us between a launch's two events, us a launch over one span of all of them), each less
    the programs' spin."""
    each = time_step(lambda: launch(mode, programs, buf, out, spin_ns=spin_ns), [()] * launches, warmup=10,
                     device="cuda")["us_event"]
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(launches):
        launch(mode, programs, buf, out, spin_ns=spin_ns)
    e.record()
    torch.cuda.synchronize()
    return each - spin_ns / 1e3, s.elapsed_time(e) * 1e3 / launches - spin_ns / 1e3


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        launches = int(argv[0]) if argv else 200
        if launches < 1:
            raise ValueError
    except ValueError:
        print(f"launch_gap_probe: launches must be a positive int, got {argv[0]!r}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("launch_gap_probe: needs a GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    programs = torch.cuda.get_device_properties(dev).multi_processor_count
    buf = torch.zeros(8 * 16384, dtype=torch.bfloat16, device=dev)
    out = torch.zeros(programs, dtype=torch.float32, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}: {programs} programs of 4 warps, {launches} launches a mode; us a "
          f"launch less each program's spin of {SPIN_US} us (0 spin: the host's launch rate)")
    print("| mode | shared bytes a program | spin us | us a launch (its own events, median) | us a launch (one span) |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        smem = shared_bytes(mode, programs, buf, out)
        for spin in (0, SPIN_US):
            each, span = time_mode(mode, programs, launches, buf, out, spin * 1000)
            print(f"| {mode} | {smem} | {spin} | {each:.2f} | {span:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
