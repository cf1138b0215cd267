"""What the host runtimes share (``interp.runtime``, ``interp.decoder``, ``interp.tp``): the parsing of
the model's cfg, the checks of what a build or a step is handed (errors name the argument), and the
arguments of a launch of the interpreter kernel.
"""
from __future__ import annotations

import os

import torch

from opcodes import ModelConfig
from opcodes.reference import layer_shapes

#: the torch dtypes of the kernel's element types (the tape's and codegen's names)
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32, "i64": torch.int64}
_INT32_MAX = 2**31 - 1


def interpreter_mode() -> bool:
    """Whether triton runs kernels through its interpreter (``TRITON_INTERPRET=1``: CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def arg_error(cls, arg: str, expected: str, got) -> Exception:
    """The error ``cls`` of a bad argument: ``"<arg>: expected <expected>, got <got>"``."""
    return cls(f"{arg}: expected {expected}, got {got}")


def describe(t) -> str:
    """A short description of what an argument got (a tensor's shape, dtype and device)."""
    if isinstance(t, torch.Tensor):
        return f"{tuple(t.shape)} {t.dtype} on {t.device}" + ("" if t.is_contiguous() else " (non-contiguous)")
    return f"{type(t).__name__} {t!r}"[:120]


def check_tensor(arg: str, t, shape, dtype, device) -> None:
    """``t`` (the argument ``arg``) is a contiguous, 16-byte aligned tensor of ``shape`` and ``dtype`` on
    ``device``."""
    if not isinstance(t, torch.Tensor):
        raise arg_error(TypeError, arg, f"a torch.Tensor of shape {shape}", describe(t))
    if t.dtype != dtype:
        raise arg_error(TypeError, arg, f"dtype {dtype}", describe(t))
    if tuple(t.shape) != tuple(shape):
        raise arg_error(ValueError, arg, f"shape {tuple(shape)}", describe(t))
    if t.device != device:
        raise arg_error(ValueError, arg, f"a tensor on {device} (the device of weights['layers'][0]['q'])", describe(t))
    if not t.is_contiguous():
        raise arg_error(ValueError, arg, "a contiguous tensor", describe(t))
    if t.data_ptr() % 16:
        raise arg_error(ValueError, arg, "a 16-byte aligned tensor (the kernel loads 16 bytes at a time)",
                        f"data_ptr % 16 = {t.data_ptr() % 16}")


def parse_cfg(cfg, decoder: bool = False) -> ModelConfig:
    """The spec's cfg dict (or a ModelConfig) as a validated ModelConfig; errors name ``cfg``.
    ``decoder``: a whole-model decoder's, which needs ``vocab``. A build parses it once, here, and
    hands the ModelConfig down."""
    if isinstance(cfg, dict):
        try:
            cfg = ModelConfig.from_dict(cfg)
        except (TypeError, ValueError) as e:
            raise type(e)(f"cfg: {e}") from None
    if not isinstance(cfg, ModelConfig):
        raise arg_error(TypeError, "cfg", "a dict (the spec's cfg) or a ModelConfig", describe(cfg))
    if decoder and not cfg.vocab:
        raise arg_error(ValueError, "cfg['vocab']", "the vocabulary size (> 0) for a whole-model decoder",
                        f"{cfg.vocab} (build_layer / build_model run the layers alone)")
    return cfg


def validate_inputs(weights, kv_cache, cfg: ModelConfig, max_seq_len, batch: int = 1):
    """Check everything ``build_layer`` is handed (``cfg`` parsed: :func:`parse_cfg`); return the device.
    ``batch``: the sequence slots of the cache (``build_decoder(..., batch=B)``; a layer decodes one)."""
    if isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        raise arg_error(TypeError, "max_seq_len", "a python int", describe(max_seq_len))
    if max_seq_len <= 0:
        raise arg_error(ValueError, "max_seq_len", "a positive int", max_seq_len)
    if not isinstance(weights, dict) or "layers" not in weights:
        raise arg_error(TypeError, "weights", "a dict with key 'layers'", describe(weights))
    layers = weights["layers"]
    if not isinstance(layers, (list, tuple)):
        raise arg_error(TypeError, "weights['layers']", "a list of per-layer dicts", describe(layers))
    if len(layers) != cfg.layers:
        raise arg_error(ValueError, "weights['layers']", f"{cfg.layers} layer dicts (cfg['layers'])", len(layers))
    if not isinstance(kv_cache, (list, tuple)):
        raise arg_error(TypeError, "kv_cache", "a list of (k, v) pairs", describe(kv_cache))
    if len(kv_cache) != cfg.layers:
        raise arg_error(ValueError, "kv_cache", f"{cfg.layers} (k, v) pairs (cfg['layers'])", f"{len(kv_cache)} pairs")
    first = layers[0].get("q") if isinstance(layers[0], dict) else None
    if not isinstance(first, torch.Tensor):
        raise arg_error(TypeError, "weights['layers'][0]['q']", "a torch.Tensor", describe(first))
    device = first.device
    shapes = layer_shapes(cfg)
    for l, lw in enumerate(layers):
        if not isinstance(lw, dict):
            raise arg_error(TypeError, f"weights['layers'][{l}]", "a dict", describe(lw))
        missing = [k for k in shapes if k not in lw]
        if missing:
            raise arg_error(ValueError, f"weights['layers'][{l}]", f"keys {list(shapes)}", f"missing {missing}")
        for k, shape in shapes.items():
            check_tensor(f"weights['layers'][{l}][{k!r}]", lw[k], shape, torch.bfloat16, device)
    kv_shape = (batch, cfg.n_kv, max_seq_len, cfg.hd)
    for l, pair in enumerate(kv_cache):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise arg_error(TypeError, f"kv_cache[{l}]", "a (k, v) pair", describe(pair))
        for j, name in enumerate("kv"):
            t = pair[j]
            if isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[0] != batch:
                raise arg_error(ValueError, f"kv_cache[{l}][{j}] ({name})",
                                f"dim 0 = batch {batch} (build_decoder(..., batch=B) holds B sequences)",
                                describe(t))
            check_tensor(f"kv_cache[{l}][{j}] ({name})", t, kv_shape, torch.bfloat16, device)
    # the cache is written in place: no K/V tensor may share memory with any other tensor handed in
    spans = []
    for l, lw in enumerate(layers):
        for k in shapes:
            t = lw[k]
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"weights['layers'][{l}][{k!r}]", False))
    for l, pair in enumerate(kv_cache):
        for j, name in enumerate("kv"):
            t = pair[j]
            spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), f"kv_cache[{l}][{j}] ({name})", True))
    spans.sort()
    for (a0, a1, an, aw), (b0, b1, bn, bw) in zip(spans, spans[1:]):
        if b0 < a1 and (aw or bw):
            raise ValueError(f"{bn if bw else an}: shares memory with {an if bw else bn} (bytes "
                             f"[{b0:#x}, {min(a1, b1):#x}) overlap); the KV cache is written in place, so each K "
                             "and V tensor must have memory of its own")
    running_end = 0
    for a0, a1, an, aw in spans:         # catch overlaps that are not between neighbours, too
        if a0 < running_end and aw:
            raise ValueError(f"{an}: shares memory with another tensor handed in; the KV cache is written in "
                             "place, so each K and V tensor must have memory of its own")
        running_end = max(running_end, a1)
    if device.type == "cpu" and not interpreter_mode():
        raise ValueError("weights are on the CPU: set TRITON_INTERPRET=1 before triton is imported to run the "
                         "kernel through the Triton interpreter, or move the tensors to a GPU")
    if device.type == "cuda" and interpreter_mode():
        raise ValueError("TRITON_INTERPRET=1 is set but the tensors are on the GPU: unset it to run on the GPU")
    return device


