"""The interpreter kernels the benches build compile for the H200 (sm_90) on a machine without a
GPU, within its shared memory.

The CPU tests run the kernel through the Triton interpreter, which executes only the branches a
tape takes: a device function that does not compile in a branch no CPU tape reaches (a layer kernel
holds every opcode's branch, the LM head's included) only fails on the GPU. This compiles each
default kernel to a cubin with Triton's bundled toolchain (``GPUTarget("cuda", 90, 32)``, the launch
options of ``interp.runtime``), from the tape ``compile_model`` makes for it, and checks that its
shared memory fits an H200 SM (227 KB per block). The compiles run in a process of their own without
``TRITON_INTERPRET`` (under it, ``@triton.jit`` functions are interpreted functions, which the
compiler cannot take): one process for every case the session selected (one import of torch, one tape a
model shared by its variants), each case's result or error reported to its own test.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench.ptx_diff import triton_tool     # Triton's bundled CUDA tools (ptxas, nvdisasm, cuobjdump)

#: the kernel's runtime parameters before the model's buffers (interp/codegen.py FIXED_PARAMS,
#: SCALARS, PER_CALL_POINTERS) and their types as runtime.launch passes them
_PARAM_TYPES = {"tape_ptr": "*i32", "qoff_ptr": "*i32", "cnt_ptr": "*i32", "status_ptr": "*i32", "prof_ptr": "*i64",
                "ptab_ptr": "*i64", "ctl_ptr": "*i32", "spin_limit": "i32", "pos_arg": "i32", "x_ptr": "*bf16",
                "out_ptr": "*bf16"}

# (preset, max_seq, what): the kernels the benches and the GPU tests build
CASES = [
    ("llama70b-layer", 4224, "layer"),            # the column loop
    # a layer kernel on the row loop (d <= 2048): slow (the 1B decoder below compiles the row loop's opcodes; the
    # suite's 300 s, s45)
    pytest.param("small-gqa4", 256, "layer", marks=pytest.mark.slow),
    ("llama3.2-1b", 1152, "decoder"),             # row loop, folded residual, LM head, ARGMAX
    ("llama3.2-1b", 1152, "sampling"),            # ... SAMPLE instead of ARGMAX
    pytest.param("llama3.2-1b", 1152, "profile", marks=pytest.mark.slow),   # ... the profiling build (globaltimer)
    ("llama3.1-8b", 1152, "decoder"),             # the column loop, whole model
    ("llama70b-layer", 4224, "tp-layer"),         # tensor parallel (rank 1 of 2): TP_PUSH / TP_REDUCE, peer signals
    pytest.param("llama3.2-1b", 1152, "tp-decoder", marks=pytest.mark.slow),   # ... the whole model: TP_ARGMAX too
    ("llama3.2-1b", 1152, "rows16"),              # many rows (issue 50): the decode bucket, tl.dot M 32 x N 16
    ("llama3.2-1b", 1152, "rows32"),              # ... the other decode bucket (a row's bits the same in both)
    pytest.param("llama3.2-1b", 1152, "rows64", marks=pytest.mark.slow),    # ... between: LM head tiles of 32
    pytest.param("llama3.2-1b", 1152, "rows128", marks=pytest.mark.slow),   # ... the prefill bucket, N 128
    pytest.param("llama3.1-8b", 1152, "rows512", marks=pytest.mark.slow),   # ... two column blocks of 256
    pytest.param("llama3.2-1b", 1152, "rows1024", marks=pytest.mark.slow),  # ... the largest: four
    pytest.param("llama3.1-8b", 1152, "rows1024", marks=pytest.mark.slow),  # ... O / down / residual tiles of 128
    pytest.param("llama3.1-8b", 1152, "rows16", marks=pytest.mark.slow),    # ... hd 128, the 8B's shapes
    pytest.param("llama3.1-8b", 1152, "rows32", marks=pytest.mark.slow),
]

#: an H200 SM's instruction cache (bench/probes/icache_probe.py, runs 193-194: code in rotation up to
#: 128 KB costs ~4-12 ns a KB, 160 KB and more ~67 ns a KB); the greedy kernels the benches time stay
#: under it (the 1B decoder's was 126,208 bytes in session 24)
ICACHE_BYTES = 128 * 1024
CODE_LIMITED = ("layer", "decoder", "l2first")


def compile_sm90(tape, profile: bool = False):
    """The kernel of ``tape`` as interp.runtime builds it on a GPU (``make_kernel``), compiled for sm_90 (in a process
    without ``TRITON_INTERPRET``)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from interp.runtime import make_kernel
    lay = tape.lay
    k, cx = make_kernel(lay, tape.classes(), interp=False, profile=profile)
    sig = {n: ("constexpr" if n in cx else _PARAM_TYPES[n]) for n in k.arg_names}
    src = ASTSource(fn=k, signature=sig,
                    constexprs={(k.arg_names.index(n),): v for n, v in cx.items() if n in k.arg_names},
                    attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if sig[n][0] == "*"})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": lay.tiling.num_warps, "num_stages": 1})


