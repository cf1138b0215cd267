"""Helpers and fixtures shared by the test modules (the repository-root conftest.py runs first: it
puts the repository on ``sys.path`` and sets ``TRITON_INTERPRET=1`` on hosts without CUDA).

Plain helpers (used at module level too, e.g. in parametrize tables) are imported by the test
modules with ``from conftest import ...``: under pytest's default ``prepend`` import mode this
directory is on ``sys.path`` and this file is the module ``conftest`` while the tests run.

* :func:`require_interpreter`: call after the imports of a module that runs the real kernel through
  the Triton interpreter (skips the module on a GPU host, fails clearly if triton was imported
  before ``TRITON_INTERPRET=1`` was set).
* tensors: :func:`clone_cache`, :func:`clone_weights`, :func:`bits`, :func:`bitwise_equal`,
  :func:`caches_equal`, :func:`changed_rows`, :func:`rand_x`, :func:`decoder_weights`,
  :func:`random_llama` (a transformers Llama with weights drawn here);
  messages: :func:`check_message`; broken tapes: :func:`bump_target`, :func:`drop_producer`;
  clocks: :class:`StepClock`, :func:`perf_counter_ms` (stand-ins that advance a fixed step a read).
* fixtures: ``handles`` (build layers / models / decoders, torn down after the test),
  ``runslow`` (whether tests marked ``slow`` run: ``--runslow`` or ``MEGATAPE_SLOW=1``).

Tests marked ``slow`` are skipped unless ``--runslow`` is given or ``MEGATAPE_SLOW=1`` is set (so
the default suite, README's command (b) and ``.ci/run``, stays short); tests that take the
``runslow`` fixture run a longer sweep then. A CPU test is marked slow (or sweeps less by default)
only where default cases guard the same paths (its comment says which; tests/README.md lists them).
``-m gpu`` selects the GPU tests as before; the 20,000-step soak is ``gpu`` and ``slow``:
``MEGATAPE_SLOW=1 pytest -m gpu``.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time

import pytest
import torch  # (torch does not import triton)

HAS_CUDA = torch.cuda.is_available()
#: bytes of shared memory an H200 block may take (cudaDevAttrMaxSharedMemoryPerBlockOptin): the sm_90 compile tests' bound
H200_SMEM_PER_BLOCK = 232448

# Not on a GPU host: there it would turn the GPU tests into interpreter runs (the root conftest.py
# has already done this on a CPU host; this only repeats it for a run rooted in tests/).
if not HAS_CUDA and "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _interpreter_device_calls() -> None:
    """``interp.interpreter.speed_up_device_calls`` (``interp`` installs it on import; a module that runs the
    kernel imports interp, this covers one that imports the opcodes alone)."""
    from interp.interpreter import speed_up_device_calls
    speed_up_device_calls()


_interpreter_device_calls()


# ---- pytest options -----------------------------------------------------------------------------
def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true", default=False,
                     help="also run tests marked slow (or set MEGATAPE_SLOW=1)")


def _slow_enabled(config) -> bool:
    return bool(config.getoption("--runslow")) or os.environ.get("MEGATAPE_SLOW", "") not in ("", "0")


def pytest_collection_modifyitems(config, items):
    if _slow_enabled(config):
        return
    skip = pytest.mark.skip(reason="slow: run with --runslow or MEGATAPE_SLOW=1")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def runslow(request) -> bool:
    return _slow_enabled(request.config)


# ---- the Triton interpreter guard ---------------------------------------------------------------
def require_interpreter() -> None:
    """Call at module level after the imports of a CPU test module that runs the real kernel."""
    import opcodes
    if all(type(c.device).__name__ == "InterpretedFunction" for c in opcodes.REGISTRY.values()):
        return
    if HAS_CUDA:
        pytest.skip("CPU tests of the Triton interpreter: on a GPU host run this module in its own pytest process "
                    "with TRITON_INTERPRET=1", allow_module_level=True)
    pytest.fail("triton was imported before TRITON_INTERPRET=1 was set: the opcodes' device functions are not "
                "interpreted. Run pytest with TRITON_INTERPRET=1 in the environment.", pytrace=False)


# ---- tensors -------------------------------------------------------------------------------------
_INT_OF = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
           torch.int32: torch.int32, torch.int64: torch.int64}


def clone_cache(kv):
    """A deep copy of a KV cache ``[(k, v)]``."""
    return [tuple(t.clone() for t in pair) for pair in kv]


def clone_weights(w: dict) -> dict:
    """A deep copy of a weights dict (the layers and any whole-model tensors)."""
    out = {k: v.clone() for k, v in w.items() if isinstance(v, torch.Tensor)}
    out["layers"] = [{n: t.clone() for n, t in lw.items()} for lw in w["layers"]]
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INT_OF[t.dtype])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bits (unlike torch.equal, -0.0 != 0.0 and NaN == NaN)."""
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a), bits(b))


def caches_equal(a, b) -> bool:
    """Two KV caches (or lists of tensor pairs) bitwise equal."""
    return len(a) == len(b) and all(bitwise_equal(x, y) for pa, pb in zip(a, b) for x, y in zip(pa, pb))


