"""Does an SM pay for instruction fetch when it moves between large code bodies, as the interpreter
does between opcodes?
    python3 -m bench.probes.icache_probe [fmas-a-block ...]   (a GPU (H200); default 256 512 1024 2048)
    python3 -m bench.probes.icache_probe --stream [fmas ...]  (one program visits while 131 stream the HBM)
    python3 -m bench.probes.icache_probe --compile [fmas]      (no GPU: the kernel's PTX facts, as JSON)

The 1B decoder's kernel is ~123 KB of SASS (7888 instructions, sm_90a); each SM runs ~6 opcodes a
layer, each a different part of it, and a kernel change that only added code cost ~2% (bench/NOTES.md
v107). This probe measures the cost of code that is not in the SM's instruction caches. One program an
SM (4 warps, all co-resident) visits BLOCKS blocks of straight-line code in a given order; a block is
one inline-asm chain of F dependent `fma.rn.f32` (F SASS instructions, 16 bytes each), so its time
with its code cached is F times the FMA latency. Orders: `hot` (block 0 every visit) and `rotK`
(blocks 0..K-1 in turn: K x 16F bytes of code in rotation). Per order, ns a visit (median over the
programs of (end - start) / visits, %globaltimer); (rotK - hot) / (16F / 1024) is what a KB of code
not in the caches costs an SM when it runs it once.

Runs 193-194 measured that with the code in the L2 (nothing else ran). In the decoder each layer streams
~120 MB of weights through the ~50 MB L2 at normal priority (Triton 3.6 drops their evict_first: bench/
NOTES.md, session 36), so code last fetched a layer ago may come from the HBM. With ``--stream`` one program
visits while the other 131 each stream their part of a 1 GB buffer, over and over, until it is done (at most
``STREAM_PASSES`` passes of 1 MB each): the visitor's code is evicted from the L2 between its visits, and the
HBM is as loaded as in the decoder's GATE_UP stage.
"""
from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import statistics
import struct
import sys
import tempfile

BLOCKS = 16
ROTATIONS = (2, 4, 8, 10, 12, 14, 16)
VISITS = 512
NT = 128                    # one fp32 a thread, 4 warps
STREAMERS = 131             # --stream: programs streaming beside the one visitor (one an SM of an H200)
STREAM_WORDS = 256 << 20    # --stream: the buffer they stream, int32 words (1 GB)
PASS_WORDS = 256 << 10      # ... a streamer's pass: 1 MB, then it looks whether the visitor is done
STREAM_PASSES = 4096        # ... at most this many passes (4 GB a streamer): the wait is bounded


