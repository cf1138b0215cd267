"""One layer's stages from a ``--profile`` records file, for critical-path analysis.

    python3 -m bench.records records-llama3.2-1b-pos1024.json.gz [--layer L] [--tail N]
    python3 -m bench.records tp-records-rank0.json.gz --layer 40

The file is what ``megatape bench-decoder --profile`` or ``python3 -m bench.tp_bench --profile``
writes (``interp.profile.instruction_rows``: one row per tape slot, ``[slot, opcode, layer, sm,
wait start, exec start, end (ns), instruction]``). Per opcode of the layer, in the order they start:
the instructions and SMs, when they begin waiting, start and end (us from the layer's first wait:
the previous layer's tail may overlap it), the median and summed wait and execution per
instruction, and the ``--tail`` instructions that end last (what the next stage waits for).
"""
from __future__ import annotations

import argparse
import gzip
import json
import statistics


def load(path: str) -> list[list]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def stage_table(rows: list[list], layer: int, tail: int = 3) -> list[str]:
    """The lines of the report for ``layer`` (see the module docstring)."""
    mine = [r for r in rows if r[2] == layer]
    if not mine:
        raise ValueError(f"no instruction of layer {layer} in the records (layers "
                         f"{sorted({r[2] for r in rows} - {-1})[:3]}...)")
    t0 = min(r[4] for r in mine)
    us = lambda ns: (ns - t0) / 1e3        # noqa: E731
    by: dict[str, list] = {}
    for r in mine:
        by.setdefault(r[1], []).append(r)
    out = [f"layer {layer}: {len(mine)} instructions, us from its first wait; "
           f"{us(max(r[6] for r in mine)):.2f} us to its last end"]
    for name in sorted(by, key=lambda n: min(r[5] for r in by[n])):
        rs = by[name]
        wait = [(r[5] - r[4]) / 1e3 for r in rs]
        ex = [(r[6] - r[5]) / 1e3 for r in rs]
        out.append(f"  {name:13s} n={len(rs):4d} sms={len({r[3] for r in rs}):3d} "
                   f"exec {us(min(r[5] for r in rs)):8.2f}..{us(max(r[5] for r in rs)):8.2f} "
                   f"end {us(min(r[6] for r in rs)):8.2f}..{us(max(r[6] for r in rs)):8.2f}  "
                   f"wait med {statistics.median(wait):6.2f} sum {sum(wait):8.1f}  "
                   f"exec med {statistics.median(ex):6.2f} sum {sum(ex):8.1f}")
        for r in sorted(rs, key=lambda r: r[6])[-tail:] if tail else []:
            what = r[7] if len(r) > 7 else f"slot {r[0]}"
            out.append(f"      ends {us(r[6]):8.2f} (exec from {us(r[5]):8.2f}) sm {r[3]:3d}  {what}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.records", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a records file (.json or .json.gz) written by --profile")
    p.add_argument("--layer", type=int, default=None, help="the layer to report (default: the middle one)")
    p.add_argument("--tail", type=int, default=3, help="instructions listed per stage, the last to end")
    a = p.parse_args(argv)
    rows = load(a.file)
    layers = sorted({r[2] for r in rows} - {-1})
    if not layers:
        raise SystemExit(f"{a.file}: no per-layer instructions")
    layer = layers[len(layers) // 2] if a.layer is None else a.layer
    try:
        print("\n".join(stage_table(rows, layer, a.tail)))
    except ValueError as e:
        raise SystemExit(f"{a.file}: {e}") from None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
