"""Does an SM pay for instruction fetch when it moves between large code bodies, as the interpreter
does between opcodes?
    python3 -m bench.probes.icache_probe [fmas-a-block ...]   (a GPU (H200); default 256 512 1024 2048)
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
    w.append("@triton.jit\ndef icache_kernel(seq_ptr, x_ptr, out_ptr, VISITS: tl.constexpr, NT: tl.constexpr):\n")
    w.append("    pid = tl.program_id(0)\n    x = tl.load(x_ptr + tl.arange(0, NT))\n")
    w.append("    t0 = clock_ns(False)\n    for it in range(VISITS):\n        sel = tl.load(seq_ptr + it)\n")
    for k in range(BLOCKS):
        w.append(f"        {'if' if k == 0 else 'elif'} sel == {k}:\n            x = _b{k}(x)\n")
    w.append("    t1 = clock_ns(False)\n    tl.store(out_ptr + pid, t1 - t0)\n")
    w.append("    tl.store(x_ptr + (pid + 1) * NT + tl.arange(0, NT), x)\n")
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
        sig = {"seq_ptr": "*i32", "x_ptr": "*fp32", "out_ptr": "*i64", "VISITS": "constexpr", "NT": "constexpr"}
        src = ASTSource(fn=k, signature=sig, constexprs={(3,): VISITS, (4,): NT})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
    ptx = ck.asm["ptx"]
    return {"fma": ptx.count("fma.rn.f32"), "fmas": fmas, "blocks": BLOCKS}


def run(fmas_list, programs=(1, 132)) -> None:
    import torch
    dev = torch.device("cuda")
    print(f"card: {torch.cuda.get_device_name(dev)}; {BLOCKS} blocks, {VISITS} visits, 4 warps a program")
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for fmas in fmas_list:
            k = load_kernel(fmas, tmp)
            kb = fmas * 16 / 1024
            for n in programs:
                x = torch.ones((n + 1) * NT, device=dev)
                out = torch.zeros(n, dtype=torch.int64, device=dev)
                row = {}
                for name, seq in orders().items():
                    s = torch.tensor(seq, dtype=torch.int32, device=dev)
                    k[(n,)](s, x, out, VISITS=VISITS, NT=NT, num_warps=4)      # compile, warm
                    torch.cuda.synchronize()
                    meds = []
                    for _ in range(5):
                        k[(n,)](s, x, out, VISITS=VISITS, NT=NT, num_warps=4)
                        torch.cuda.synchronize()
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
        pathlib.Path(out_dir, "icache_probe.json").write_text(json.dumps(
            [{"fmas": f, "programs": n, **r} for (f, n), r in res.items()], indent=1))


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--compile"]:
        print(json.dumps(compile_sm90(int(args[1]) if len(args) > 1 else 64)))
        return 0
    bad = [a for a in args if not a.isdigit() or int(a) < 1]
    if bad:
        print(f"{bad[0]!r}: FMAs a block is an integer >= 1 (usage: python3 -m bench.probes.icache_probe "
              "[fmas...] | --compile [fmas])", file=sys.stderr)
        return 2
    run(tuple(int(a) for a in args) or (256, 512, 1024, 2048))
    return 0


if __name__ == "__main__":
    sys.exit(main())
