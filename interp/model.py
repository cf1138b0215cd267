"""Multi-layer models: the layer contract for ``cfg["layers"] = N``, one launch per step.

    from interp import build_model, model_step, teardown
    h = build_model(weights, kv_cache, cfg, max_seq_len)     # weights {"layers": [N dicts]}, kv_cache [N (k, v)]
    y = model_step(h, x, pos)                                 # x (1, d) bf16 -> (1, d) bf16 after all N layers
    teardown(h)

A 16-layer model is the same kernel as one layer with a longer tape: ``build_layer`` already
lowers every layer of ``cfg['layers']`` into one program (``schedule.program.lower``), whose
counters chain layer l's RESIDUAL tiles to layer l+1's QKV tiles, so the schedule streams layer
l+1's weights while layer l's tail still runs. These are documented aliases of
``build_layer`` / ``layer_step``; whole-model decode (embedding, LM head, greedy argmax) is
``interp.decoder``. ``teardown`` here accepts either kind of handle.
"""
from __future__ import annotations

from . import runtime
from .decoder import DecoderHandle, teardown_decoder


def build_model(weights, kv_cache, cfg, max_seq_len, **options):
    """Prepare ``cfg['layers']`` decoder layers for :func:`model_step`. Untimed.

    weights  : {"layers": [cfg['layers'] dicts of in_norm, post_norm, q, k, v, o, gate, up, down]} bf16
    kv_cache : a list of cfg['layers'] (k, v) pairs, each (1, n_kv, max_seq_len, hd) bf16, updated in place
    cfg      : the spec's cfg dict (or a ModelConfig); ``options`` as for ``build_layer``
    Returns the handle (an ``interp.runtime.LayerHandle``)."""
    return runtime.build_layer(weights, kv_cache, cfg, max_seq_len, **options)


def model_step(handle, x, pos):
    """All N layers on one hidden state in one launch; appends this position's K/V into every
    layer's cache. x: (1, d) bf16 (read, never written); returns a fresh (1, d) bf16 tensor."""
    return runtime.layer_step(handle, x, pos)


def teardown(handle) -> None:
    """Release a handle from ``build_layer`` / ``build_model`` or ``build_decoder`` (idempotent)."""
    if isinstance(handle, DecoderHandle):
        teardown_decoder(handle)
    else:
        runtime.teardown(handle)
