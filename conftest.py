"""Repository-wide pytest setup, run before any test module is imported.

* The repository root goes on ``sys.path`` so ``import opcodes, schedule, interp, bench`` work
  from a plain clone (no install needed).
* With no CUDA device, ``TRITON_INTERPRET=1`` is set so that the interpreter kernel runs through
  the Triton interpreter on the CPU. Triton reads it when ``triton`` is first imported, so it is
  set here, at conftest import time, before any test module imports triton (``import torch``
  does not import triton). An explicit ``TRITON_INTERPRET`` in the environment is left alone.
* Tests marked ``gpu`` are skipped when there is no CUDA device.
* ``-n auto`` (pyproject.toml's addopts, pytest-xdist from the ``test`` extra) runs the tests in two
  worker processes on a CPU-only host (:func:`pytest_xdist_auto_num_workers`), each test module in one
  worker (``--dist loadscope``), and in this process alone on a CUDA host. tests/README.md says more.
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


def pytest_xdist_auto_num_workers(config):
    """The workers of ``-n auto``: none on a CUDA host (the GPU tests time kernels and share the device: one
    test at a time, in this process), else two (CI's two cores; up to four where the host has them: each
    worker holds torch and the Triton interpreter, and a module's tests stay in one worker). An explicit
    ``-n N`` or PYTEST_XDIST_AUTO_NUM_WORKERS wins."""
    env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
    if env:
        return int(env)
    if HAS_CUDA:
        return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return 0 if cores < 2 else min(cores, 4)
