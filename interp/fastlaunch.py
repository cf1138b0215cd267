"""Launch a compiled Triton kernel straight through the CUDA driver with prepared parameters.

Triton's launcher parses every argument (constexprs included) and asks the driver about every
pointer on each call; for the megakernel that was 25-50 us of host time per step. The megakernel's
arguments are fixed at build time except four scalars/pointers, so the parameter block is built
once and only those slots are rewritten per call (~ a few us). Falls back to Triton's launcher
when the driver library or the kernel's signature is not what this module expects.
"""
from __future__ import annotations

import ctypes

_CU = None


def _libcuda():
    global _CU
    if _CU is None:
        _CU = ctypes.CDLL("libcuda.so.1")
        for name in ("cuLaunchKernel", "cuLaunchCooperativeKernel"):
            f = getattr(_CU, name)
            f.restype = ctypes.c_int
            f.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                          ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p] + \
                         ([ctypes.c_void_p] if name == "cuLaunchKernel" else [])
    return _CU


_CTYPES = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "u32": ctypes.c_uint32, "u64": ctypes.c_uint64,
           "fp32": ctypes.c_float}


class FastLauncher:
    """``launcher(values_by_name, stream)`` launches ``ck`` with the values given for the names in
    ``dynamic`` and the values fixed at construction for the others."""

    def __init__(self, ck, grid: int, fixed: dict, dynamic: tuple, cooperative: bool):
        ck._init_handles()
        sig = ck.src.signature                      # name -> type string, constexprs included
        md = ck.metadata
        if getattr(md, "num_ctas", 1) != 1 or getattr(md, "launch_pdl", False):
            raise NotImplementedError("clusters / PDL launches are not supported by FastLauncher")
        self.slots = {}
        vals = []
        for name, ty in sig.items():
            if ty == "constexpr":
                continue
            if ty.startswith("*"):
                c = ctypes.c_uint64()
            elif ty in _CTYPES:
                c = _CTYPES[ty]()
            else:
                raise NotImplementedError(f"argument {name} of type {ty}")
            if name in dynamic:
                self.slots[name] = c
            elif name in fixed:
                v = fixed[name]
                c.value = v.data_ptr() if hasattr(v, "data_ptr") else v
            else:
                raise ValueError(f"no value for kernel argument {name}")
            vals.append(c)
        missing = set(dynamic) - set(self.slots)
        if missing:
            raise ValueError(f"kernel has no arguments {sorted(missing)}")
        self._scratch = []
        for size_attr in ("global_scratch_size", "profile_scratch_size"):
            size = getattr(md, size_attr, 0) or 0
            c = ctypes.c_uint64(0)
            if size:
                import torch
                buf = torch.empty(grid * size, dtype=torch.uint8, device="cuda")
                self._scratch.append(buf)
                c.value = buf.data_ptr()
            vals.append(c)
        self._vals = vals
        self._params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        self.fn = ck.function
        self.grid = grid
        self.block = 32 * md.num_warps
        self.shared = md.shared
        lib = _libcuda()
        self.cooperative = cooperative
        self._launch = lib.cuLaunchCooperativeKernel if cooperative else lib.cuLaunchKernel

    def __call__(self, stream: int, **values) -> None:
        for k, v in values.items():
            self.slots[k].value = v
        if self.cooperative:
            r = self._launch(self.fn, self.grid, 1, 1, self.block, 1, 1, self.shared, stream, self._params)
        else:
            r = self._launch(self.fn, self.grid, 1, 1, self.block, 1, 1, self.shared, stream, self._params, None)
        if r != 0:
            raise RuntimeError(f"cuLaunch{'Cooperative' if self.cooperative else ''}Kernel failed with CUresult {r}"
                               + (" (grid cannot be co-resident)" if r == 720 else ""))