def code_bytes(cubin: bytes) -> int:
    """Bytes of SASS in a cubin: the sizes of its ``.text.*`` sections (ELF64 section headers)."""
    import struct
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    heads = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names = heads[shstrndx][4]

    def name(h):
        return cubin[names + h[0]:cubin.index(b"\0", names + h[0])]
    return sum(h[5] for h in heads if name(h).startswith(b".text"))


def _tape(preset: str, max_seq: int, what: str, cache: dict):
    from opcodes import PRESETS
    from schedule import compile_model
    from schedule.decoder_program import decoder_lowering
    cfg = PRESETS[preset]
    key = (preset, max_seq, "decoder" if what == "profile" else what)     # the profiling build: the decoder's tape
    if key in cache:
        return cache[key]
    kw = {"lowering": decoder_lowering(sample=True)} if what == "sampling" else {}
    if what.startswith("rows"):
        from opcodes.rows import rows_tiling
        from schedule.rows_program import rows_lowering
        R = int(what[4:])
        tape = compile_model(cfg, 132, max_seq=max_seq, tiling=rows_tiling(cfg, R, max_seq),
                             lowering=rows_lowering(R, 4)).tape
    elif what.startswith("tp-"):      # rank 1's tape (its kernel: the peer pointers, sys-scope peer signals / waits)
        tape = compile_model(cfg, 132, max_seq=max_seq, decoder=(what == "tp-decoder"), tp=2).tapes[1]
    else:
        tape = compile_model(cfg, 132, max_seq=max_seq, decoder=(what != "layer"), **kw).tape
    cache[key] = tape
    return tape


def _main(cases: list[str]) -> None:
    """Compile each ``preset:max_seq:what`` case; print one JSON line a case: its numbers, or its error."""
    import traceback
    cache: dict = {}
    for case in cases:
        preset, max_seq, what = case.split(":")
        try:
            ck = compile_sm90(_tape(preset, int(max_seq), what, cache), profile=(what == "profile"))
            cubin = ck.asm.get("cubin", b"")
            got = {"shared": ck.metadata.shared, "cubin_bytes": len(cubin), "code_bytes": code_bytes(cubin),
                   "stack": stack_bytes(cubin), "f64_reduces": ck.asm["ttgir"].count("xf64")}
            if what.startswith("rows"):
                got["gemm_loops"] = gemm_loops(cubin)
                got["wgmma_serialized"] = wgmma_serialized(ck.asm["ptx"])
                got["reduce_orders"] = reduce_orders(ck.asm["ttgir"])
        except Exception:
            got = {"error": traceback.format_exc()[-3000:]}
        print(json.dumps({"case": case, **got}), flush=True)


def stack_bytes(cubin: bytes) -> int:
    """The kernel's per-thread stack (register spills) from ``cuobjdump -res-usage`` (Triton's bundled
    one); -1 where that tool is missing."""
    import re
    import tempfile

    tool = triton_tool("cuobjdump")
    if not tool.exists():
        return -1
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"STACK:(\d+)", out)
    return int(m.group(1)) if m else -1


def wgmma_serialized(ptx: str) -> list[str]:
    """ptxas's C7511 warnings for the kernel's PTX (sm_90a, Triton's bundled ptxas): wgmma instructions it
    serialized for want of registers (each tensor-core op then waits for the one before)."""
    import tempfile
    tool = triton_tool("ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = pathlib.Path(d) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(tool), "--gpu-name", "sm_90a", str(src), "-o", os.devnull], capture_output=True,
                           text=True, check=True)
    return [line for line in (r.stdout + r.stderr).splitlines() if "C7511" in line]


