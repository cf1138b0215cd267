"""``opcodes.tiling``: every default of ``Tiling.for_config`` is a row of one table (``DEFAULTS``) with
its reason, and every opt-in knob is either set by a row or listed in ``EXPERIMENTAL``."""
from __future__ import annotations

import dataclasses

import pytest

from opcodes import PRESETS, Tiling
from opcodes.tiling import DEFAULTS, EXPERIMENTAL
from opcodes.tp import TPLayout, shard_config

FIELDS = {f.name: f.default for f in dataclasses.fields(Tiling)}
SET_BY_A_ROW = {k for row in DEFAULTS for k in row.values}


def test_every_row_names_fields_and_gives_one_line_of_reason():
    for row in DEFAULTS:
        assert row.values and set(row.values) <= set(FIELDS), row.values
        assert row.why.strip() and "\n" not in row.why, row.why


def test_every_opt_in_knob_is_set_by_a_row_or_experimental():
    off = {k for k, v in FIELDS.items() if v == 0}          # the knobs whose field default is "off"
    assert off - SET_BY_A_ROW == set(EXPERIMENTAL)
    assert not set(EXPERIMENTAL) & SET_BY_A_ROW
    assert all(why.strip() and "\n" not in why for why in EXPERIMENTAL.values())


def test_no_default_turns_an_experimental_knob_on():
    for cfg in PRESETS.values():
        for t in (Tiling.for_config(cfg), Tiling.for_config(cfg, max_seq=128)):
            assert all(getattr(t, k) == FIELDS[k] for k in EXPERIMENTAL), (cfg.name, t)


@pytest.mark.parametrize("name", ["llama3.2-1b", "llama70b-layer"])
def test_the_tp_rows_apply_to_a_rank_only(name):
    """``TPLayout.default_tiling`` is ``for_config(tp=True)``: the rows conditioned on ``tp`` change
    it (K/V tiles of half the Q tiles' rows), and a caller's override still wins."""
    sc = shard_config(PRESETS[name], 0, 2)
    one, rank = Tiling.for_config(sc), TPLayout.default_tiling(sc)
    assert rank == Tiling.for_config(sc, tp=True)
    assert one.kv_rows == 0 and rank.kv_rows == max(2, rank.qkv_rows // 2)
    assert rank.down_wait == rank.warp_rows == rank.gu_tiles == 0
    assert TPLayout.default_tiling(sc, kv_rows=4).kv_rows == 4
    assert TPLayout.default_tiling(sc, qkv_rows=16).kv_rows == 8


def test_unknown_override_is_named():
    with pytest.raises(ValueError, match=r"unknown Tiling fields \['nope'\]"):
        Tiling.for_config(PRESETS["llama3.2-1b"], nope=1)
