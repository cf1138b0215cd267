"""The Triton interpreter (``TRITON_INTERPRET=1``, the CPU's way to run the kernel): a speedup of its device calls.

Triton 3.6's interpreter patches ``triton.language`` for a launch (``GridExecutor.__call__``, restored at its end)
and again on every device-function call inside it (``InterpretedFunction.__call__``: ``inspect.getmembers`` over
the language's modules, a scope never restored). Once a launch has patched the language modules a device
function's globals hold, patching them again changes nothing, and it was ~25% of a CPU run of the kernel
(cProfile of tutorial 5; the CPU test suite 318 -> 240 s). :func:`speed_up_device_calls` makes a device call
inside a launch patch only the modules the launch has not patched yet; outside a launch, on another Triton
version, or without ``TRITON_INTERPRET=1`` nothing changes. What a kernel computes is the same: the tests
compare the interpreter kernel with the VM and the references either way. ``interp`` calls it on import.
"""
from __future__ import annotations

import inspect
import os


def speed_up_device_calls() -> bool:
    """Install the faster device calls (once); True if they are in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton
    if triton.__version__ != "3.6.0":
        return False
    import triton.language as tl
    from triton.runtime import interpreter as ti
    if getattr(ti.InterpretedFunction.__call__, "megatape_fast", False):
        return True
    depth = [0]
    patched: set = set()          # this launch's patched language modules (their ids)
    langs_of: dict = {}           # a device function -> the language modules its globals hold
    grid_call, fn_call = ti.GridExecutor.__call__, ti.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        if not depth[0]:
            patched.clear()
        depth[0] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            depth[0] -= 1

    def device_call(self, *args, **kwargs):
        if not depth[0]:
            return fn_call(self, *args, **kwargs)
        key = langs_of.get(self.fn)
        if key is None:
            key = langs_of[self.fn] = frozenset(id(v) for v in self.fn.__globals__.values()
                                                if inspect.ismodule(v) and v in (tl, tl.core))
        if not key <= patched:     # a module this launch has not patched yet: the interpreter's own patch
            ti._patch_lang(self.fn)
            patched.update(key)
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    device_call.megatape_fast = True
    ti.GridExecutor.__call__, ti.InterpretedFunction.__call__ = launch, device_call
    return True
