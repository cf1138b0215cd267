"""Cross-SM synchronisation for the interpreter kernel: bounded acquire waits, release signals.

Producer: every thread's stores -> CTA barrier -> one release atomic (gpu scope).
Consumer (generated into the kernel by interp/codegen.py, inside its dispatch loop):
poll an acquire read of the counter (``ld.global.acquire.gpu``) until it reaches ``target``, giving
up after ``spin_limit`` polls; data written by other SMs is then read with ``cache_modifier=".cg"``
(L1 is not coherent across SMs).

Tensor-parallel kernels also bound every wait in time (:func:`clock_ns`): a peer GPU driven by
another host process may never launch, which no poll count bounds reliably.
"""
from __future__ import annotations

import time

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer


@triton.jit
def signal_counter(ptr):
    """Make this CTA's writes visible, then count one producer done."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")


@triton.jit
def signal_peer_counter(ptr):
    """Tensor parallel: make this CTA's writes (its stores into the peer's memory included) visible
    to the peer GPU, then count one producer done on the PEER's counter (system scope)."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="sys")


@triton.jit
def poll_tp(ptr, peer):
    """Tensor parallel: one poll of a counter, a system-scope acquire where the peer GPU signals it
    (``peer`` != 0), else a gpu-scope one (this rank's own SMs release it at gpu scope)."""
    if peer != 0:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="sys")
    else:
        v = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    return v


def _host_clock_ns():
    """The host's monotonic clock in ns: what :func:`clock_ns` reads under the Triton interpreter
    (which runs a kernel as Python and has no ``%globaltimer``). Marked a Triton builtin so that the
    JIT's dependency scan accepts the reference; only the interpreter ever calls it."""
    return time.monotonic_ns()


_host_clock_ns.__triton_builtin__ = True


@triton.jit
def clock_ns(INTERP: tl.constexpr):
    """Nanoseconds: the GPU's ``%globaltimer``; under the interpreter, the host's monotonic clock.
    Tensor-parallel kernels bound their waits in time with it (``interp.codegen._emit_waits``)."""
    if INTERP:
        t = _host_clock_ns()
    else:
        t = globaltimer()
    return t



@triton.jit
def _clock_probe_kernel(out_ptr, INTERP: tl.constexpr):
    tl.store(out_ptr, clock_ns(INTERP))


def clock_probe(device, pause_s: float = 0.2) -> tuple:
    """(seconds :func:`clock_ns` advanced, seconds the host's clock advanced) between two one-thread
    launches ``pause_s`` apart on ``device``: a check that the time bound of the tensor-parallel waits
    measures time (on a GPU, that ``%globaltimer`` runs in nanoseconds)."""
    import torch
    cuda = torch.device(device).type == "cuda"
    a = torch.zeros(2, dtype=torch.int64, device=device)
    b = torch.zeros(2, dtype=torch.int64, device=device)
    t0 = time.perf_counter()
    _clock_probe_kernel[(1,)](a, INTERP=not cuda)
    if cuda:
        torch.cuda.synchronize(device)
    time.sleep(pause_s)
    _clock_probe_kernel[(1,)](b, INTERP=not cuda)
    if cuda:
        torch.cuda.synchronize(device)
    host = time.perf_counter() - t0
    return (int(b[0]) - int(a[0])) / 1e9, host