def gemm_loops(cubin: bytes) -> list[tuple[int, int, int, int]]:
    """(instructions, local loads, local stores, plain global loads) of each GEMM loop of a rows kernel's SASS
    (Triton's bundled ``nvdisasm``): a loop is a backward branch's span; a GEMM loop one with tensor-core
    instructions and at least 90% of its instructions from ``opcodes/common_rows.py`` (``rows_stream``'s K loop).
    bench/notes/s50.md read the kernels' spills this way (they sit outside these loops)."""
    import re
    import tempfile
    from collections import Counter
    tool = triton_tool("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([str(tool), "-c", "-g", f.name], capture_output=True, text=True, check=True).stdout
    ins, labels, pending, src = [], {}, [], None     # ins: (address, source file, instruction)
    for line in sass.splitlines():
        if m := re.match(r"\s*(\.L_x_\d+):", line):
            pending.append(m.group(1))
        elif m := re.match(r'\s*//## File "([^"]+)", line \d+', line):
            src = m.group(1).rsplit("/", 1)[-1]
        elif m := re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line):
            a = int(m.group(1), 16)
            labels.update((p, a) for p in pending)
            pending = []
            ins.append((a, src, m.group(2)))
    loops = []
    for a, _, text in ins:
        m = re.search(r"\bBRA\s+`?\(?(\.L_x_\d+)", text)
        if not m or labels.get(m.group(1), a + 1) > a:
            continue
        body = [(f, t) for x, f, t in ins if labels[m.group(1)] <= x <= a]
        if any("MMA" in t for _, t in body) and Counter(f for f, _ in body)["common_rows.py"] >= 0.9 * len(body):
            loops.append((len(body), sum(bool(re.search(r"\bLDL\b", t)) for _, t in body),
                          sum(bool(re.search(r"\bSTL\b", t)) for _, t in body),
                          sum(bool(re.search(r"\bLDG\b", t)) for _, t in body)))
    return loops


def reduce_orders(ttgir: str) -> list[tuple]:
    """The order in which each reduction and each dot of a kernel's TTGIR sums, for comparing two kernels: one
    tuple per ``tt.reduce`` / ``tt.dot`` in program order, (project source lines of its call chain, what decides its
    order). A reduction's order along its axis follows its extent there and the layout's split of that axis
    (elements a thread, lanes, warps; Triton sums a thread's elements, then butterflies over the lanes, then across
    warps): ``("reduce", combiner, element type, extent, split)``, the split ``(sizePerThread, threadsPerWarp,
    warpsPerCTA)`` along the axis for a blocked layout, else the whole layout. A dot sums each output over K in
    tensor-core steps: ``("dot", A's element type, K, the mma version)``. The other dimensions (the rows a kernel
    tiles, in a rows bucket) do not change a sum's order."""
    import re
    alias = dict(re.findall(r"^#(\w+) = (.*?)\s*$", ttgir, re.M))

    def chain(loc: str, depth: int = 0) -> list[str]:       # a location's project source lines, innermost first
        if depth > 64:
            return []
        loc = loc.strip()
        if loc.startswith("#"):
            return chain(alias.get(loc[1:], ""), depth + 1)
        if loc.startswith("loc(") and loc.endswith(")"):
            loc = loc[4:-1]
        if m := re.fullmatch(r'"([^"]+)":(\d+):\d+', loc):
            f = m.group(1)
            name = f.rsplit("/", 1)[-1]     # Triton's own frames and the generated kernel's (its name a hash) left out
            return [] if "/triton/" in f or name.startswith("megakernel_") else [f"{name}:{m.group(2)}"]
        if m := re.fullmatch(r"callsite\((#\w+) at (#\w+)\)", loc):
            return chain(m.group(1), depth + 1) + chain(m.group(2), depth + 1)
        if m := re.fullmatch(r'"[^"]*"\((#\w+)\)', loc):
            return chain(m.group(1), depth + 1)
        return []

    def layout(enc: str) -> str:
        return alias.get(enc[1:], enc) if enc.startswith("#") else enc

    lines = ttgir.splitlines()
    out = []
    for i, line in enumerate(lines):
        if m := re.search(r'"tt\.reduce"\(%[\w#]+\) <\{axis = (\d+)', line):
            j = i
            while "}) : (" not in lines[j]:
                j += 1
            comb = [c for b in lines[i + 1:j] for c in re.findall(r"= (arith\.\w+)", b)]
            t = re.search(r"\}\) : \(tensor<([\dx]+)x(\w+), (#\w+)>", lines[j])
            axis, shape = int(m.group(1)), [int(d) for d in t.group(1).split("x")]
            enc = layout(t.group(3))
            if b := re.match(r"#ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\], "
                             r"warpsPerCTA = \[([\d, ]+)\]", enc):
                split = tuple(int(b.group(k).split(",")[axis]) for k in (1, 2, 3))
            else:
                split = enc
            loc = re.search(r"loc\((#\w+)\)\s*$", lines[j])
            out.append((tuple(chain(loc.group(1))), ("reduce", tuple(comb), t.group(2), shape[axis], split)))
        elif m := re.search(r"= tt\.dot .*?: tensor<(\d+)x(\d+)x(\w+), #ttg\.dot_op<\{opIdx = 0, parent = (#\w+)", line):
            ver = re.search(r"versionMajor = (\d+)", layout(m.group(4)))
            loc = re.search(r"loc\((#\w+)\)\s*$", line)
            out.append((tuple(chain(loc.group(1))), ("dot", m.group(3), int(m.group(2)), ver and int(ver.group(1)))))
    return out


