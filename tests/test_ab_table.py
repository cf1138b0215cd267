"""bench.ab_table: the per-variant table of an alternated A/B's result files."""
from __future__ import annotations

import json

import pytest

from bench import ab_table


def _result(path, tiling, us, floor=4000.0):
    path.mkdir(parents=True)
    rows = [{"name": "floor (bytes per GPU / stream copy, rank 0)", "us_per_step": floor, "x_floor": 1.0},
            {"name": "megatape TP=2 (one persistent kernel per GPU)", "us_per_step": us, "x_floor": us / floor}]
    (path / "decoder-x-tp2.json").write_text(json.dumps({"tiling": tiling, "rows": rows}))


def test_the_table_of_an_alternated_ab(tmp_path, capsys):
    # 11 processes in alternation; the folders' natural order is the processes' order
    runs = [("default", 4850), ("a=1", 4800), ("b=2", 4860), ("default", 4870), ("a=1", 4790), ("b=2", 4840),
            ("b=2", 4880), ("a=1", 4810), ("default", 4845), ("b=2", 4830), ("a=1", 4805)]
    for n, (t, us) in enumerate(runs, 1):
        _result(tmp_path / f"tpab-{n}", "" if t == "default" else t, us)
    dirs = sorted(str(p) for p in tmp_path.iterdir())       # the shell's order: tpab-1, tpab-10, tpab-11, tpab-2...
    rows = {r["variant"]: r for r in ab_table.summarize(ab_table.load(dirs))}
    assert list(rows) == ["default", "a=1", "b=2"]
    assert rows["default"]["us"] == [4850, 4870, 4845] and rows["default"]["median"] == 4850
    assert rows["a=1"]["us"] == [4800, 4790, 4810, 4805] and rows["a=1"]["median"] == 4802.5
    assert rows["a=1"]["change"] == pytest.approx(4802.5 / 4850 - 1) and rows["a=1"]["separated"] is True
    assert rows["b=2"]["median"] == 4850 and rows["b=2"]["change"] == pytest.approx(0.0)
    assert rows["b=2"]["separated"] is False                  # 4830..4880 overlaps 4845..4870
    assert rows["default"]["change"] is None and rows["default"]["x_floor"] == pytest.approx(4850 / 4000)
    assert ab_table.main(dirs) == 0
    out = capsys.readouterr().out
    assert "| a=1 | 4800.0 / 4790.0 / 4810.0 / 4805.0 | 4802.5 | 1.201 | -0.98% | yes |" in out
    assert "| b=2 | 4860.0 / 4840.0 / 4880.0 / 4830.0 | 4850.0 | 1.212 | +0.00% | no |" in out
    # another reference; one absent: no comparison
    assert {r["variant"]: r["separated"] for r in ab_table.summarize(ab_table.load(dirs), ref="a=1")}["b=2"] is True
    assert all(r["change"] is None for r in ab_table.summarize(ab_table.load(dirs), ref="nope"))


def test_errors_name_the_path(tmp_path, capsys):
    assert ab_table.main([str(tmp_path / "missing")]) == 2
    assert "missing: no such file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert ab_table.main([str(tmp_path / "empty")]) == 2
    assert "no decoder-*.json" in capsys.readouterr().err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "decoder-y.json").write_text(json.dumps({"rows": [{"name": "floor", "us_per_step": 1.0, "x_floor": 1.0}]}))
    assert ab_table.main([str(bad)]) == 2
    assert "decoder-y.json: no megatape row" in capsys.readouterr().err


def test_each_process_beside_the_clocks(tmp_path, capsys):
    import datetime
    t0 = datetime.datetime(2026, 12, 1, 9, 0, 0)
    lines = ["timestamp, index, clocks.sm [MHz], ...",                 # a header: skipped
             ]
    for k in range(40):                                                 # every 50 ms, both GPUs
        t = t0 + datetime.timedelta(milliseconds=50 * k)
        ts = t.strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        for g in (0, 1):
            sm = 1980 if k < 20 else 1755                               # the clock drops after 1 s
            lines.append(f"{ts}, {g}, {sm + g}, 3201, 50, {600 + k if g == 0 else '[N/A]'}")
    lines.append("2026/12/01 09:00:0")                                  # a cut last line
    smi = tmp_path / "smi.csv"
    smi.write_text("\n".join(lines) + "\n")
    e = t0.timestamp()
    for n, (tiling, us, w) in enumerate([("", 4850, (0.1, 0.3)), ("a=1", 4900, (1.2, 1.5)), ("", 4860, (5.0, 6.0))], 1):
        _result(tmp_path / f"tpab-{n}", tiling, us)
        f = tmp_path / f"tpab-{n}" / "decoder-x-tp2.json"
        d = json.loads(f.read_text())
        d["per_rank"] = [{"rank": r, "timed_window_s": [e + w[0], e + w[1]]} for r in (0, 1)]
        f.write_text(json.dumps(d))
    samples = ab_table.read_clocks(smi)
    assert len(samples) == 80 and samples[1]["power"] is None and samples[0]["power"] == 600
    st = ab_table.window_stats(samples, 0, [e + 0.1, e + 0.3])
    assert st == {"n": 5, "sm": 1980, "mem": 3201, "power": 604}      # samples 2..6
    assert ab_table.window_stats(samples, 1, [e + 1.2, e + 1.5])["sm"] == 1756
    assert ab_table.window_stats(samples, 1, [e + 1.2, e + 1.5])["power"] is None
    assert ab_table.main(["--clocks", str(smi)] + sorted(str(p) for p in tmp_path.glob("tpab-*"))) == 0
    out = capsys.readouterr().out
    assert "| tpab-1 | default | 4850.0 | 1980 / 1981 | 3201 / 3201 | 604 / - | 5 / 5 |" in out
    assert "| tpab-2 | a=1 | 4900.0 | 1755 / 1756 |" in out
    assert "| tpab-3 | default | 4860.0 | - / - | - / - | - / - | 0 / 0 |" in out     # after the samples end


def test_bench_decoder_variants_are_rows_of_one_file(tmp_path, capsys):
    # `megatape bench-decoder --variants "stages=4;x=1"`, two processes: the variants are rows
    for n, (a, b, c) in enumerate([(920.0, 930.0, 990.0), (918.0, 934.0, 995.0)], 1):
        d = tmp_path / f"p{n}"
        d.mkdir()
        rows = [{"name": "floor", "us_per_step": 590.0, "x_floor": 1.0},
                {"name": "megatape", "us_per_step": a, "x_floor": a / 590},
                {"name": "megatape [stages=4]", "us_per_step": b},                 # no x_floor: from floor_us
                {"name": "megatape [x=1] (WRONG)", "us_per_step": c, "x_floor": c / 590},
                {"name": "torch.compile reduce-overhead", "us_per_step": 1400.0, "x_floor": 2.4}]
        (d / "decoder-llama3.2-1b-pos1024.json").write_text(json.dumps({"tiling": "default", "floor_us": 590.0,
                                                                         "rows": rows}))
    rows = {r["variant"]: r for r in ab_table.summarize(ab_table.load([str(tmp_path / "p1"), str(tmp_path / "p2")]))}
    assert list(rows) == ["default", "stages=4", "x=1 (WRONG)"]
    assert rows["default"]["us"] == [920.0, 918.0] and rows["stages=4"]["us"] == [930.0, 934.0]
    assert rows["stages=4"]["x_floor"] == pytest.approx(932.0 / 590) and rows["stages=4"]["separated"] is True
    assert rows["stages=4"]["change"] == pytest.approx(932.0 / 919.0 - 1)
