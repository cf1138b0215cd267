"""The persistent interpreter kernel and its host runtime.

    from interp import build_layer, layer_step, teardown
"""
from .runtime import MegakernelError, build_layer, layer_step, teardown

__all__ = ["MegakernelError", "build_layer", "layer_step", "teardown"]