def device_sms(device: torch.device) -> int:
    """The SMs a kernel on ``device`` may have co-resident (1 under the Triton interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1       # the Triton interpreter runs programs one after another



def check_pos(h, pos, what: str = "pos", held: bool = True) -> int:
    """``pos`` as an int in the cache of the kernel handle ``h``, or -1 for None (the position the
    device holds: the last call's position + 1, or what the host set with
    ``interp.runtime.set_position``); ``held=False``: None is an error (a step that needs the position
    on the host)."""
    if pos is None:
        if not held:
            raise arg_error(TypeError, what, "a python int", describe(pos))
        return -1
    if isinstance(pos, torch.Tensor) and pos.numel() == 1 and not pos.dtype.is_floating_point \
            and pos.dtype != torch.bool:
        pos = int(pos)
    if isinstance(pos, bool) or not isinstance(pos, int):
        raise arg_error(TypeError, what, "a python int (or None: the position held on the device)", describe(pos))
    if not 0 <= pos < h.lay.max_seq:
        raise arg_error(ValueError, what, f"an int in [0, max_seq_len={h.lay.max_seq})", pos)
    return pos


def check_step_args(h, x, pos) -> int:
    """The checks of a step of the kernel handle ``h`` on the residual ``x`` at ``pos``: returns
    :func:`check_pos`'s position."""
    check_open(h)
    pos = check_pos(h, pos)
    if not isinstance(x, torch.Tensor):
        raise arg_error(TypeError, "x", f"a (1, {h.cfg.d}) bfloat16 tensor", describe(x))
    if x.dtype != torch.bfloat16 or tuple(x.shape) != (1, h.cfg.d) or x.device != h.device:
        raise arg_error(ValueError, "x", f"a (1, {h.cfg.d}) bfloat16 tensor on {h.device}", describe(x))
    if not x.is_contiguous():
        raise arg_error(ValueError, "x", "a contiguous tensor", describe(x))
    if x.data_ptr() % 16:
        raise arg_error(ValueError, "x", "a 16-byte aligned tensor", f"data_ptr % 16 = {x.data_ptr() % 16}")
    return pos


