"""The instruction base class, the opcode registry and the buffer layout.

An instruction is a frozen dataclass whose fields are its operands (ints). The registry is the
single source of truth for opcode numbers, the tape word layout, the interpreter's dispatch
(generated from it, see ``interp/codegen.py``) and the VM: adding an opcode is one new module
that defines a subclass decorated with :func:`register`, plus its import in ``opcodes/__init__``.

Tape words of one instruction (``WORDS`` int32):

    [opcode, wait_a, target_a, wait_b, target_b, signal, operand0 .. operand{MAX_OPERANDS-1}]

``wait_*`` / ``signal`` are counter indices (-1: none); targets are per call: the kernel waits
until ``counter >= target * epoch`` so counters never need a reset between calls.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import ClassVar

from .config import ModelConfig

WORDS = 16
HEADER = 6          # opcode, wait_a, target_a, wait_b, target_b, signal
MAX_WAITS = 2
MAX_OPERANDS = WORDS - HEADER
NO_COUNTER = -1


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Tiling:
    """How a layer is cut into instructions. Every field is a kernel constexpr."""

    qkv_rows: int = 32      # output rows per QKV tile: qkv_rows/2 from each RoPE half of one head
    o_rows: int = 32        # output rows per O-projection tile
    o_k: int = 0            # n_q*hd columns per O-projection tile (0: all, no split)
    gu_rows: int = 16       # rows of gate AND of up per gate/up tile
    down_rows: int = 32     # output rows per down-projection tile
    down_k: int = 7168      # ffn columns (K range) per down-projection tile
    red_rows: int = 1024    # rows per final residual reduction
    attn_splits: int = 16   # splits of the key sequence per KV head
    attn_block: int = 128   # keys per attention inner block
    # software-pipelining depth of the attention key loop: 3 keeps two 128-key K/V blocks in
    # flight, so a ~270-key split costs ~2 loaded HBM round trips instead of one per block
    # (H200: 12.3 -> 7.4 us per split, 446 -> 436 us per layer; bench/NOTES.md v7)
    attn_stages: int = 3
    bk: int = 512           # columns streamed per inner-loop iteration of a GEMV tile
    num_warps: int = 8
    # software-pipelining depth of the GEMV streaming loops (1: off). 6 keeps five 32 KB blocks in
    # flight per SM (shared memory 139 -> 179 KB): an SM streams faster where fewer than ~115 SMs
    # stream (H200 run 24: 425.9 -> 421.4 us per layer; bench/NOTES.md v14)
    stages: int = 6

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "o_k" and isinstance(v, int) and not isinstance(v, bool) and v == 0:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Tiling.{f.name} must be a positive int, got {v!r}")
        for k in ("qkv_rows", "o_rows", "gu_rows", "down_rows", "red_rows", "attn_block", "bk", "num_warps"):
            v = getattr(self, k)
            if v & (v - 1):
                raise ValueError(f"Tiling.{k} must be a power of two, got {v}")
        if self.o_k < 0:
            raise ValueError(f"Tiling.o_k must be >= 0, got {self.o_k}")
        if self.qkv_rows < 2:
            raise ValueError("Tiling.qkv_rows must be >= 2 (RoPE pairs)")
        if self.attn_splits < 2:
            raise ValueError("Tiling.attn_splits must be >= 2 (the last split is the key at pos)")
        if self.attn_block < 16:
            raise ValueError("Tiling.attn_block must be >= 16 (tl.dot)")

    @classmethod
    def for_config(cls, cfg: ModelConfig, **overrides) -> "Tiling":
        """The default tiling clamped to the model's dimensions; ``overrides`` win."""
        base = cls()
        d, ffn = cfg.d, cfg.ffn
        clamped = dict(
            qkv_rows=min(base.qkv_rows, cfg.hd),
            o_rows=min(base.o_rows, next_pow2(d)),
            gu_rows=min(base.gu_rows, next_pow2(ffn)),
            down_rows=min(base.down_rows, next_pow2(d)),
            # equal K chunks (28672 -> 4 x 7168, 8192 -> 2 x 4096), a multiple of the streaming width
            down_k=min(ffn, cdiv(cdiv(ffn, cdiv(ffn, base.down_k)), 512) * 512),
            red_rows=min(base.red_rows, next_pow2(d)),
            bk=max(16, min(base.bk, next_pow2(min(d, ffn, cfg.q_dim)))),
        )
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Tiling fields {sorted(unknown)}")
        clamped.update(overrides)
        return dataclasses.replace(base, **clamped)