def _id(c) -> str:
    v = c.values if hasattr(c, "values") else c
    return f"{v[0]}-{v[2]}"


#: seconds a case's tape and compile took on CI's kind of machine (2 cores, session 45), to balance the processes
_COMPILE_S = {"layer": 3, "tp-layer": 3, "decoder": 7, "profile": 7, "tp-decoder": 7, "sampling": 9, "rows16": 5,
              "rows32": 5}


def _cases(params: dict) -> list[str]:
    """The compile cases (``preset:max_seq:what``) a test of this module reads."""
    if "what" in params:
        return [f"{params['preset']}:{params['max_seq']}:{params['what']}"]
    return [f"{params['preset']}:{_DECODE_SEQ}:rows{r}" for r in (16, 32)]     # test_decode_buckets_sum_alike


@pytest.fixture(scope="module")
def compiled(request, tmp_path_factory) -> dict:
    """``preset:max_seq:what`` -> the compile's JSON, for every case of this module the session runs, compiled in
    up to two processes side by side (CI's machine has two cores), the cases dealt longest first to the less
    loaded one, each process with its own Triton cache: the compile runs every time; a cubin cached earlier
    would hide its cost."""
    cases = list(dict.fromkeys(c for it in request.session.items
                               if it.module is request.module and hasattr(it, "callspec")
                               and not any(m.name == "skip" for m in it.iter_markers())
                               for c in _cases(it.callspec.params)))
    n = max(1, min(2, os.cpu_count() or 1, len(cases)))
    groups: list[list[str]] = [[] for _ in range(n)]
    load = [0.0] * n
    for case in sorted(cases, key=lambda c: -_COMPILE_S.get(c.rsplit(":", 1)[1], 8)):   # longest first, least loaded
        i = load.index(min(load))
        groups[i].append(case)
        load[i] += _COMPILE_S.get(case.rsplit(":", 1)[1], 8)
    tmp = tmp_path_factory.mktemp("sm90")
    root = pathlib.Path(__file__).resolve().parents[1]
    procs = []
    for i, group in enumerate(g for g in groups if g):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env.update(PYTHONPATH=str(root), MEGATAPE_CACHE=str(tmp / f"m{i}"), TRITON_CACHE_DIR=str(tmp / f"triton{i}"))
        procs.append(subprocess.Popen([sys.executable, __file__, *group], stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True, env=env, cwd=root))
    out, err = {}, []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600 * max(1, len(cases)))
        err.append(stderr[-1500:])
        for line in stdout.splitlines():
            if line.startswith('{"case"'):
                got = json.loads(line)
                out[got.pop("case")] = got
    out["_stderr"] = "\n".join(err)
    return out


