"""``Tiling.gu_tiles``: the gate/up stage cut into a given number of tiles (e.g. one per SM of an H200,
132, where ffn / gu_rows = 128 leaves 4 SMs idle), each a whole number of the row loop's stages.

Spans cover ffn once, in order, within gu_rows; each row is summed by the same code whichever tile
holds it, so the decoder's logits are bitwise those of the default tiling (Triton interpreter); bad
values and bad operands are named.
"""
from __future__ import annotations

import pytest
import torch

import opcodes
from conftest import decode_tokens, decoder_weights, require_interpreter
from opcodes import ModelConfig, Tiling
from opcodes.gate_up import GateUp
from schedule import compile_model
from schedule.program import lower, make_layout
from schedule.tape import decode
from schedule.verify import TapeError

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
# 4 rows of gate and up a stage (1024 bytes), tiles of at most 32 rows: 5 by default, up to 40
OVER = dict(attn_splits=2, gu_rows=32, row_bytes=1024)


def test_spans_cover_ffn_in_whole_stages():
    one_b = opcodes.PRESETS["llama3.2-1b"]
    lay = make_layout(one_b, 256, Tiling.for_config(one_b, gu_tiles=132))
    sp = GateUp.spans(lay)
    assert len(sp) == 132 and sp[0] == (0, 64) and sp[-1] == (8132, 60)
    assert sorted({n for _, n in sp}) == [60, 64] and sum(n == 64 for _, n in sp) == 68
    assert all(r1 == r0 + n for (r0, n), (r1, _) in zip(sp, sp[1:])) and sp[-1][0] + sp[-1][1] == one_b.ffn
    assert GateUp.spans(make_layout(one_b, 256, Tiling.for_config(one_b, gu_tiles=0))) == \
        [(r, 0) for r in range(0, 8192, 64)]


def test_default_only_where_132_tiles_fit_and_not_on_a_rank():
    """The default (Tiling.for_config): 132 tiles for the 1B (128 of gu_rows would leave 4 SMs idle);
    none for the 8B and 70B shapes (more than a wave already), the small test configs (fewer stages of
    rows than 132) or a tensor-parallel rank (not measured there); an explicit value wins."""
    from opcodes.tp import TPLayout, shard_config
    one_b = opcodes.PRESETS["llama3.2-1b"]
    assert Tiling.for_config(one_b).gu_tiles == 132 and Tiling.for_config(one_b, gu_tiles=0).gu_tiles == 0
    assert Tiling.for_config(one_b, gu_rows=32).gu_tiles == 0            # 256 tiles of 32 rows: more than 132
    assert Tiling.for_config(one_b, down_k=4096).gu_tiles == 0           # two down K chunks: gu_tiles needs one
    for name in ("llama3.1-8b", "llama70b-layer", "small-2layer"):
        assert Tiling.for_config(opcodes.PRESETS[name]).gu_tiles == 0, name
    assert Tiling.for_config(CFG).gu_tiles == 0
    assert TPLayout.default_tiling(shard_config(one_b, 0, 2)).gu_tiles == 0
    tiny = make_layout(CFG, 16, Tiling.for_config(CFG, gu_tiles=7, **OVER))
    assert [n for _, n in GateUp.spans(tiny)] == [24, 24, 24, 24, 24, 20, 20]


def test_bad_gu_tiles_are_named():
    with pytest.raises(ValueError, match="gu_tiles"):
        Tiling(gu_tiles=-1)
    for over, what in (({"gu_tiles": 4}, r"\[5, 40\]"), ({"gu_tiles": 41}, r"\[5, 40\]"),
                       ({"gu_tiles": 7, "down_k": 128}, "one down K chunk")):
        lay = make_layout(CFG, 16, Tiling.for_config(CFG, **{**OVER, **over}))
        with pytest.raises(ValueError, match=what):
            lower(lay)
    col = make_layout(CFG, 16, Tiling.for_config(CFG, gu_rows=32, gu_tiles=7, row_bytes=0))   # the column loop
    with pytest.raises(ValueError, match="row loop"):
        GateUp.spans(col)


def test_operands_are_checked():
    lay = make_layout(CFG, 16, Tiling.for_config(CFG, gu_tiles=7, **OVER))
    assert GateUp(0, 24, 24).check_operands(lay) == []
    assert "rows 36" in " ".join(GateUp(0, 24, 36).check_operands(lay))          # over gu_rows
    assert "rows 6" in " ".join(GateUp(0, 24, 6).check_operands(lay))            # not whole stages of 4
    assert "row0 2" in " ".join(GateUp(0, 2, 24).check_operands(lay))
    assert "rows 20 not" in " ".join(GateUp(0, 144, 20).check_operands(lay))     # past ffn
    plain = make_layout(CFG, 16, Tiling.for_config(CFG, **OVER))
    assert "needs Tiling.gu_tiles" in " ".join(GateUp(0, 0, 24).check_operands(plain))


def test_tape_has_the_tiles_and_the_verifier_checks_their_operands():
    t = Tiling.for_config(CFG, gu_tiles=7, **OVER)
    c = compile_model(CFG, 4, max_seq=16, tiling=t, pool_us=0, decoder=True)
    gu = [d for d in decode(c.tape) if d.ins.NAME == "gate_up"]
    assert len(gu) == CFG.layers * 7 and {d.ins.rows for d in gu} == {20, 24}
    act = {c.tape.counters.index(f"act[{l},0]") for l in range(CFG.layers)}
    down_waits = {t for d in decode(c.tape) if d.ins.NAME == "down" for cnt, t in d.waits if cnt in act}
    assert down_waits == {7}                    # every down tile waits for the 7 gate/up tiles of its layer
    lay = make_layout(CFG, 16, t)
    for rows, what in ((26, "rows 26 not a multiple of 4"), (28, "overlapping an earlier write")):
        prog = lower(lay)
        i = next(i for i, ins in enumerate(prog.instrs) if isinstance(ins, GateUp))
        prog.instrs[i] = GateUp(prog.instrs[i].layer, prog.instrs[i].row0, rows)
        with pytest.raises(TapeError, match=what):
            compile_model(CFG, 4, max_seq=16, tiling=t, lowering=lambda _: prog, pool_us=0)


def test_decoder_logits_bitwise_with_tiles_of_their_own_rows():
    w = decoder_weights(CFG, 0)
    # two steps: GATE_UP's tiles are the same at every position (interpreter time)
    base = decode_tokens(w, CFG, Tiling.for_config(CFG, **OVER), (5, 17), max_seq=16)
    spread = decode_tokens(w, CFG, Tiling.for_config(CFG, gu_tiles=7, **OVER), (5, 17), max_seq=16)
    assert base[0].shape == (2, CFG.vocab) and torch.isfinite(base[0]).all()
    assert torch.equal(base[0], spread[0]) and base[1] == spread[1]
