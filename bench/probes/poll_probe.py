"""Does a counter poll issued after a tile's weight prologue wait for the prologue to land, and does it
matter whether the prologue is cp.async (16 bytes a thread per request) or TMA (one bulk request a box)?
    python3 -m bench.probes.poll_probe [programs...]     (a GPU (H200); default 96 128 132)
    python3 -m bench.probes.poll_probe --compile          (no GPU: the four modes compiled for sm_90)

bench/NOTES.md v97: GATE_UP's in-loop wait (the prologue's cp.async copies issued, then the poll) met
its counter ~3.7 us after the counter was complete, about the time 128 SMs' 128 KB prologues take at the
copy bandwidth. This probe isolates that. Each program (one per SM, all co-resident) issues a prologue
of NBLK blocks of 32 KB of its own weights into shared memory, then polls a counter that is already at
its target (one acquire load, the megakernel's poll), then waits for the prologue to land:

    none  : no prologue (the poll's own latency)
    tma   : NBLK TMA copies of one [64, 256] bf16 box each, on one mbarrier per block
    cpasync : the same bytes as cp.async copies (8 chunks of [8, 256] a block, 16 bytes a thread a request)
    cpasync_ws : the same cp.async copies issued by a 1-warp loader partition (`gl.warp_specialize`); the
            4 consumer warps poll once the loader has issued them (an mbarrier between the two): is
            the poll's wait a matter of its own warp's copies or of the SM's?

Per program, in ns of %globaltimer: the prologue's issue, the poll (issue to its value in hand) and the
landing (issue to every block in shared memory; `cpasync_ws`: its issue is not timed, and its landing
counts from the loader's start). Medians and maxima over the programs and the calls;
the weights are rotated through enough copies (>= 200 MB, four times the L2) that a call's blocks come
from HBM, not from the L2's copy of an earlier call.
"""
from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from interp.sync import clock_ns

ROWS_, COLS_ = 64, 256                  # a block: 64 x 256 bf16 = 32 KB, one TMA box
NBLK_ = 4                               # the prologue: 4 blocks = 128 KB, GATE_UP's at stages=5
MODES = ("none", "tma", "cpasync", "cpasync_ws")
#: the poll instruction (``POLL``): the megakernel's acquire (Triton lowers an atomic add of 0 to an acquire
#: load: LDG.E.STRONG.GPU + CCTL.IVALL on sm_90), and inline-PTX alternatives, each made by every thread
POLLS = ("acquire", "relaxed", "volatile", "atom_or", "relaxed_fence")
_POLL_ASM = {1: "ld.relaxed.gpu.global.b32 $0, [$1];", 2: "ld.volatile.global.b32 $0, [$1];",
             3: "atom.relaxed.gpu.global.or.b32 $0, [$1], 0;",
             4: "ld.relaxed.gpu.global.b32 $0, [$1];\n\tfence.acq_rel.gpu;"}
BR, BC, NBLK = gl.constexpr(ROWS_), gl.constexpr(COLS_), gl.constexpr(NBLK_)
CH = gl.constexpr(8)                    # cp.async: rows a chunk (8 x 256 = 2048 elements, 16 a thread)
SMEM = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)


@triton.jit
def _poll_asm(ptr, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, "=r,l", [ptr.to(tl.int64)], dtype=tl.int32, is_pure=False, pack=1)


@gluon.jit
def _timed_poll(flag_ptr, POLL: gl.constexpr = 0, ASM: gl.constexpr = ""):
    # one poll (POLL 0: the megakernel's acquire; else the inline PTX ASM, POLLS), between two clock
    # reads: the second once its value is in hand
    t1 = clock_ns(False)
    if POLL == 0:
        seen = gl.atomic_add(flag_ptr, 0, sem="acquire", scope="gpu")
    else:
        seen = _poll_asm(flag_ptr, ASM)
    t2 = t1
    if seen >= 0:
        t2 = clock_ns(False)
    return t1, t2, seen


