"""Cross-SM synchronisation for the interpreter kernel: bounded acquire waits, release signals.

Producer: every thread's stores -> CTA barrier -> one release atomic (gpu scope).
Consumer: spin on an acquire read of the counter (``ld.global.acquire.gpu``) until it reaches
``target``, giving up after ``limit`` polls; data written by other SMs is then read with
``cache_modifier=".cg"`` (L1 is not coherent across SMs).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def wait_counter(ptr, target, limit):
    """Spin until ``*ptr >= target`` or ``limit`` polls; return the last value seen."""
    seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
    n = 0
    while (seen < target) & (n < limit):
        seen = tl.atomic_add(ptr, 0, sem="acquire", scope="gpu")
        n += 1
    return seen


@triton.jit
def signal_counter(ptr):
    """Make this CTA's writes visible, then count one producer done."""
    tl.debug_barrier()
    tl.atomic_add(ptr, 1, sem="release", scope="gpu")
