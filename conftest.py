"""Repository-wide pytest setup, run before any test module is imported.

* The repository root goes on ``sys.path`` so ``import opcodes, schedule, interp, bench`` work
  from a plain clone (no install needed).
* With no CUDA device, ``TRITON_INTERPRET=1`` is set so that the interpreter kernel runs through
  the Triton interpreter on the CPU. Triton reads it when ``triton`` is first imported, so it is
  set here, at conftest import time, before any test module imports triton (``import torch``
  does not import triton). An explicit ``TRITON_INTERPRET`` in the environment is left alone.
* Tests marked ``gpu`` are skipped when there is no CUDA device.
"""
from __future__ import annotations

import os
import pathlib
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402  (torch does not import triton)

HAS_CUDA = torch.cuda.is_available()

if not HAS_CUDA:
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") in (None, "", "0"):
        warnings.warn("triton was imported before conftest.py could set TRITON_INTERPRET=1; "
                      "the Triton-interpreter tests may fail", RuntimeWarning)
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    import pytest
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
