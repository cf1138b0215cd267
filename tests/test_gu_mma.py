"""``Tiling.gu_mma``: GATE_UP tiles through the tensor cores (``opcodes.common.gemv_mma``), the vector as a
bf16 pair (hi + lo). The decoder's logits and tokens match the row loop's within the pair's rounding
(2^-16 of the vector), with and without tiles of their own rows (``gu_tiles``: masked rows read nothing
and store nothing); bad values are named. Triton interpreter (its bf16 dot is done in fp32: ``mma``)."""
from __future__ import annotations

import pytest
import torch

from conftest import decode_tokens, decoder_weights, require_interpreter
from opcodes import ModelConfig, Tiling
from opcodes.gate_up import gu_mma_bk
from schedule.program import make_layout

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
# 4 rows of gate and up a row-loop stage (1024 bytes); the tensor-core loop: 16 columns a stage, 4 stages
OVER = dict(attn_splits=2, gu_rows=32, row_bytes=1024)


def _step(w, tiling):
    """One decode step of the real kernel: (its fp32 logits, every layer's activation ``act``)."""
    from interp import build_decoder, decode_step, teardown
    from opcodes.reference import make_kv_cache
    h = build_decoder(w, make_kv_cache(CFG, 16, 0), CFG.to_dict(), 16, tiling=tiling)
    logits = decode_step(h, torch.tensor([5], dtype=torch.int32), 0)[0].clone()
    act = h.layer.scratch["act"].clone()
    teardown(h)
    return logits, act


@pytest.mark.parametrize("tiles", [0, 7])
def test_decoder_matches_the_row_loop(tiles):
    w = decoder_weights(CFG, 0)
    base = _step(w, Tiling.for_config(CFG, gu_tiles=tiles, **OVER))
    mma = _step(w, Tiling.for_config(CFG, gu_tiles=tiles, gu_mma=1, **OVER))
    assert torch.isfinite(mma[0]).all() and torch.isfinite(mma[1]).all()
    err = ((mma[1] - base[1]).abs().max() / base[1].abs().max()).item()
    assert 0 < err < 1e-4, err          # the activations: not bitwise (the pair rounds), within its 2^-16
    assert ((mma[0] - base[0]).abs().max() / base[0].abs().max()).item() < 1e-3
    # three steps and their tokens, as the row loop's
    assert decode_tokens(w, CFG, Tiling.for_config(CFG, gu_tiles=tiles, gu_mma=1, **OVER))[1] == \
        decode_tokens(w, CFG, Tiling.for_config(CFG, gu_tiles=tiles, **OVER))[1]


def test_stage_columns_and_bad_values_are_named():
    lay = make_layout(CFG, 16, Tiling.for_config(CFG, gu_mma=1, **OVER))
    assert gu_mma_bk(lay) == 16
    assert gu_mma_bk(make_layout(CFG, 16, Tiling.for_config(CFG, **OVER))) == 0
    with pytest.raises(ValueError, match="gu_mma"):
        Tiling(gu_mma=2)
    with pytest.raises(ValueError, match="gu_mma needs gu_rows >= 16"):
        gu_mma_bk(make_layout(CFG, 16, Tiling.for_config(CFG, gu_mma=1, **dict(OVER, gu_rows=8))))
    odd = ModelConfig(layers=1, d=48, ffn=64, n_q=3, n_kv=1, hd=16, theta=10000.0, vocab=0, name="odd")
    with pytest.raises(ValueError, match="d a multiple"):
        gu_mma_bk(make_layout(odd, 16, Tiling(gu_mma=1, row_bytes=4096, gu_rows=16, qkv_rows=16)))
