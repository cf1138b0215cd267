"""What the megakernel's sm_90a machine code does, by source line and by loop, without a GPU.

    MEGATAPE_PRESET=llama3.2-1b MEGATAPE_DECODER=1 MEGATAPE_PTX=/tmp/k.ptx python3 -m bench.ptx_diff --resources
    python3 -m bench.sass_report /tmp/k.ptx                      (code size by source file; every loop)
    python3 -m bench.sass_report /tmp/k.ptx --span gate_up.py:36  (from that line's first instruction to
                                                                   the next LDGSTS: what a prologue waits behind)

The PTX is assembled with Triton's bundled ``ptxas -lineinfo`` and disassembled with ``nvdisasm -gi``;
each instruction is attributed to the innermost source line nvdisasm names. A loop is a backward
branch and the instructions between its target and it (the body as laid out, with the code a first
iteration runs under a branch). Per loop it counts what costs a warp a stage beyond its arithmetic:
``BAR`` (CTA barriers), ``SHFL`` (warp shuffles), ``STS`` / ``LDS`` (shared memory), ``LDGSTS``
(async copies), ``STL`` / ``LDL`` (local memory: spills). bench/NOTES.md sessions 28-29 read kernels this way
(v121's row loop, v124-v127).
"""
from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from bench.ptx_diff import triton_tool

#: the instruction kinds a loop's report counts (the mnemonic before its first '.')
KINDS = ("BAR", "SHFL", "STS", "LDS", "LDGSTS", "LDG", "FFMA", "STL", "LDL")


@dataclass(frozen=True)
class Ins:
    addr: int
    src: tuple[str, int] | None       # (file name, line) of the innermost source line
    text: str

    @property
    def op(self) -> str:
        words = self.text.split()
        w = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        return w.split(".")[0]


def parse(sass: str, function: str = "megakernel") -> tuple[list[Ins], dict[str, int]]:
    """The instructions of ``function``'s ``.text`` section in ``nvdisasm -gi`` output, and its
    labels' addresses."""
    out: list[Ins] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    inside, src = False, None
    for line in sass.splitlines():
        if re.match(r"\s*\.section\s", line):
            inside = f".text.{function}" in line.split(",")[0]
            continue
        if not inside:
            continue
        m = re.search(r'//## File "([^"]+)", line (\d+)', line)
        if m:
            src = (m.group(1).rsplit("/", 1)[-1], int(m.group(2)))
            continue
        m = re.match(r"^(\.L_x_\d+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+([^;]+);", line)
        if m:
            addr = int(m.group(1), 16)
            for lab in pending:
                labels[lab] = addr
            pending = []
            out.append(Ins(addr, src, m.group(2).strip()))
    return out, labels


def kinds(body: list[Ins]) -> dict[str, int]:
    c = collections.Counter(i.op for i in body)
    return {k: c[k] for k in KINDS if c[k]}


def loops(ins: list[Ins], labels: dict[str, int], min_len: int = 40) -> list[tuple[int, int, list[Ins]]]:
    """(start, end, body) of every backward branch's loop of at least ``min_len`` instructions,
    innermost first (by length)."""
    at = {i.addr: n for n, i in enumerate(ins)}
    found = []
    for n, i in enumerate(ins):
        m = re.search(r"BRA\s+(?:\S+\s*,\s*)?`?\(?(\.L_x_\d+)", i.text)
        if m and m.group(1) in labels and labels[m.group(1)] <= i.addr:
            j = at[labels[m.group(1)]]
            if n + 1 - j >= min_len:
                found.append((ins[j].addr, i.addr, ins[j:n + 1]))
    return sorted(found, key=lambda f: len(f[2]))


def span(ins: list[Ins], where: tuple[str, int]) -> list[Ins]:
    """From the first instruction of source line ``where`` to the first ``LDGSTS`` after it."""
    start = next((n for n, i in enumerate(ins) if i.src == where), None)
    if start is None:
        raise ValueError(f"no instruction of {where[0]}:{where[1]} in the kernel")
    end = next((n for n in range(start, len(ins)) if ins[n].op == "LDGSTS"), len(ins))
    return ins[start:end]


def disassemble(ptx: pathlib.Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = pathlib.Path(tmp) / "k.cubin"
        subprocess.run([str(triton_tool("ptxas")), "-lineinfo", "-arch=sm_90a", str(ptx), "-o", str(cubin)], check=True)
        return subprocess.run([str(triton_tool("nvdisasm")), "-gi", str(cubin)], check=True, capture_output=True,
                              text=True).stdout


def report(ins: list[Ins], labels: dict[str, int], where: tuple[str, int] | None = None) -> list[str]:
    lines = [f"{len(ins)} instructions, {len(ins) * 16 / 1024:.2f} KB of code"]
    by_file = collections.Counter(i.src[0] if i.src else "?" for i in ins)
    lines += [f"  {n * 16 / 1024:7.2f} KB  {f}" for f, n in by_file.most_common(12)]
    lines.append("loops (innermost first): start..end, instructions, most of them from, counts")
    for a, b, body in loops(ins, labels):
        top = ", ".join(f"{f}:{n}" for f, n in collections.Counter(i.src[0] for i in body if i.src).most_common(3))
        lines.append(f"  {a:#x}..{b:#x}  {len(body):5d}  {top}  {kinds(body)}")
    if where:
        s = span(ins, where)
        lines.append(f"{where[0]}:{where[1]} to the next LDGSTS: {len(s)} instructions, {kinds(s)}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ptx", type=pathlib.Path, help="a kernel's PTX (bench.ptx_diff with MEGATAPE_PTX=)")
    ap.add_argument("--span", metavar="FILE:LINE", help="count from this source line to the next LDGSTS")
    a = ap.parse_args(argv)
    if not a.ptx.is_file():
        ap.error(f"no PTX file at {a.ptx}")
    where = None
    if a.span:
        f, _, ln = a.span.rpartition(":")
        if not f or not ln.isdigit():
            ap.error(f"--span takes FILE:LINE (e.g. gate_up.py:36), got {a.span!r}")
        where = (f, int(ln))
    ins, labels = parse(disassemble(a.ptx))
    if not ins:
        print(f"no megakernel code in {a.ptx}", file=sys.stderr)
        return 1
    try:
        print("\n".join(report(ins, labels, where)))
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