@gluon.jit
def poll_kernel(w_desc, w_ptr, flag_ptr, out_ptr, MODE: gl.constexpr, POLL: gl.constexpr = 0,
                ASM: gl.constexpr = ""):
    pid = gl.program_id(0)
    bufs = gl.allocate_shared_memory(gl.bfloat16, [NBLK, BR, BC], SMEM)
    bars = gl.allocate_shared_memory(gl.int64, [NBLK, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NBLK):
        mbarrier.init(bars.index(i), count=1)
    fence_async_shared()
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
    row0 = pid * (NBLK * BR)
    t0 = clock_ns(False)
    if MODE == 1:
        for b in gl.static_range(NBLK):
            mbarrier.expect(bars.index(b), BR * BC * 2)
            tma.async_copy_global_to_shared(w_desc, [row0 + b * BR, 0], bars.index(b), bufs.index(b))
    elif MODE == 2:
        r = gl.arange(0, CH, layout=gl.SliceLayout(1, L))
        c = gl.arange(0, BC, layout=gl.SliceLayout(0, L))
        for b in gl.static_range(NBLK):
            for k in gl.static_range(BR // CH):
                p = w_ptr + (row0 + b * BR + k * CH + r)[:, None].to(gl.int64) * BC + c[None, :]
                async_copy.async_copy_global_to_shared(bufs.index(b).slice(k * CH, CH), p)
            async_copy.commit_group()
    t1, t2, seen = _timed_poll(flag_ptr, POLL, ASM)
    if MODE == 1:
        for b in gl.static_range(NBLK):
            mbarrier.wait(bars.index(b), 0)
    elif MODE == 2:
        async_copy.wait_group(0)
    t3 = clock_ns(False)
    # one value of the landed data, so the copies are not dead
    v = bufs.index(NBLK - 1).slice(BR - CH, CH).load(L)
    o = out_ptr + pid * 4
    gl.store(o, t1 - t0)
    gl.store(o + 1, t2 - t1)
    gl.store(o + 2, t3 - t1)
    gl.store(o + 3, gl.sum(gl.sum(v.to(gl.float32), 1), 0).to(gl.int64) + seen.to(gl.int64))
    for i in gl.static_range(NBLK):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def _ws_loader(w_ptr, bufs, issued, out_ptr, row0):
    # one warp: the prologue as cp.async copies of one 256-element row (16 bytes a lane) each, then an
    # arrive on `issued`; then it waits for its copies and records when they landed (out word 2)
    L1: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [1, 1], [1, 0])
    c = gl.arange(0, BC, layout=gl.SliceLayout(0, L1))[None, :]
    t0 = clock_ns(False)
    for b in gl.static_range(NBLK):
        for r in range(BR):
            async_copy.async_copy_global_to_shared(bufs.index(b * BR + r), w_ptr + (row0 + b * BR + r).to(gl.int64) * BC + c)
    async_copy.commit_group()
    mbarrier.arrive(issued)
    async_copy.wait_group(0)
    t3 = clock_ns(False)
    gl.store(out_ptr + 2, t3 - t0)


@gluon.jit
def _ws_poller(flag_ptr, issued, out_ptr):
    # the consumer warps: once the loader has issued its copies, one acquire poll, timed
    mbarrier.wait(issued, 0)
    t1, t2, seen = _timed_poll(flag_ptr, 0, "")
    gl.store(out_ptr + 1, t2 - t1)
    gl.store(out_ptr + 3, seen.to(gl.int64))


@gluon.jit
def poll_ws_kernel(w_ptr, flag_ptr, out_ptr):
    pid = gl.program_id(0)
    bufs = gl.allocate_shared_memory(gl.bfloat16, [NBLK * BR, 1, BC], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    issued = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(issued, count=1)
    fence_async_shared()
    o = out_ptr + pid * 4
    gl.store(o, 0)
    gl.warp_specialize([(_ws_poller, (flag_ptr, issued, o)), (_ws_loader, (w_ptr, bufs, issued, o, pid * (NBLK * BR)))],
                       [1], [64])
    mbarrier.invalidate(issued)


def run(programs=(96, 128, 132), calls: int = 20, device="cuda", polls=None) -> dict:
    """Per program count, each mode's issue / poll / landed times (us, median and max). ``polls``: indices
    into POLLS; then modes none, cpasync and tma are timed with each of those poll instructions in turn
    (cpasync_ws, whose poll is the acquire, is left out), keys ``mode/poll@programs``."""
    dev = torch.device(device)
    nsm = torch.cuda.get_device_properties(dev).multi_processor_count
    rows = max(programs) * NBLK_ * ROWS_
    copies = max(3, -(-200_000_000 // (rows * COLS_ * 2)))
    ws = [torch.randn(rows, COLS_, device=dev).to(torch.bfloat16) for _ in range(copies)]
    descs = [TensorDescriptor.from_tensor(w, [ROWS_, COLS_], SMEM) for w in ws]
    flag = torch.ones(1, dtype=torch.int32, device=dev)
    if polls is None:
        cases = [(m, 0) for m in (0, 1, 2, 3, 0)]
    else:
        cases = [(m, q) for m in (0, 2, 1) for q in polls] + [(2, polls[0])]
    res = {}
    for p in programs:
        if p > nsm:
            raise ValueError(f"{p} programs: more than the {nsm} SMs (one co-resident program each)")
        for mode, poll in cases:
            out = torch.zeros(p, 4, dtype=torch.int64, device=dev)
            samples = []
            for c in range(calls + 2):
                if mode == 3:
                    poll_ws_kernel[(p,)](ws[c % copies], flag, out, num_warps=4)
                else:
                    poll_kernel[(p,)](descs[c % copies], ws[c % copies], flag, out, MODE=mode, POLL=poll,
                                      ASM=_POLL_ASM.get(poll, ""), num_warps=4)
                torch.cuda.synchronize()
                if c >= 2:
                    samples.append(out[:, :3].cpu().clone())
            t = torch.stack(samples).double() / 1e3          # [calls, p, 3] us
            key = f"{MODES[mode]}@{p}" if polls is None else f"{MODES[mode]}/{POLLS[poll]}@{p}"
            row = {q: (statistics.median(t[:, :, i].flatten().tolist()), float(t[:, :, i].max()))
                   for i, q in enumerate(("issue", "poll", "landed"))}
            res.setdefault(key, []).append(row)
            print(f"{key:>24s}: " + "  ".join(f"{q} med {m:6.2f} max {x:6.2f} us" for q, (m, x) in row.items()),
                  flush=True)
    return res


def compile_sm90() -> dict:
    """The four modes compiled for sm_90 (no GPU): shared memory, warps, and the prologue's copy
    instructions (cp.async, TMA) in the PTX."""
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        raise RuntimeError("unset TRITON_INTERPRET (Gluon kernels are compiled, never interpreted)")
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type
    desc = TensorDescriptor.from_tensor(torch.zeros(ROWS_ * 4, COLS_, dtype=torch.bfloat16), [ROWS_, COLS_], SMEM)
    sig = {"w_desc": mangle_type(desc), "w_ptr": "*bf16", "flag_ptr": "*i32", "out_ptr": "*i64", "MODE": "constexpr",
           "POLL": "constexpr", "ASM": "constexpr"}

    def facts(fn, **cx):
        names = fn.arg_names
        src = GluonASTSource(fn=fn, signature={n: sig[n] for n in names},
                             constexprs={(names.index(k),): v for k, v in cx.items()},
                             attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if sig[n][0] == "*"})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ptx = ck.asm["ptx"]
        return {"shared": ck.metadata.shared, "num_warps": ck.metadata.num_warps,
                "cp.async": ptx.count("cp.async.cg") + ptx.count("cp.async.ca"),
                "tma": ptx.count("cp.async.bulk.tensor"), "ptx": ptx}
    out = {**{MODES[m]: facts(poll_kernel, MODE=m, POLL=0, ASM="") for m in range(3)}, MODES[3]: facts(poll_ws_kernel)}
    for q in range(1, len(POLLS)):
        out[f"cpasync/{POLLS[q]}"] = facts(poll_kernel, MODE=2, POLL=q, ASM=_POLL_ASM[q])
    for v in out.values():
        # the poll's instructions, as PTX spells them: the acquire load, or the inline asm's
        ptx = v.pop("ptx")
        v["poll"] = sorted({k for k in ("ld.global.gpu.acquire", *(a.split(" $")[0] for a in _POLL_ASM.values()),
                                        "fence.acq_rel.gpu") if k in ptx})
    return out


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--compile"]:
        print(json.dumps(compile_sm90()))
        return 0
    polls = None
    if "--polls" in args:
        i = args.index("--polls")
        spec = args[i + 1] if i + 1 < len(args) else ""
        names = [n for n in spec.split(",") if n]
        unknown = [n for n in names if n not in POLLS]
        if not names or unknown:
            print(f"--polls {spec!r}: expected a comma-separated list of {', '.join(POLLS)}", file=sys.stderr)
            return 2
        polls = [POLLS.index(n) for n in names]
        args = args[:i] + args[i + 2:]
    bad = [a for a in args if not a.isdigit() or int(a) < 1]
    if bad:
        print(f"{bad[0]!r}: a program count is an integer >= 1 (usage: python3 -m bench.probes.poll_probe "
              "[programs...] [--polls NAME,...] | --compile)", file=sys.stderr)
        return 2
    run(tuple(int(a) for a in args) or (96, 128, 132), polls=polls)
    return 0


if __name__ == "__main__":
    sys.exit(main())