@dataclass(frozen=True)
class Layout:
    """Everything an instruction needs to know about shapes: the model, the tiling, the cache."""

    cfg: ModelConfig
    tiling: Tiling
    max_seq: int

    def __post_init__(self):
        if isinstance(self.max_seq, bool) or not isinstance(self.max_seq, int) or self.max_seq <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {self.max_seq!r}")
        t, c = self.tiling, self.cfg
        if c.hd % t.qkv_rows:
            raise ValueError(f"Tiling.qkv_rows = {t.qkv_rows} must divide hd = {c.hd}")
        if t.o_k and t.o_k < c.q_dim and t.o_k % c.hd:
            raise ValueError(f"Tiling.o_k = {t.o_k} must be a multiple of hd = {c.hd} (a K chunk waits "
                             "for whole attention heads)")

    # ---- derived counts -----------------------------------------------------------
    @property
    def n_qkv_tiles_per_head(self) -> int:
        return self.cfg.hd // self.tiling.qkv_rows

    @property
    def n_down_k(self) -> int:
        return cdiv(self.cfg.ffn, self.tiling.down_k)

    @property
    def o_k(self) -> int:
        """Columns of n_q*hd per O-projection tile."""
        k = self.tiling.o_k
        return self.cfg.q_dim if (k == 0 or k >= self.cfg.q_dim) else k

    @property
    def n_o_k(self) -> int:
        return cdiv(self.cfg.q_dim, self.o_k)

    def buffers(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Scratch buffers the kernel writes, by name: (shape, dtype). ``xout`` and ``kv_new_*``
        are symbolic for the verifier: the last layer's ``xout`` row is the returned tensor and
        ``kv_new_k/v`` is the cache row at ``pos``."""
        c, t, L = self.cfg, self.tiling, self.cfg.layers
        return {
            "q": ((L, c.q_dim), "fp32"),
            "kv_new_k": ((L, c.kv_dim), "bf16"),
            "kv_new_v": ((L, c.kv_dim), "bf16"),
            "part_o": ((L, c.n_q, t.attn_splits, c.hd), "fp32"),
            "part_ml": ((L, c.n_q, t.attn_splits, 2), "fp32"),
            "attn": ((L, c.q_dim), "fp32"),
            "x1": ((L, c.d), "fp32"),
            **({"opart": ((L, self.n_o_k, c.d), "fp32")} if self.n_o_k > 1 else {}),
            "act": ((L, c.ffn), "fp32"),
            "dpart": ((L, self.n_down_k, c.d), "fp32"),
            "xout": ((L, c.d), "bf16"),
        }

    def buffer_numel(self, name: str) -> int:
        return math.prod(self.buffers()[name][0])


@dataclass(frozen=True)
class Region:
    """A flat half-open element range ``[lo, hi)`` of a named buffer."""

    buf: str
    lo: int
    hi: int


@dataclass(frozen=True)
class Cost:
    hbm_bytes: int      # bytes that must come from HBM (weights, KV)
    l2_bytes: int       # activation bytes read/written (L2-resident)
    flops: int


class Instruction:
    """Base of every opcode. Subclasses are frozen dataclasses of int operands and define:

    ``NAME``      short opcode name (the CLI and listings use it)
    ``ARGS``      the kernel parameters its device function takes after its operands
    ``device``    the ``@triton.jit`` function: ``device(<operands...>, <ARGS...>)``
    ``reads`` / ``writes``  the regions of scratch buffers it touches (for the verifier)
    ``cost``      bytes and flops (for the scheduler)
    ``run_torch`` its semantics on torch tensors (for the VM)
    """

    NAME: ClassVar[str] = ""
    OPCODE: ClassVar[int] = 0
    ARGS: ClassVar[tuple[str, ...]] = ()
    STAGE: ClassVar[int] = 0          # position in the layer's dataflow, for plots
    device = None                     # set by subclasses (a triton JITFunction)

    # ---- encoding -----------------------------------------------------------------
    @classmethod
    def operand_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    def operands(self) -> tuple[int, ...]:
        return tuple(getattr(self, n) for n in self.operand_names())

    @classmethod
    def decode(cls, words) -> "Instruction":
        names = cls.operand_names()
        return cls(*[int(w) for w in words[: len(names)]])

    def check_operands(self, lay: Layout) -> list[str]:
        """Problems with operand ranges, as messages ('' list when fine)."""
        return []

    def __str__(self) -> str:
        ops = " ".join(f"{n}={v}" for n, v in zip(self.operand_names(), self.operands()))
        return f"{self.NAME} {ops}"

    # ---- semantics (overridden) ---------------------------------------------------
    def reads(self, lay: Layout) -> list[Region]:
        return []

    def writes(self, lay: Layout) -> list[Region]:
        return []

    def cost(self, lay: Layout) -> Cost:
        raise NotImplementedError

    def run_torch(self, lay: Layout, st) -> None:
        raise NotImplementedError


def in_range(name: str, v: int, hi: int, lo: int = 0) -> list[str]:
    """``[]`` or the message for an operand outside ``[lo, hi)`` (for ``check_operands``)."""
    return [] if lo <= v < hi else [f"{name} {v} not in [{lo}, {hi})"]


def tile_start(name: str, v: int, step: int, hi: int) -> list[str]:
    """``[]`` or the message for a tile start that is not a multiple of ``step`` in ``[0, hi)``."""
    return [] if (0 <= v < hi and v % step == 0) else [f"{name} {v} not a multiple of {step} in [0, {hi})"]


REGISTRY: dict[str, type[Instruction]] = {}
BY_OPCODE: dict[int, type[Instruction]] = {}


def register(cls: type[Instruction]) -> type[Instruction]:
    """Give an opcode class the next opcode number. Numbers start at 1 (0 is never valid)."""
    if not cls.NAME:
        raise TypeError(f"{cls.__name__} has no NAME")
    if cls.NAME in REGISTRY:
        raise TypeError(f"opcode name {cls.NAME!r} registered twice")
    n = len(cls.operand_names())
    if n > MAX_OPERANDS:
        raise TypeError(f"{cls.NAME} has {n} operands; the tape holds at most {MAX_OPERANDS}")
    if cls.device is None:
        raise TypeError(f"{cls.NAME} has no device function")
    cls.OPCODE = len(REGISTRY) + 1
    REGISTRY[cls.NAME] = cls
    BY_OPCODE[cls.OPCODE] = cls
    return cls