def changed_rows(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Sequence positions (dim 2) where two (1, n_kv, S, hd) caches differ bitwise."""
    diff = (bits(a) != bits(b)).any(dim=3).any(dim=1).any(dim=0)
    return torch.nonzero(diff).flatten().tolist()


def rand_x(d: int, seed: int, device="cpu") -> torch.Tensor:
    """A (1, d) bf16 layer input drawn from its own generator (the same bits on every device)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, d, generator=g).to(torch.bfloat16).to(device)


def decoder_weights(cfg, seed: int = 0, device="cpu") -> dict:
    """Random whole-model weights (``opcodes.decoder.random_model_weights``)."""
    from opcodes.decoder import random_model_weights
    return random_model_weights(cfg, seed, device)


def decode_tokens(w: dict, cfg, tiling, tokens=(5, 17, 3), max_seq: int = 16):
    """The real decoder kernel built with ``tiling`` fed ``tokens`` at positions 0, 1, ... from an
    empty cache: (its fp32 logits stacked [steps, vocab], its greedy token after each step)."""
    from interp import build_decoder, decode_step, teardown
    from opcodes.reference import make_kv_cache
    h = build_decoder(w, make_kv_cache(cfg, max_seq, 0), cfg.to_dict(), max_seq, tiling=tiling)
    logits, toks = [], []
    for p, t in enumerate(tokens):
        logits.append(decode_step(h, torch.tensor([t], dtype=torch.int32), p)[0].clone())
        toks.append(int(h.tok[0]))
    teardown(h)
    return torch.stack(logits), toks


def random_llama(kw: dict, seed: int, max_position_embeddings: int = 128):
    """``interp.hf.random_llama`` (imported when called: importing interp imports triton)."""
    from interp.hf import random_llama as make
    return make(kw, seed, max_position_embeddings)


# ---- clocks ---------------------------------------------------------------------------------------
class StepClock:
    """A stand-in clock that is ``step`` later at every read (``reads`` counts them): what a timed region
    or a time bound measures is then a count of reads, whatever the host's load. For
    ``interp.sync._host_clock_ns`` (what the kernels' ``clock_ns`` reads under the interpreter; int ns)
    and ``time.perf_counter`` (:func:`perf_counter_ms`)."""

    def __init__(self, step, start=0):
        self.step, self.start, self.reads = step, start, 0

    @property
    def now(self):
        return self.start + self.reads * self.step

    def __call__(self):
        self.reads += 1
        return self.now


@contextlib.contextmanager
def perf_counter_ms():
    """``time.perf_counter`` is a :class:`StepClock` of 1 ms a read inside the block (no CPU test asserts
    on the wall clock); yields the clock."""
    clock = StepClock(1e-3)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(time, "perf_counter", clock)
        yield clock


# ---- messages ------------------------------------------------------------------------------------
def check_message(exc: BaseException, names: list[str]) -> None:
    """The message names the argument and what was expected and given: every string in
    ``names`` occurs in it (case-insensitive)."""
    msg = str(exc)
    low = msg.lower()
    missing = [s for s in names if s.lower() not in low]
    assert not missing, f"message {msg!r} does not mention {missing}"


# ---- broken tapes (the verifier bypassed) --------------------------------------------------------
def first_waiter(tape, slots=None) -> int:
    """The first slot (of ``slots``, default all) whose instruction waits on a counter."""
    return next(k for k in (range(len(tape)) if slots is None else slots) if int(tape.words[k, 1]) >= 0)


def bump_target(tape, slots=None):
    """The first instruction that waits on something waits for one producer more than exist.
    Returns (broken tape, that slot, its counter)."""
    w = tape.words.clone()
    k = first_waiter(tape, slots)
    w[k, 2] += 1
    return dataclasses.replace(tape, words=w), k, int(w[k, 1])


def drop_producer(tape):
    """The last producer of the first waiter's counter signals nothing.
    Returns (broken tape, the waiter's slot, the counter)."""
    k = first_waiter(tape)
    c = int(tape.words[k, 1])
    prod = [j for j in range(len(tape)) if int(tape.words[j, 5]) == c]
    w = tape.words.clone()
    w[prod[-1], 5] = -1
    return dataclasses.replace(tape, words=w), k, c


# ---- handles torn down after the test ------------------------------------------------------------
class Handles:
    """``handles.layer(...)`` / ``.model(...)`` / ``.decoder(...)`` build as ``interp.build_layer`` /
    ``build_model`` / ``build_decoder`` do; every handle is torn down when the test ends."""

    def __init__(self):
        self._all = []

    def _keep(self, h):
        self._all.append(h)
        return h

    def layer(self, *a, **kw):
        from interp import build_layer
        return self._keep(build_layer(*a, **kw))

    def model(self, *a, **kw):
        from interp import build_model
        return self._keep(build_model(*a, **kw))

    def decoder(self, *a, **kw):
        from interp import build_decoder
        return self._keep(build_decoder(*a, **kw))

    def close(self):
        from interp import teardown
        while self._all:
            teardown(self._all.pop())


@pytest.fixture
def handles():
    hs = Handles()
    yield hs
    hs.close()