def _f32(v: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def block_asm(k: int, fmas: int) -> str:
    """Block ``k``: ``fmas`` dependent FMAs on one register (distinct constants a block)."""
    a, b = _f32(1.0 + (k + 1) * 2.0 ** -20), _f32(-(k + 1) * 2.0 ** -12)
    lines = [f"fma.rn.f32 $0, $1, {a}, {b};"] + [f"fma.rn.f32 $0, $0, {a}, {b};"] * (fmas - 1)
    return "{ " + " ".join(lines) + " }"


def kernel_source(fmas: int) -> str:
    """The probe kernel's source: a loop over visits, a branch a block."""
    w = []
    w.append("import triton\nimport triton.language as tl\nfrom interp.sync import clock_ns\n\n")
    for k in range(BLOCKS):
        w.append(f"@triton.jit\ndef _b{k}(x):\n    return tl.inline_asm_elementwise({block_asm(k, fmas)!r}, "
                 f"'=r,r', [x], dtype=tl.float32, is_pure=False, pack=1)\n\n")
    w.append("@triton.jit\ndef icache_kernel(seq_ptr, x_ptr, out_ptr, big_ptr, done_ptr, VISITS: tl.constexpr, "
             "NT: tl.constexpr, NVIS: tl.constexpr, BIG: tl.constexpr, PASS: tl.constexpr, PASSES: tl.constexpr):\n")
    w.append("    pid = tl.program_id(0)\n    if pid < NVIS:\n")
    w.append("        x = tl.load(x_ptr + tl.arange(0, NT))\n")
    w.append("        t0 = clock_ns(False)\n        for it in range(VISITS):\n            sel = tl.load(seq_ptr + it)\n")
    for k in range(BLOCKS):
        w.append(f"            {'if' if k == 0 else 'elif'} sel == {k}:\n                x = _b{k}(x)\n")
    w.append("        t1 = clock_ns(False)\n        tl.store(out_ptr + pid, t1 - t0)\n")
    w.append("        tl.store(x_ptr + (pid + 1) * NT + tl.arange(0, NT), x)\n")
    w.append("        tl.atomic_add(done_ptr, 1, sem='release', scope='gpu')\n")
    # the streamers (programs NVIS...): their part of the buffer, a pass of PASS words at a time, until every
    # visitor is done or PASSES passes; the passes they made go to done_ptr + 1 + their index (the sink too)
    w.append("    else:\n        offs = tl.arange(0, 4096)\n        acc = tl.zeros([4096], dtype=tl.int32)\n")
    w.append("        start = (pid - NVIS).to(tl.int64) * PASS * 8\n        n = 0\n")
    w.append("        while (tl.atomic_add(done_ptr, 0, sem='relaxed', scope='gpu') < NVIS) & (n < PASSES):\n")
    w.append("            base = tl.multiple_of((start + n.to(tl.int64) * PASS) % (BIG - PASS), 4096)\n")
    w.append("            for i in tl.range(0, PASS, 8192, loop_unroll_factor=1):\n")
    w.append("                a = tl.load(big_ptr + base + i + offs, cache_modifier='.cg')\n")
    w.append("                b = tl.load(big_ptr + base + i + 4096 + offs, cache_modifier='.cg')\n")
    w.append("                acc = acc ^ a ^ b\n")
    w.append("            n += 1\n")
    w.append("        tl.store(done_ptr + 1 + pid - NVIS, n + (tl.sum(acc, 0) == 12345).to(tl.int32))\n")
    return "".join(w)


def load_kernel(fmas: int, folder: str):
    """The kernel of ``fmas`` FMAs a block (Triton's JIT reads a kernel from its source file)."""
    path = pathlib.Path(folder) / f"icache_kernel_{fmas}.py"
    path.write_text(kernel_source(fmas))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.icache_kernel


def orders() -> dict:
    """Each order's block sequence."""
    seqs = {"hot": [0] * VISITS}
    for k in ROTATIONS:
        seqs[f"rot{k}"] = [i % k for i in range(VISITS)]
    return seqs


def compile_sm90(fmas: int) -> dict:
    """The kernel compiled for sm_90 (no GPU): its FMAs in the PTX and its SASS size in bytes."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    if os.environ.get("TRITON_INTERPRET") not in (None, "", "0"):
        raise RuntimeError("compile_sm90: unset TRITON_INTERPRET (inline asm is compiled, never interpreted)")
    with tempfile.TemporaryDirectory() as tmp:
        k = load_kernel(fmas, tmp)
        sig = {"seq_ptr": "*i32", "x_ptr": "*fp32", "out_ptr": "*i64", "big_ptr": "*i32", "done_ptr": "*i32",
               "VISITS": "constexpr", "NT": "constexpr", "NVIS": "constexpr", "BIG": "constexpr", "PASS": "constexpr",
               "PASSES": "constexpr"}
        src = ASTSource(fn=k, signature=sig, constexprs={(5,): VISITS, (6,): NT, (7,): 1, (8,): STREAM_WORDS,
                                                         (9,): PASS_WORDS, (10,): STREAM_PASSES},
                        # the pointers 16-byte aligned, as Triton's JIT specializes them at the launch
                        attrs={(i,): [["tt.divisibility", 16]] for i, t in enumerate(sig.values()) if t[0] == "*"})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = ck.asm["ptx"]
    return {"fma": ptx.count("fma.rn.f32"), "fmas": fmas, "blocks": BLOCKS,
            "streamer_loads": ptx.count("ld.global.cg.v4"), "release": ptx.count("atom.global.gpu.release"),
            "relaxed_polls": ptx.count("ld.global.gpu.relaxed")}


def run(fmas_list, programs=(1, 132), stream: bool = False) -> None:
    """ns a visit per order, for each block size and number of visiting programs; ``stream``: one visitor
    beside ``STREAMERS`` programs streaming the HBM (``programs`` is then ignored)."""
    import torch
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name(dev)}; {BLOCKS} blocks, {VISITS} visits, 4 warps a program"
          + (f"; beside {STREAMERS} programs streaming {STREAM_WORDS * 4 >> 20} MB over and over" if stream else ""))
    if stream:
        programs = (1,)
    big = torch.ones(STREAM_WORDS if stream else 1, dtype=torch.int32, device=dev)
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmas in fmas_list:
            k = load_kernel(fmas, tmp)
            kb = fmas * 16 / 1024
            for n in programs:
                x = torch.ones((n + 1) * NT, device=dev)
                out = torch.zeros(n, dtype=torch.int64, device=dev)
                streamers = STREAMERS if stream else 0
                done = torch.zeros(1 + streamers, dtype=torch.int32, device=dev)
                row = {}
                for name, seq in orders().items():
                    s = torch.tensor(seq, dtype=torch.int32, device=dev)
                    meds = []
                    for rep in range(6):          # the first compiles and warms
                        done.zero_()
                        k[(n + streamers,)](s, x, out, big, done, VISITS=VISITS, NT=NT, NVIS=n, BIG=big.numel(),
                                            PASS=PASS_WORDS, PASSES=STREAM_PASSES, num_warps=4)
                        torch.cuda.synchronize()
                        passes = done[1:].tolist()
                        if stream and (min(passes) < 2 or max(passes) >= STREAM_PASSES):
                            raise RuntimeError(f"the streamers made {min(passes)}..{max(passes)} passes: they did not "
                                               "stream through the visits")
                        if rep:
                            meds.append(statistics.median(out.tolist()) / VISITS)
                    row[name] = statistics.median(meds)
                    if not torch.isfinite(x).all():
                        raise RuntimeError("the FMA chains overflowed")
                res[(fmas, n)] = row
                cells = "  ".join(f"{nm} {v:7.1f}" for nm, v in row.items())
                cold = "  ".join(f"{nm} {(v - row['hot']) / kb:6.1f}" for nm, v in row.items() if nm != "hot")
                print(f"F={fmas:5d} ({kb:5.1f} KB a block), {n:3d} programs: ns a visit: {cells}", flush=True)
                print(f"      extra ns a KB of block code: {cold}", flush=True)
    out_dir = os.environ.get("OUT")
    if out_dir:
        pathlib.Path(out_dir, "icache_probe" + ("_stream" if stream else "") + ".json").write_text(json.dumps(
            [{"fmas": f, "programs": n, **r} for (f, n), r in res.items()], indent=1))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--compile"]:
        print(json.dumps(compile_sm90(int(args[1]) if len(args) > 1 else 64)))
        return 0
    stream = args[:1] == ["--stream"]
    if stream:
        args = args[1:]
    bad = [a for a in args if not a.isdigit() or int(a) < 1]
    if bad:
        print(f"{bad[0]!r}: FMAs a block is an integer >= 1 (usage: python3 -m bench.probes.icache_probe "
              "[--stream] [fmas...] | --compile [fmas])", file=sys.stderr)
        return 2
    run(tuple(int(a) for a in args) or (256, 512, 1024, 2048), stream=stream)
    return 0


if __name__ == "__main__":
    sys.exit(main())
