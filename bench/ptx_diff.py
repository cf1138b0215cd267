"""Compare the megakernel two commits generate for the H200, without a GPU.

    python3 -m bench.ptx_diff REV_A [REV_B]      (REV_B: the working tree)
    MEGATAPE_TILING=stages=5 python3 -m bench.ptx_diff --resources   (this tree's kernel only)
    MEGATAPE_PRESET=llama3.2-1b MEGATAPE_DECODER=1 python3 -m bench.ptx_diff be1d810   (the decoder's kernel)
    MEGATAPE_TP=1 python3 -m bench.ptx_diff 219da59     (rank 0's tensor-parallel kernel of the preset's layers)
    MEGATAPE_PRESET=llama3.2-1b MEGATAPE_ROWS=1024 python3 -m bench.ptx_diff 5012b86   (a rows bucket's kernel)
    MEGATAPE_ROWS=32 MEGATAPE_BATCH=32 python3 -m bench.ptx_diff 0277259   (... over a cache of 32 slots)
    MEGATAPE_PRESET=llama3.2-1b MEGATAPE_DECODER=1 MEGATAPE_SAMPLE=1 python3 -m bench.ptx_diff --resources   (sampling)
    MEGATAPE_TTGIR=a.ttgir MEGATAPE_PTX=a.ptx python3 -m bench.ptx_diff --resources   (also write the TTGIR, the PTX)

Each tree's generated interpreter kernel is compiled for sm_90 (Triton's bundled ptxas) with the
70B layer's constexprs, the launch options of ``build_layer`` and 16-byte-aligned pointers, and the
PTX instruction streams are compared with labels and debug sections stripped. Identical streams
mean a GPU measurement of one tree holds for the other; any difference is printed, followed by
each tree's registers and spills as the bundled ``ptxas -v`` reports them for sm_90a.
"""
from __future__ import annotations

import difflib
import os
import pathlib
import re
import subprocess
import sys
import tempfile

_COMPILE = r'''
import os, sys
sys.path.insert(0, sys.argv[1])
os.environ["MEGATAPE_CACHE"] = sys.argv[3]
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from opcodes import PRESETS, Layout, Tiling
cfg = PRESETS[os.environ.get("MEGATAPE_PRESET", "llama70b-layer")]
over = dict(kv.split("=") for kv in filter(None, os.environ.get("MEGATAPE_TILING", "").split(",")))
til = Tiling.for_config(cfg, **{k: int(v) for k, v in over.items()})
if os.environ.get("MEGATAPE_TP"):           # rank 0's kernel of the layers on two GPUs (its shard's default tiling)
    from opcodes.tp import TPLayout, shard_config
    sc = shard_config(cfg, 0, 2)
    lay = TPLayout(sc, TPLayout.default_tiling(sc, **{k: int(v) for k, v in over.items()}), 1152, 0, 2)
elif os.environ.get("MEGATAPE_ROWS"):       # a rows bucket's kernel (issue 50), batch MEGATAPE_BATCH (1), its tiling
    from opcodes.rows import rows_tiling
    from schedule.rows_program import lower_rows
    R = int(os.environ["MEGATAPE_ROWS"])
    rows_prog = lower_rows(Layout(cfg, rows_tiling(cfg, R, 4224, **{k: int(v) for k, v in over.items()}), 4224),
                           rows=R, batch=int(os.environ.get("MEGATAPE_BATCH", "1")))
    lay = rows_prog.lay
elif os.environ.get("MEGATAPE_DECODER"):    # the whole-model kernel (embed, lm_head, argmax)
    from opcodes.decoder import DecoderLayout
    lay = DecoderLayout(cfg, til, 1152)
else:
    lay = Layout(cfg, til, 4224)
try:        # the opcodes of the program the benches build (some are only in the kernels of tapes holding them)
    from schedule.program import lower
    if os.environ.get("MEGATAPE_ROWS"):
        used = tuple(rows_prog.classes())
    elif os.environ.get("MEGATAPE_DECODER"):
        from schedule.decoder_program import lower_decoder
        used = tuple(lower_decoder(Layout(cfg, til, 1152), sample=bool(os.environ.get("MEGATAPE_SAMPLE"))).classes())
    else:
        used = tuple(lower(lay).classes())
except Exception:
    used = ()
from interp.codegen import load_kernel
try:        # trees before the registry owned the kernel's parameters
    from opcodes.common import constexpr_values
    k = load_kernel()
    cx = constexpr_values(lay, interp=False)
except ImportError:     # the registry declares the kernel's parameters
    from opcodes import kernel_constexprs, kernel_pointers
    try:
        cx = kernel_constexprs(lay, interp=False, used=used)
    except TypeError:
        cx = kernel_constexprs(lay, interp=False)
    try:    # trees with opcodes that waited inside their device functions (c8903fa; e75e4a2 to session 6)
        from opcodes import waiting_inside
    except ImportError:
        waiting_inside = None
    if waiting_inside is not None:
        try:
            k = load_kernel(kernel_pointers(lay, used), list(cx), used, waiting_inside(lay, used))
        except TypeError:
            k = load_kernel(kernel_pointers(lay), list(cx), (), waiting_inside(lay))
    else:
        try:
            k = load_kernel(kernel_pointers(lay, used), list(cx), used)
        except TypeError:   # trees before the kernel's opcodes depended on the program
            k = load_kernel(kernel_pointers(lay), list(cx))
cx.update(PROFILE=False)
if "PREFETCH" in k.arg_names:   # trees before the prefetch experiment was removed
    cx["PREFETCH"] = False
ptrs = {"tape_ptr": "*i32", "qoff_ptr": "*i32", "cnt_ptr": "*i32", "status_ptr": "*i32", "prof_ptr": "*i64",
        "ptab_ptr": "*i64", "x_ptr": "*bf16", "out_ptr": "*bf16", "ctl_ptr": "*i32"}
sig = {n: ("constexpr" if n in cx else ptrs.get(n, "i32")) for n in k.arg_names}
src = ASTSource(fn=k, signature=sig, constexprs={(k.arg_names.index(n),): v for n, v in cx.items() if n in k.arg_names},
                attrs={(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names) if sig[n][0] == "*"})
ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                    options={"num_warps": lay.tiling.num_warps, "num_stages": 1, "launch_cooperative_grid": True})
open(sys.argv[2], "w").write(ck.asm["ptx"])
if os.environ.get("MEGATAPE_TTGIR"):        # also the TTGIR (where the pipeliner put each load)
    open(os.environ["MEGATAPE_TTGIR"], "w").write(ck.asm["ttgir"])
if os.environ.get("MEGATAPE_PTX"):          # and the PTX itself (the order of the loads and their waits)
    open(os.environ["MEGATAPE_PTX"], "w").write(ck.asm["ptx"])
print(f"shared memory {ck.metadata.shared} bytes", file=sys.stderr)
'''


