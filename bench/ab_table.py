"""One table from the result files of an alternated A/B (``bench/gpu_run.sh tpab``: one process per
variant per round, each writing ``decoder-*.json`` into a folder of its own; or ``python -m bench
decoder --variants`` runs, whose variants are rows of the same file).

    python3 -m bench.ab_table DIR [DIR ...]       (folders or files; e.g. "$RES"/tpab-*)
    python3 -m bench.ab_table --clocks smi.csv DIR ...   (and each process beside the GPUs' clocks)

Per variant (the file's ``tiling``; "default" where none was given), in the order first seen (files in
natural order of their paths: tpab-2 before tpab-10): each
process's megatape median (us/step), their median, x floor (the median of each process's own ratio),
the change against the reference variant's median (``--ref``, default "default"), and whether the
two sets of processes are separated (every process of one faster than every process of the other).
The same tree varies by ~2% between processes on two H200s (bench/NOTES.md v74), so a change is only
what the processes agree on: "separated: no" means the A/B did not decide it.

``--clocks FILE``: the samples `bench/gpu_run.sh` takes for the whole call (nvidia-smi, every ~20 ms:
timestamp, GPU index, SM and memory clocks in MHz, temperature, power in W). A second table lists
every process in order with, per rank (GPU = rank), the median SM clock and power over the samples
inside its timed steps' window (``per_rank[r].timed_window_s`` of the result file, epoch seconds):
whether the processes that ran faster ran at other clocks.
"""
from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import re
import statistics
import sys

MEGATAPE = "megatape"


def _natural(p: pathlib.Path):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def load(paths) -> list[dict]:
    """Every result file under ``paths`` (folders searched for ``decoder-*.json``), as one
    ``{"variant", "us", "x_floor", "file", "windows"}`` per megatape row: the row "megatape ..." is the
    file's ``tiling`` ("default" where none), a row "megatape [SPEC]" (``bench decoder --variants``,
    timed in the same process) is SPEC. A file without a megatape row is an error."""
    files: list[pathlib.Path] = []
    for p in map(pathlib.Path, paths):
        if p.is_dir():
            files += sorted(p.glob("decoder-*.json"))
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"{p}: no such file or folder")
    out = []
    for f in sorted(files, key=_natural):          # tpab-2 before tpab-10: the processes' order
        d = json.loads(f.read_text())
        rows = [r for r in d.get("rows", []) if r.get("name", "").startswith(MEGATAPE)]
        if not rows:
            raise ValueError(f"{f}: no megatape row in 'rows'")
        for r in rows:
            m = re.match(r"megatape \[(.*)\]( \(WRONG\))?$", r["name"])
            variant = (m.group(1) + (m.group(2) or "")) if m else (d.get("tiling") or "default")
            us = float(r["us_per_step"])
            xf = r.get("x_floor")
            out.append({"variant": variant, "us": us,
                        "x_floor": float(xf) if xf is not None else us / float(d["floor_us"]), "file": str(f),
                        # the timed windows are the main row's (tp_bench's speed stage)
                        "windows": [] if m else [pr.get("timed_window_s") for pr in d.get("per_rank", [])]})
    if not out:
        raise ValueError(f"no decoder-*.json under {list(map(str, paths))}")
    return out


def summarize(results: list[dict], ref: str = "default") -> list[dict]:
    """Per variant: its processes' times, median, median x floor, change against ``ref``'s median and
    whether the two are separated (None for ``ref`` itself or where ``ref`` is absent)."""
    order: list[str] = []
    for r in results:
        if r["variant"] not in order:
            order.append(r["variant"])
    by = {v: [r for r in results if r["variant"] == v] for v in order}
    base = [r["us"] for r in by.get(ref, [])]
    out = []
    for v in order:
        us = [r["us"] for r in by[v]]
        med = statistics.median(us)
        row = {"variant": v, "us": us, "median": med, "x_floor": statistics.median(r["x_floor"] for r in by[v]),
               "change": None, "separated": None}
        if base and v != ref:
            row["change"] = med / statistics.median(base) - 1.0
            row["separated"] = max(us) < min(base) or min(us) > max(base)
        out.append(row)
    return out


def table(rows: list[dict], ref: str = "default") -> str:
    lines = [f"| variant | processes (us/step) | median | x floor | vs {ref} | separated |", "|---|---|---|---|---|---|"]
    for r in rows:
        ch = "-" if r["change"] is None else f"{100 * r['change']:+.2f}%"
        sep = "-" if r["separated"] is None else ("yes" if r["separated"] else "no")
        lines.append(f"| {r['variant']} | {' / '.join(f'{u:.1f}' for u in r['us'])} | {r['median']:.1f} | "
                     f"{r['x_floor']:.3f} | {ch} | {sep} |")
    return "\n".join(lines)


def _num(x: str):
    try:
        return float(x)
    except ValueError:              # "[N/A]", "[Not Supported]"
        return None


def read_clocks(path) -> list[dict]:
    """nvidia-smi's samples (``--format=csv,noheader,nounits``: timestamp, index, clocks.sm, clocks.mem,
    temperature.gpu, power.draw), the timestamp as epoch seconds of this machine's local time (as
    nvidia-smi writes it). Lines that do not parse (a header, a cut last line) are skipped."""
    out = []
    for line in pathlib.Path(path).read_text().splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 6:
            continue
        try:
            t = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
            gpu = int(f[1])
        except ValueError:
            continue
        out.append({"t": t, "gpu": gpu, "sm": _num(f[2]), "mem": _num(f[3]), "temp": _num(f[4]), "power": _num(f[5])})
    return out


def window_stats(samples: list[dict], gpu: int, window) -> dict:
    """Median SM clock, memory clock and power of GPU ``gpu`` over the samples inside ``window`` ([t0, t1])."""
    inside = [s for s in samples if s["gpu"] == gpu and window and window[0] <= s["t"] <= window[1]]

    def med(k):
        v = [s[k] for s in inside if s[k] is not None]
        return statistics.median(v) if v else None
    return {"n": len(inside), "sm": med("sm"), "mem": med("mem"), "power": med("power")}


def process_table(results: list[dict], samples: list[dict]) -> str:
    lines = ["| process | variant | us/step | SM MHz (GPU 0 / 1) | memory MHz | power W | samples |",
             "|---|---|---|---|---|---|---|"]

    def fmt(v):
        return "-" if v is None else f"{v:.0f}"
    for r in results:
        st = [window_stats(samples, g, w) for g, w in enumerate(r["windows"])]
        name = pathlib.Path(r["file"]).parent.name
        lines.append(f"| {name} | {r['variant']} | {r['us']:.1f} | {' / '.join(fmt(s['sm']) for s in st) or '-'} | "
                     f"{' / '.join(fmt(s['mem']) for s in st) or '-'} | {' / '.join(fmt(s['power']) for s in st) or '-'} | "
                     f"{' / '.join(str(s['n']) for s in st) or '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.ab_table", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="+", help="result folders (decoder-*.json inside) or files")
    p.add_argument("--ref", default="default", help="the variant the others are compared with (default: default)")
    p.add_argument("--clocks", metavar="CSV", help="nvidia-smi samples (bench/gpu_run.sh's smi.csv): each process's clocks")
    a = p.parse_args(argv)
    try:
        results = load(a.paths)
        rows = summarize(results, a.ref)
        samples = read_clocks(a.clocks) if a.clocks else None
    except (OSError, ValueError, KeyError) as e:
        print(f"ab_table: {e}", file=sys.stderr)
        return 2
    print(table(rows, a.ref))
    if samples is not None:
        print()
        print(process_table(results, samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