@pytest.mark.parametrize("preset,max_seq,what", CASES, ids=[_id(c) for c in CASES])
def test_default_kernel_compiles_for_sm90(preset, max_seq, what, compiled):
    from conftest import H200_SMEM_PER_BLOCK     # here: the compile subprocess runs this file without conftest's setup
    got = compiled.get(f"{preset}:{max_seq}:{what}")
    assert got is not None, f"{preset} {what}: the compile process reported nothing:\n{compiled['_stderr']}"
    assert "error" not in got, f"{preset} {what}: the kernel does not compile for sm_90:\n{got.get('error')}"
    assert got["cubin_bytes"] > 0
    assert got["shared"] <= H200_SMEM_PER_BLOCK, \
        f"{preset} {what}: {got['shared']} bytes of shared memory, an H200 block has {H200_SMEM_PER_BLOCK}"
    if what.startswith("rows"):
        # v1's rows kernels spilled 760 bytes a thread (bench/notes/s38.md); removing that changed nothing
        # measurable (s39.md, run 274). The tilings the GPU measured fastest spill a little (bench/notes/
        # s40.md): 4 warps and M 64 tiles in the 1B's prefill bucket 312 bytes (1708 us a chunk against
        # 2438 spill-free, run 280), 4 warps and gate/up 32 + 32 on the 8B's R32 56 bytes; the 1B's R16 none;
        # the 256-row tiling (8 warps, M 64, 3 stages: 2862 us a 1B chunk in run 280) 280 bytes on the 1B, 240
        # on the 8B's 512-row bucket (its tiles: 2 column blocks of 256). The prefill buckets' LM head one-group
        # path (v157, s41.md) took the 1B's 128-row kernel from 312 to 344; the 512-row bucket's attention tiles
        # of 128 (row, head) pairs in 3 stages (s42.md, runs 289-294: the 8B's last chunk of a 4096-token prompt
        # 32888 -> 20000 us) the 8B's from 208 to 464; the unmasked key blocks and QKV's one dot of M 64 (s43.md
        # v163 + v165, runs 299-300: the 8B's chunk 20668 -> 19061 us on an H100) to 624. The prefill buckets'
        # LM head tiles of 128 vocabulary rows (run 311, H200: a 1B prompt's 1024-row chunk -6.8%) the 1B's 128-
        # and 1024-row kernels from 344 / 536 to 400 / 592, the 8B's 512-row one to 688 (the 1B's chunk got
        # faster with it; the 8B not measured). The 1024-row bucket's last down K chunk ending the layer (DOWN_RES_R,
        # v178: run 314, H100, a 1B chunk 5579 -> 5280 us) took the 1B's 1024-row kernel to 760. The 8B's 1024-row
        # kernel, 128-row O tiles (v180) 1128, and 128-row down / residual tiles (v191: run 328, H100, its chunk
        # -4.2%) 2216, v193's pipelined LM head group path (s53.md) 2224, none of it in a GEMM loop. The bounds
        # guard against more than those.
        bound = {"rows16": 0, "rows32": 64, "rows64": 160, "rows128": 400, "rows512": 688, "rows1024": 760}[what]
        if (preset, what) == ("llama3.1-8b", "rows1024"):
            bound = 2224
        if (preset, what) == ("llama3.1-8b", "rows16"):    # 16 bytes since at least eaf5cfb (found in session 53:
            bound = 16      # this slow case had not run since); runs 323-327 timed that kernel, none in a GEMM loop
        assert 0 <= got["stack"] <= bound, \
            f"{preset} {what}: {got['stack']} bytes of stack a thread (register spills; -1: no cuobjdump to read it)"
        # ... and none in the GEMM loops (sm_90a SASS, bench/notes/s50.md): no spill store there, at most one local
        # load an iteration (the 1B's 1024-row kernel's loops have one: a loop bound), and no wgmma that ptxas
        # serializes for want of registers; a change that moves spills into the loops that carry the prefill's
        # flops fails here, before any GPU run
        assert got["gemm_loops"], f"{preset} {what}: no GEMM loop found in the SASS (has the attribution broken?)"
        assert all(stl == 0 and ldl <= 1 for _, ldl, stl, _ in got["gemm_loops"]), \
            f"{preset} {what}: local memory in a GEMM loop: (instructions, loads, stores, LDG) {got['gemm_loops']}"
        # ... and every operand of one comes by cp.async (LDGSTS), pipelined: a plain load there is waited each K
        # block (the LM head's one-group path loaded its activations so in the 1024-row kernels, 4 LDG an iteration,
        # until v193 told the compiler their column offset's alignment: bench/notes/s53.md)
        assert all(ldg == 0 for *_, ldg in got["gemm_loops"]), \
            f"{preset} {what}: a GEMM loop loads from global memory unpipelined: (instructions, LDL, STL, LDG) " \
            f"{got['gemm_loops']}"
        assert not got["wgmma_serialized"], f"{preset} {what}: {got['wgmma_serialized']}"
        # the decode buckets sum their feature columns in fp64 (common_rows.store_normed / col_rstd: a row's bits
        # the same in the 16- and 32-row buckets, whose fp32 reduction trees differ); the others in fp32
        assert (got["f64_reduces"] > 0) == (int(what[4:]) <= 32), f"{preset} {what}: {got['f64_reduces']} f64 tensors"
    if what in CODE_LIMITED:
        assert 0 < got["code_bytes"] <= ICACHE_BYTES, \
            f"{preset} {what}: {got['code_bytes']} bytes of SASS, over the {ICACHE_BYTES} an H200 SM's instruction " \
            "cache holds: past it every opcode a layer runs refetches its code (~67 ns a KB, bench/NOTES.md runs 193-195)"



