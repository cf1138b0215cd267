"""Measuring megatape on a device: the few pieces ``megatape run`` needs on a GPU, and the one copy
of each that the benchmarks in ``bench/`` use too.

* :func:`stream_copy_bandwidth`: bytes/s of a large device-to-device copy (read + write counted);
  the floor of a decode step is the bytes it streams over this bandwidth.
* :func:`time_step`: CUDA-event and synchronised wall-clock medians of a step function.
* :func:`check_megatape`: the correctness protocol of a layer (or stack) handle: every step against
  the torch reference on its own copy of the KV cache, the written cache rows close to the
  reference's, every other row bitwise untouched.
* :func:`measure_layer`: all three on one preset, as ``megatape run`` reports it.

Everything also runs on the CPU (the Triton interpreter for the kernel, ``time.perf_counter`` for
the timing), so that the code paths are tested without a GPU; the numbers mean something only on one.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

import torch

#: a single layer's output, and its written KV rows, within this relative error of the bf16 reference
TOL = 1.5e-2
#: several layers: the bf16 reference is not reproducible to TOL by any other summation order (the
#: reference against itself with its GEMVs summed in two K chunks drifts by ~1.7e-2 over 16 layers);
#: the error against an all-fp32 reference must be at most ACC_RATIO x the bf16 reference's own
ACC_RATIO = 1.1
CRITERION = f"vs fp32 <= {ACC_RATIO} x the bf16 reference's own error, every step"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if len(xs) else float("nan")


def _sync(device_is_cuda: bool) -> None:
    if device_is_cuda:
        torch.cuda.synchronize()


def cache_rows(prefill: int, steps: int) -> int:
    """KV cache rows for a run that writes positions ``prefill .. prefill + steps - 1``: the next
    multiple of 128 at least 64 rows past the last (4224 for 4096 + 32 steps)."""
    return -(-(prefill + steps + 64) // 128) * 128


# ---- stream-copy bandwidth -----------------------------------------------------------------------
def stream_copy_bandwidth(device, nbytes: int = 2 * 1024**3, iters: int = 20, warmup: int = 3) -> float:
    """Bytes/s of a large device-to-device ``dst.copy_(src)``, counting bytes read + written
    (2 * nbytes per copy). Median over ``iters`` timed copies after ``warmup`` untimed ones.
    CUDA: each copy timed with a pair of CUDA events. CPU: ``time.perf_counter``."""
    device = torch.device(device)
    n = max(1, nbytes // 4)
    nb = n * 4
    src = torch.empty(n, dtype=torch.float32, device=device)
    src.fill_(1.0)
    dst = torch.empty_like(src)
    times: list[float] = []
    if device.type == "cuda":
        with torch.cuda.device(device):
            for _ in range(warmup):
                dst.copy_(src)
            torch.cuda.synchronize()
            evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(iters)]
            for s, e in evs:
                s.record()
                dst.copy_(src)
                e.record()
            torch.cuda.synchronize()
            times = [s.elapsed_time(e) * 1e-3 for s, e in evs]   # ms -> s
    else:
        for _ in range(warmup):
            dst.copy_(src)
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    return 2.0 * nb / _median(times)


# ---- timing a decode step ------------------------------------------------------------------------
def time_step(fn: Callable, steps_args: Sequence[tuple], sync_each: bool = False, warmup: int = 0,
              device=None) -> dict:
    """Time ``fn(*args)`` for each ``args`` in ``steps_args`` (e.g. 32 decode steps at
    pos 4096..4127).

    Two passes over ``steps_args``:

    * event pass: each call bracketed by two CUDA events, calls issued back to back (or with a
      ``torch.cuda.synchronize()`` after each when ``sync_each``); ``us_event`` is the median.
    * wall pass: ``time.perf_counter`` around each call with ``torch.cuda.synchronize()`` after it
      (and before it); ``us_wall`` is the median (includes host launch overhead).

    ``warmup`` untimed calls (cycling through ``steps_args``) run first; otherwise the caller must
    warm up (compile, autotune, capture graphs) beforehand. Because the KV cache is updated in
    place at ``pos``, repeating a step rewrites the same slot with the same values.

    On CPU (no CUDA available or ``device`` is a CPU device) both passes use ``perf_counter``.
    Returns ``{"us_event", "us_wall", "all_event", "all_wall"}``.
    """
    if not steps_args:
        raise ValueError("time_step needs at least one step's arguments")
    if device is None:
        cuda = torch.cuda.is_available()
        if cuda:  # infer from the first tensor argument, if any
            for a in steps_args[0]:
                if isinstance(a, torch.Tensor):
                    cuda = a.is_cuda
                    break
    else:
        cuda = _is_cuda(device)
    steps_args = [tuple(a) for a in steps_args]
    for i in range(warmup):
        fn(*steps_args[i % len(steps_args)])
    _sync(cuda)

    # event pass
    all_event: list[float] = []
    if cuda:
        evs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in steps_args]
        for (s, e), args in zip(evs, steps_args):
            s.record()
            fn(*args)
            e.record()
            if sync_each:
                torch.cuda.synchronize()
        torch.cuda.synchronize()
        all_event = [s.elapsed_time(e) * 1e3 for s, e in evs]   # ms -> us
    else:
        for args in steps_args:
            t0 = time.perf_counter()
            fn(*args)
            all_event.append((time.perf_counter() - t0) * 1e6)

    # wall pass
    all_wall: list[float] = []
    for args in steps_args:
        _sync(cuda)
        t0 = time.perf_counter()
        fn(*args)
        _sync(cuda)
        all_wall.append((time.perf_counter() - t0) * 1e6)

    return {"us_event": _median(all_event), "us_wall": _median(all_wall),
            "all_event": all_event, "all_wall": all_wall}


# ---- correctness against the reference -----------------------------------------------------------
def setup(cfg, prefill: int, steps: int, max_seq: int, seed: int, device="cuda"):
    """Weights, a prefilled cache, an untouched copy of it and the per-step inputs, on ``device``."""
    from opcodes.reference import make_kv_cache, make_weights
    dev = torch.device(device)
    weights = make_weights(cfg, seed=seed, device=dev)
    kv = make_kv_cache(cfg, max_seq, prefill, seed=seed + 1, device=dev)
    kv_before = [tuple(t.clone() for t in p) for p in kv]
    g = torch.Generator(device=dev).manual_seed(seed + 2)
    xs = [torch.randn(1, cfg.d, generator=g, device=dev).to(torch.bfloat16) for _ in range(steps)]
    return weights, kv, kv_before, xs


def check_megatape(cfg, h, weights, kv, kv_before, xs, prefill: int, report: dict,
                   fp32_ref: bool = False) -> None:
    """The correctness protocol for one layer handle ``h`` (the cache is reset to ``kv_before``
    first): step ``i`` at position ``prefill + i`` with input ``xs[i]``, each output against the bf16
    reference; then the written cache rows against the reference's and every other row bitwise
    against ``kv_before``. Fills ``report`` (``rel_err_max``, ``kv_untouched_bitwise``,
    ``kv_rows_rel_err``, ``correct``, ...). Several layers with ``fp32_ref``: the criterion is
    :data:`CRITERION` against an all-fp32 reference."""
    from interp import layer_step
    from opcodes.reference import model_ref, model_ref_fp32, rel_err
    for p, b in zip(kv, kv_before):
        p[0].copy_(b[0])
        p[1].copy_(b[1])
    kv_ref = [tuple(t.clone() for t in p) for p in kv_before]
    kv32 = [tuple(t.float() for t in p) for p in kv_before] if fp32_ref else None
    steps = len(xs)
    errs, errs32, ref32 = [], [], []
    for i in range(steps):
        pos = prefill + i
        out = layer_step(h, xs[i], pos)
        ref = model_ref(weights, kv_ref, cfg, xs[i], pos)
        errs.append(rel_err(out, ref))
        if fp32_ref:
            r32 = model_ref_fp32(weights, kv32, cfg, xs[i], pos)
            errs32.append(rel_err(out, r32))
            ref32.append(rel_err(ref, r32))
    h.check()
    if fp32_ref:
        report["rel_err_vs_fp32_max"] = max(errs32)
        report["bf16_ref_vs_fp32_max"] = max(ref32)
        log(f"vs an all-fp32 reference: megatape max rel err {max(errs32):.2e}, the bf16 reference itself "
            f"{max(ref32):.2e}")
    report["rel_err_max"] = max(errs)
    report["rel_err_all"] = errs
    untouched, row_err = True, 0.0
    rows = slice(prefill, prefill + steps)
    for l in range(cfg.layers):
        for j in range(2):
            a, b, r = kv[l][j], kv_before[l][j], kv_ref[l][j]
            mask = torch.ones(a.shape[2], dtype=torch.bool, device=a.device)
            mask[rows] = False
            untouched &= bool(torch.equal(a[:, :, mask], b[:, :, mask]))
            row_err = max(row_err, rel_err(a[:, :, rows], r[:, :, rows]))
    report["kv_untouched_bitwise"] = untouched
    report["kv_rows_rel_err"] = row_err
    if cfg.layers > 1 and fp32_ref:
        # several layers (ACC_RATIO): at every step the error against the all-fp32 reference is at
        # most ACC_RATIO x the bf16 reference's own, and so are the written KV rows'
        row32 = max(rel_err(kv[l][j][:, :, rows], kv32[l][j][:, :, rows])
                    for l in range(cfg.layers) for j in range(2))
        ref_row32 = max(rel_err(kv_ref[l][j][:, :, rows], kv32[l][j][:, :, rows])
                        for l in range(cfg.layers) for j in range(2))
        steps_ok = all(e <= ACC_RATIO * r for e, r in zip(errs32, ref32))
        report.update(kv_rows_rel_err_vs_fp32=row32, bf16_ref_kv_rows_vs_fp32=ref_row32, criterion=CRITERION)
        report["correct"] = bool(steps_ok and untouched and row32 <= ACC_RATIO * ref_row32)
        log(f"check: vs fp32 at every step <= {ACC_RATIO} x the bf16 reference's: {steps_ok}; KV rows vs fp32 "
            f"{row32:.2e} (bf16 reference {ref_row32:.2e}); other rows untouched: {untouched}")
        del kv32
        return
    report["correct"] = bool(max(errs) <= TOL and untouched and row_err <= TOL)
    log(f"check: max rel err {max(errs):.2e} over {steps} steps; KV rows rel err {row_err:.2e}; "
        f"other rows untouched: {untouched}")


# ---- one preset, checked and timed ---------------------------------------------------------------
def measure_layer(cfg, prefill: int = 4096, steps: int = 32, max_seq: int | None = None, seed: int = 0,
                  device="cuda", copy_bytes: int = 2 * 1024**3, policy: str = "cost") -> dict:
    """Build ``cfg``'s default layer (or stack) on ``device``, check ``steps`` decode steps from
    position ``prefill`` against the reference (:func:`check_megatape`) and time them (the median of
    CUDA events, :func:`time_step`); the floor is the bytes a step streams
    (``cfg.spec_bytes_per_step``) over :func:`stream_copy_bandwidth` measured here, of
    ``copy_bytes`` bytes. Returns the report: ``device``, ``stream_copy_Bps``, ``bytes_per_step``,
    ``floor_us``, the check's keys (``correct``, ``rel_err_max``, ...), ``instructions``,
    ``num_sms``, ``us_event``, ``us_wall``, ``x_floor``."""
    from interp import build_layer, layer_step, teardown
    dev = torch.device(device)
    max_seq = cache_rows(prefill, steps) if max_seq is None else max_seq
    if prefill < 0 or prefill + steps > max_seq:
        raise ValueError(f"positions {prefill}..{prefill + steps - 1} do not fit a cache of {max_seq} rows")
    rep: dict = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
                 "preset": cfg.name, "prefill": prefill, "steps": steps, "max_seq": max_seq}
    bw = stream_copy_bandwidth(dev, nbytes=copy_bytes)
    nbytes = cfg.spec_bytes_per_step(prefill, steps)
    rep.update(stream_copy_Bps=bw, bytes_per_step=nbytes, floor_us=nbytes / bw * 1e6)
    weights, kv, kv_before, xs = setup(cfg, prefill, steps, max_seq, seed, device=dev)
    h = build_layer(weights, kv, cfg.to_dict(), max_seq, policy=policy)
    try:
        rep.update(instructions=len(h.tape), num_sms=h.num_sms)
        check_megatape(cfg, h, weights, kv, kv_before, xs, prefill, rep, fp32_ref=cfg.layers > 1)
        t = time_step(layer_step, [(h, xs[i], prefill + i) for i in range(steps)], warmup=3)
        h.check()
    finally:
        teardown(h)
    rep.update(us_event=t["us_event"], us_wall=t["us_wall"], x_floor=t["us_event"] / rep["floor_us"])
    return rep
