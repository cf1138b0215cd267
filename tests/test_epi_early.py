"""``Tiling.epi_early`` (for measurement): QKV reads its RoPE cos / sin (bit 1) and O its residual rows (bit 2)
at the tile's start, after its waits and before its weight loop, instead of after the loop. The same
values in the same arithmetic, so through the Triton interpreter a decoder's logits and tokens, and a
layer stack's output and cache, are bitwise those of the default; a value read in the wrong place
(the cos / sin of another position, another layer's residual) would move them.
"""
from __future__ import annotations

import pytest
import torch

import opcodes
from conftest import decode_tokens, decoder_weights, require_interpreter
from opcodes import ModelConfig, Tiling
from opcodes.oproj import OProj
from opcodes.qkv import QKV

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

CFG = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
MAX_SEQ = 32


def test_epi_early_is_checked_and_off_by_default():
    for name in ("llama3.2-1b", "llama3.1-8b", "llama70b-layer"):
        assert Tiling.for_config(opcodes.PRESETS[name]).epi_early == 0, name
    for bad in (4, -1, True):
        with pytest.raises(ValueError, match="epi_early"):
            Tiling.for_config(CFG, epi_early=bad)
    lay = opcodes.DecoderLayout(CFG, Tiling.for_config(CFG, epi_early=3), MAX_SEQ)
    assert QKV.CONSTEXPRS["QKV_EPI"](lay) == 1 and OProj.CONSTEXPRS["O_EPI"](lay) == 1
    lay = opcodes.DecoderLayout(CFG, Tiling.for_config(CFG, epi_early=2), MAX_SEQ)
    assert QKV.CONSTEXPRS["QKV_EPI"](lay) == 0 and OProj.CONSTEXPRS["O_EPI"](lay) == 1


@pytest.mark.parametrize("bits", [1, 2, 3])
def test_decoder_logits_bitwise_with_early_epilogue_reads(bits):
    """Three decode steps at positions 0, 1, 2 (each step rotates by its own cos / sin; layer 1's
    O reads layer 0's folded residual), with and without ``res_fold``."""
    w = decoder_weights(CFG, 0)
    for fold in (1, 0):
        base = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32, res_fold=fold),
                             max_seq=MAX_SEQ)
        early = decode_tokens(w, CFG, Tiling.for_config(CFG, attn_splits=2, gu_rows=32, res_fold=fold,
                                                        epi_early=bits), max_seq=MAX_SEQ)
        assert base[0].shape == (3, CFG.vocab)
        assert torch.equal(base[0], early[0]) and base[1] == early[1], (bits, fold)
