"""``Tiling.warp_rows``: the row loop of GATE_UP and LM_HEAD with each row summed inside one warp
(``opcodes.common.warp_rows_dot``). The same dots in another order: the decoder's logits match the
default loop's to fp32 rounding and its tokens are equal (Triton interpreter), including an LM head
whose last tile runs past the vocabulary; bad values are named."""
from __future__ import annotations

import pytest
import torch

from conftest import decode_tokens, decoder_weights, require_interpreter
from opcodes import ModelConfig, Tiling
from schedule.program import make_layout

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# d = 512: a row is two [256] pieces in each thread of its warp; 4 rows of gate and of up a stage (8 KB), 8 of
# the LM head; a vocabulary of 300 leaves the last LM tile partly past it. One layer (warp_rows changes
# GATE_UP's and LM_HEAD's loops, not how layers chain; the interpreter's time goes with the layers)
CFG = ModelConfig(layers=1, d=512, ffn=192, n_q=8, n_kv=2, hd=64, theta=10000.0, vocab=300, name="warp-rows")
TOKENS = (5, 17)          # two steps: the second attends to two keys
OVER = dict(attn_splits=2, gu_rows=32, row_bytes=8192)


def test_decoder_logits_match_the_cta_row_loop():
    w = decoder_weights(CFG, 0)
    t0 = Tiling.for_config(CFG, warp_rows=0, **OVER)
    t1 = Tiling.for_config(CFG, **OVER)                 # the default where d <= 2048 fits it
    assert t0.row_bytes and t0.num_warps == 4 and t0.warp_rows == 0 and t1.warp_rows == 1
    assert t1.rows_per_block(CFG.d, 2, t1.gu_rows) == 4 and t1.rows_per_block(CFG.d, 1, 64) == 8
    base = decode_tokens(w, CFG, t0, TOKENS, max_seq=16)
    wr = decode_tokens(w, CFG, t1, TOKENS, max_seq=16)
    assert base[0].shape == (len(TOKENS), CFG.vocab) and torch.isfinite(wr[0]).all()
    err = ((wr[0] - base[0]).abs().max() / base[0].abs().max()).item()
    assert err < 1e-5, err
    assert wr[1] == base[1]


def test_default_where_the_rows_fit_and_not_on_a_rank():
    """On for d <= 2048 that is 256 times a power of two (the 1B, this file's config); off for the 8B and
    70B shapes (no row loop), d 384, the small test configs and a tensor-parallel rank (not measured)."""
    import opcodes
    from opcodes.tp import TPLayout, shard_config
    one_b = opcodes.PRESETS["llama3.2-1b"]
    assert Tiling.for_config(one_b).warp_rows == 1 and Tiling.for_config(CFG).warp_rows == 1
    for name in ("llama3.1-8b", "llama70b-layer", "small-2layer", "tiny"):
        assert Tiling.for_config(opcodes.PRESETS[name]).warp_rows == 0, name
    assert Tiling.for_config(ModelConfig(layers=1, d=384, ffn=256, n_q=4, n_kv=2, hd=64)).warp_rows == 0
    assert TPLayout.default_tiling(shard_config(one_b, 0, 2)).warp_rows == 0
    assert [d for d in (256, 384, 512, 768, 1024, 2048, 4096) if Tiling.warp_rows_fit(d)] == [256, 512, 1024, 2048, 4096]


def test_bad_warp_rows_are_named():
    for v in (2, -1, True):
        with pytest.raises(ValueError, match="warp_rows"):
            Tiling(warp_rows=v)
    small = ModelConfig(layers=1, d=384, ffn=256, n_q=4, n_kv=2, hd=64, vocab=100)      # 384 = 256 x 1.5
    for cfg, over, what in ((small, {}, "d = 384"), (CFG, {"row_bytes": 0}, "row_bytes > 0, got 0")):
        with pytest.raises(ValueError, match=what):
            make_layout(cfg, 16, Tiling.for_config(cfg, warp_rows=1, **{**OVER, **over}))
