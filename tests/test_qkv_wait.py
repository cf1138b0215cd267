"""``Tiling.qkv_wait``: QKV tiles make their waits inside a row loop (``Instruction.WAIT_INSIDE``), so the
whole tile's weights are issued before the waits; the layer's input and its norm are read after them, RoPE
and the stores a block at a time. Through the Triton interpreter: the column loop's logits and tokens to
fp32 reordering, with one row a warp (``warp_rows``) and across the CTA, and a layer's output and K/V rows."""
from __future__ import annotations

import pytest
import torch

import opcodes
from conftest import clone_cache, decode_tokens, decoder_weights, require_interpreter
from interp import build_layer, layer_step, teardown
from opcodes import ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights
from schedule import compile_model

require_interpreter()

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

# d = 512: one row a warp (warp_rows, 4 warps); 32-row Q tiles of a 64-dim head, 4 dims of each half a stage
WIDE = ModelConfig(layers=2, d=512, ffn=192, n_q=8, n_kv=2, hd=64, theta=10000.0, vocab=300, name="qkv-wait")
TINY = ModelConfig(layers=2, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
LAYER = opcodes.PRESETS["small-2layer"]


@pytest.mark.parametrize("cfg,over", [(WIDE, dict(attn_splits=2, gu_rows=32, row_bytes=8192)),
                                      (TINY, dict(attn_splits=2, gu_rows=32))])
def test_decoder_logits_with_qkv_waiting_inside(cfg, over):
    w = decoder_weights(cfg, 0)
    t0, t1 = Tiling.for_config(cfg, **over), Tiling.for_config(cfg, qkv_wait=1, **over)
    assert t1.qkv_wait == 1 and t1.warp_rows == (cfg is WIDE)
    base = decode_tokens(w, cfg, t0, max_seq=16)
    inside = decode_tokens(w, cfg, t1, max_seq=16)
    err = ((inside[0] - base[0]).abs().max() / base[0].abs().max()).item()
    assert err < 1e-4, err
    assert inside[1] == base[1]


def test_layer_and_cache_with_qkv_waiting_inside():
    outs, caches = [], []
    for qw in (0, 1):
        kv = make_kv_cache(LAYER, 32, 5, seed=4)
        tape = compile_model(LAYER, 1, max_seq=32, tiling=Tiling.for_config(LAYER, qkv_wait=qw), sequential=True).tape
        h = build_layer(make_weights(LAYER, seed=3), kv, LAYER.to_dict(), 32, tape=tape)
        x = torch.randn(1, LAYER.d, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        outs.append(layer_step(h, x, 5).float())
        caches.append(clone_cache(kv))
        teardown(h)
    torch.testing.assert_close(outs[1], outs[0], rtol=2e-2, atol=2e-2)
    for (k0, v0), (k1, v1) in zip(caches[0], caches[1]):
        torch.testing.assert_close(k1.float(), k0.float(), rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(v1.float(), v0.float(), rtol=2e-2, atol=2e-2)
        assert not torch.equal(k1[:, :, 5], torch.zeros_like(k1[:, :, 5]))


def test_qkv_wait_needs_kv_tiles_as_tall_as_q_tiles():
    with pytest.raises(ValueError, match="qkv_wait = 1 needs K/V tiles as tall"):
        opcodes.DecoderLayout(TINY, Tiling.for_config(TINY, qkv_wait=1, kv_rows=4), 32)
    with pytest.raises(ValueError, match="qkv_wait must be 0 or 1"):
        Tiling(qkv_wait=2)
