"""One layer's stages from a ``--profile`` records file, for critical-path analysis.

    python3 -m bench.records records-llama3.2-1b-pos1024.json.gz [--layer L] [--tail N]
    python3 -m bench.records tp-records-rank0.json.gz --layer 40
    python3 -m bench.records records-llama3.2-1b-pos1055.json.gz --per-sm    (every layer, per SM)

The file is what ``python -m bench decoder --profile`` or ``python3 -m bench.tp_bench --profile``
writes (``interp.profile.instruction_rows``: one row per tape slot, ``[slot, opcode, layer, sm,
wait start, exec start, end (ns), instruction]``). Per opcode of the layer, in the order they start:
the instructions and SMs, when they begin waiting, start and end (us from the layer's first wait:
the previous layer's tail may overlap it), the median and summed wait and execution per
instruction, and the ``--tail`` instructions that end last (what the next stage waits for).

``--per-sm`` (:func:`per_sm_table`): per opcode, each SM's mean execution time over every layer, its
spread across SMs, the correlation between the SMs' means over the even and over the odd layers
(near 1: the same SMs are slower in every layer; near 0: noise), and what balancing the SMs could
buy: how much earlier the stage's last instruction would end, on average over the layers, with each
SM's mean offset from the opcode's mean taken out of its instructions. Run 137's 1B: GATE_UP
18.33..19.64 us, r 0.81, yet only 0.23 us earlier (its ends spread 2.25 us): the straggle is noise.
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


def corr(a: list[float], b: list[float]) -> float:
    """Pearson's correlation of ``a`` and ``b`` (NaN where either is constant)."""
    ma, mb = statistics.fmean(a), statistics.fmean(b)
    va = sum((x - ma) ** 2 for x in a)
    vb = sum((y - mb) ** 2 for y in b)
    if va == 0 or vb == 0:
        return float("nan")
    return sum((x - ma) * (y - mb) for x, y in zip(a, b)) / (va * vb) ** 0.5


def per_sm_table(rows: list[list], show: int = 4) -> list[str]:
    """The lines of the ``--per-sm`` report (see the module docstring): per opcode of the layers,
    per SM the mean execution (us) over the layers it ran that opcode in, the min / median / max over
    SMs, the even / odd layer correlation (over SMs that ran it in both), how much earlier each layer's
    last instruction of it would end with every SM at the opcode's mean speed (the mean over layers), and
    the ``show`` slowest and fastest SMs."""
    per: dict[str, dict[int, dict[int, list[float]]]] = {}      # opcode -> sm -> layer -> exec us
    stage: dict[str, dict[int, list[list]]] = {}                 # opcode -> layer -> its records
    for r in rows:
        if r[2] >= 0:
            per.setdefault(r[1], {}).setdefault(r[3], {}).setdefault(r[2], []).append((r[6] - r[5]) / 1e3)
            stage.setdefault(r[1], {}).setdefault(r[2], []).append(r)
    if not per:
        raise ValueError("no per-layer instructions in the records")
    out = []
    for name in sorted(per, key=lambda n: min(r[5] for rs in stage[n].values() for r in rs)):
        sms = per[name]
        mean = {sm: statistics.fmean(v for ts in by.values() for v in ts) for sm, by in sms.items()}
        both = [sm for sm, by in sms.items() if any(l % 2 == 0 for l in by) and any(l % 2 for l in by)]
        half = lambda sm, parity: statistics.fmean(v for l, ts in sms[sm].items() if l % 2 == parity for v in ts)  # noqa: E731
        c = corr([half(sm, 0) for sm in both], [half(sm, 1) for sm in both]) if len(both) >= 3 else float("nan")
        overall = statistics.fmean(v for by in sms.values() for ts in by.values() for v in ts)
        # the stage's last end per layer, as it ran and with each SM's offset from the mean taken out
        earlier = statistics.fmean(max(r[6] for r in rs) / 1e3 - max(r[6] / 1e3 - (mean[r[3]] - overall) for r in rs)
                                   for rs in stage[name].values())
        srt = sorted(mean, key=mean.get)
        fmt = lambda ss: " ".join(f"{sm}:{mean[sm]:.2f}" for sm in ss)     # noqa: E731
        out.append(f"  {name:13s} sms={len(sms):3d} mean exec per SM {mean[srt[0]]:7.2f} / "
                   f"{statistics.median(mean.values()):7.2f} / {mean[srt[-1]]:7.2f} us (min / median / max)  "
                   f"even/odd layers r={c:5.2f}  balanced SMs end {earlier:5.2f} us earlier")
        out.append(f"      slowest {fmt(srt[::-1][:show])}   fastest {fmt(srt[:show])}")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.records", description=__doc__.split("\n\n")[0])
    p.add_argument("file", help="a records file (.json or .json.gz) written by --profile")
    p.add_argument("--layer", type=int, default=None, help="the layer to report (default: the middle one)")
    p.add_argument("--tail", type=int, default=3, help="instructions listed per stage, the last to end")
    p.add_argument("--per-sm", action="store_true",
                   help="per opcode over every layer: each SM's mean execution time, their spread and "
                        "the even/odd layer correlation (is a slow SM slow in every layer?)")
    a = p.parse_args(argv)
    rows = load(a.file)
    if a.per_sm:
        try:
            print("\n".join(per_sm_table(rows)))
        except ValueError as e:
            raise SystemExit(f"{a.file}: {e}") from None
        return 0
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