def check_model_tensors(arg: str, weights: dict, shapes: dict, kv_cache, device: torch.device) -> None:
    """The whole-model tensors of ``weights`` (``arg``: how the caller names it), by key and shape
    (``validate_inputs`` covers the layers and the cache): present, bf16 on ``device``, and sharing no
    memory with the KV cache, which is written in place."""
    missing = [k for k in shapes if k not in weights]
    if missing:
        raise arg_error(ValueError, arg, "keys " + ", ".join(f"'{k}'" for k in ("layers", *shapes)),
                        f"missing {missing}")
    for k, shape in shapes.items():
        check_tensor(f"{arg}[{k!r}]", weights[k], shape, torch.bfloat16, device)
    for k in shapes:
        t = weights[k]
        a0, a1 = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        for l, pair in enumerate(kv_cache):
            for j, name in enumerate("kv"):
                c = pair[j]
                b0, b1 = c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()
                if a0 < b1 and b0 < a1:
                    raise ValueError(f"kv_cache[{l}][{j}] ({name}): shares memory with {arg}[{k!r}]; the KV "
                                     "cache is written in place, so each K and V tensor needs memory of its own")


def check_spin_limit(spin_limit) -> int:
    """``spin_limit`` (polls before a wait gives up), checked."""
    if isinstance(spin_limit, bool) or not isinstance(spin_limit, int) or spin_limit <= 0:
        raise arg_error(ValueError, "spin_limit", "a positive int", spin_limit)
    return spin_limit


def check_open(h, teardown: str = "teardown") -> None:
    """``h`` (a handle with ``closed``) was not torn down (``teardown``: the function that does it)."""
    if h.closed:
        raise ValueError(f"handle: {teardown}() was already called on it")


def epoch_limit(tapes) -> int:
    """Calls of the kernels of ``tapes`` before a counter would pass the int32 range: each call adds a
    wait's target to its counter, and the pool's ticket counter grows by ``Tape.tickets_per_call``."""
    most = max([1] + [int(t) for q in tapes for t in q.words[:, 2].tolist() + q.words[:, 4].tolist()]
               + [q.tickets_per_call() for q in tapes])
    return _INT32_MAX // most - 1


def kernel_args(h, x, pos: int, out) -> tuple[tuple, dict]:
    """The positional and keyword arguments of a launch of the kernel handle ``h`` (its tape, counters,
    status, profile buffer, address table, control block, poll bound, then ``pos`` (-1: the device's),
    the input ``x`` and the output ``out``; its constexprs and launch options)."""
    return ((h.tape_dev, h.qoff_dev, h.counters, h.status, h.prof, h.bindings.table, h.ctl, h.spin_limit, pos, x, out),
            {**h.constexprs, **h.launch_opts})