def triton_tool(name: str) -> pathlib.Path:
    """One of the CUDA tools Triton bundles (``ptxas``, ``nvdisasm``)."""
    import triton
    return pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name


def resources(ptx: pathlib.Path) -> str:
    """'N registers, M bytes spill stores, K bytes spill loads' from the bundled ptxas."""
    r = subprocess.run([str(triton_tool("ptxas")), "-v", "--gpu-name", "sm_90a", str(ptx), "-o", os.devnull],
                       capture_output=True, text=True)
    text = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", text)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if not regs:
        return "ptxas: " + text.strip()[-200:]
    return f"{regs.group(1)} registers" + (f", {spill.group(1)} / {spill.group(2)} bytes spill stores / loads" if spill else "")


def normalised_ptx(tree: pathlib.Path, work: pathlib.Path) -> list[str]:
    out = work / f"{tree.name}.ptx"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", _COMPILE, str(tree), str(out), str(work / f"cache-{tree.name}")],
                   check=True, env=env)
    print(f"{tree.name}: {resources(out)}", file=sys.stderr)
    lines = []
    for ln in out.read_text().splitlines():
        s = ln.strip()
        if s.startswith(".section"):
            break                                   # DWARF from here on: line numbers, not code
        if not s or s.startswith(("//", ".file", ".loc")) or re.fullmatch(r"\$L__\w+:", s):
            continue
        lines.append(re.sub(r"\$L__\w+", "L", re.sub(r"megakernel\w*", "K", s.split("//")[0].rstrip())))
    return lines


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--resources"]:
        with tempfile.TemporaryDirectory() as tmp:
            normalised_ptx(pathlib.Path(__file__).resolve().parents[1], pathlib.Path(tmp))
        return 0
    if not 1 <= len(args) <= 2:
        print(__doc__, file=sys.stderr)
        return 2
    root = pathlib.Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        work = pathlib.Path(tmp)
        trees = []
        for i, rev in enumerate(args):
            t = work / f"tree{i}"
            subprocess.run(["git", "-C", str(root), "worktree", "add", "-q", "--detach", str(t), rev], check=True)
            trees.append(t)
        if len(args) == 1:
            trees.append(root)
        try:
            a, b = (normalised_ptx(t, work) for t in trees)
        finally:
            for t in trees[:len(args)]:
                subprocess.run(["git", "-C", str(root), "worktree", "remove", "--force", str(t)], check=False)
    label_b = args[1] if len(args) == 2 else "working tree"
    if a == b:
        print(f"identical: {len(a)} PTX lines of code ({args[0]} vs {label_b})")
        return 0
    sys.stdout.writelines(difflib.unified_diff([x + "\n" for x in a], [x + "\n" for x in b], args[0], label_b, n=2))
    return 1


if __name__ == "__main__":
    sys.exit(main())
