"""Cross-SM synchronisation for the interpreter kernel: bounded acquire waits, release signals.

Producer: every thread's stores -> CTA barrier -> one release atomic (gpu scope).
Consumer (generated into the kernel by interp/codegen.py, inside its dispatch loop):
poll an acquire read of the counter (``ld.global.acquire.gpu``) until it reaches ``target``, giving
up after ``spin_limit`` polls; data written by other SMs is then read with ``cache_modifier=".cg"``
(L1 is not coherent across SMs).
"""
from __future__ import annotations

import triton
import triton.language as tl


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