#: the cache length of the decode buckets' kernels test_decode_buckets_sum_alike compares (CASES' rows16 / rows32)
_DECODE_SEQ = 1152

#: combiners whose result is the same in any order (integer sums, maxima, minima)
_ORDER_FREE = ("arith.addi", "arith.maxsi", "arith.minsi", "arith.maxui", "arith.minui", "arith.maxnumf",
               "arith.minnumf", "arith.maximumf", "arith.minimumf")


@pytest.mark.parametrize("preset", ["llama3.2-1b", pytest.param("llama3.1-8b", marks=pytest.mark.slow)])
def test_decode_buckets_sum_alike(preset, compiled):
    """A row's logits are the same bits whichever decode bucket (16 or 32 rows) runs it (issue 50: a request's
    tokens independent of what else is in the batch). The buckets' kernels are one source at two row counts; this
    checks that each of their sums runs in the same order in both: the same dots (K, tensor-core kind) and, for
    every reduction whose result depends on its order, the same split of the reduced axis over a thread's
    elements, lanes and warps. Triton picks a reduction's layout from the whole tensor, rows included: runs
    317-318 (H100) found row 0 of a 32-row step not bitwise row 0 of a 16-row step, and the 16- and 32-row
    kernels' TTGIR summed the features' squares (``common_rows.store_normed`` / ``col_rstd``) in different trees
    (bench/notes/s49.md); v186 sums those in fp64, where the order moves a result's last fp32 bit only when the
    sum lands within 2^-29 of a rounding boundary. Those fp64 sums are the only ones allowed to differ."""
    a, b = (compiled.get(c) for c in _cases({"preset": preset}))
    assert a is not None and b is not None and "error" not in a and "error" not in b, \
        f"{preset}: the decode buckets' kernels did not compile:\n{compiled['_stderr']}"
    a, b = a["reduce_orders"], b["reduce_orders"]
    assert len(a) > 0 and [s for s, _ in a] == [s for s, _ in b], \
        f"{preset}: the 16- and 32-row kernels' sums come from different code:\n{a}\n{b}"
    differ = [(src, x, y) for (src, x), (_, y) in zip(a, b) if x != y]
    exempt = [d for d in differ if d[1][0] == "reduce" and (all(c in _ORDER_FREE for c in d[1][1]) or d[1][2] == "f64")]
    assert differ == exempt, \
        f"{preset}: sums whose order differs between the 16- and 32-row buckets (a row's bits then depend on the " \
        "bucket): " + "; ".join(f"{' <- '.join(src)}: {x} vs {y}" for src, x, y in differ if (src, x, y) not in exempt)


if __name__ == "__main__":
    _main(sys.argv[1:])
