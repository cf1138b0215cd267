"""Shared guard of the CPU tests that run the real kernel through the Triton interpreter.

``TRITON_INTERPRET=1`` has to be in the environment before triton is first imported (the root
conftest.py sets it on hosts without CUDA). A test module calls :func:`require_interpreter` after
its imports: on a GPU host the module is skipped (run it alone with ``TRITON_INTERPRET=1``); on a CPU
host where triton was imported too early it fails with the reason instead of running compiled code.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch  # (torch does not import triton)

# Importing this module first switches the interpreter on (the root conftest.py does it too). Not on
# a GPU host: there it would turn the GPU tests collected after the module into interpreter runs.
if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"


def require_interpreter() -> None:
    import opcodes
    if all(type(c.device).__name__ == "InterpretedFunction" for c in opcodes.REGISTRY.values()):
        return
    if torch.cuda.is_available():
        pytest.skip("CPU tests of the Triton interpreter: on a GPU host run this module in its own pytest process "
                    "with TRITON_INTERPRET=1", allow_module_level=True)
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: the opcodes' device functions are not "
                "interpreted. Run pytest with TRITON_INTERPRET=1 in the environment.", pytrace=False)
