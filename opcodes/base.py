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
from .tiling import Tiling, cdiv, next_pow2

WORDS = 16
HEADER = 6          # opcode, wait_a, target_a, wait_b, target_b, signal
MAX_WAITS = 2
#: what the kernel passes after ``ARGS`` to the device function of an opcode with
#: ``Instruction.WAIT_INSIDE``: the instruction's tape words, the counters, this call's number, the
#: poll bound, the profiling switch (``opcodes.common.tape_waits`` takes them)
WAIT_ARGS = ("ins", "cnt_ptr", "epoch", "spin_limit", "PROFILE")
MAX_OPERANDS = WORDS - HEADER
NO_COUNTER = -1


#: element types of kernel pointers, as the tape and codegen name them
DTYPES = ("bf16", "fp32", "i32", "i64")


@dataclass(frozen=True)
class Layout:
    """Everything an instruction needs to know about shapes: the model, the tiling, the cache.

    A layout owns the model's tensors the kernel reads (``TENSORS``: per-layer tensors, reached
    through one table of per-layer offsets, ``wtab``), the shape constants every opcode may use
    (:meth:`constexprs`) and its own serialisation (:meth:`to_json`, :func:`layout_from_json`).
    Scratch buffers are owned by the opcodes that write them (:meth:`Instruction.scratch`).
    """

    cfg: ModelConfig
    tiling: Tiling
    max_seq: int

    #: per-layer tensors: (key, kernel pointer). ``weights["layers"][l][key]`` for the weights,
    #: ``kv_cache[l][0 | 1]`` for ``kc`` / ``vc``; the kernel gets layer 0's address and reaches
    #: layer ``l`` through column :meth:`column` of the offset table (all bf16)
    TENSORS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("in_norm", "n1_ptr"), ("post_norm", "n2_ptr"), ("q", "wq_ptr"), ("k", "wk_ptr"), ("v", "wv_ptr"),
        ("o", "wo_ptr"), ("gate", "wg_ptr"), ("up", "wu_ptr"), ("down", "wd_ptr"), ("kc", "kc_ptr"), ("vc", "vc_ptr"))
    #: whole-model tensors (``weights[key]``, bf16): read only by the opcodes of whole-model
    #: programs (:class:`~opcodes.decoder.DecoderLayout`)
    #: programs of this layout embed the token and end in logits (opcodes.decoder.DecoderLayout)
    WHOLE_MODEL: ClassVar[bool] = False
    #: programs of this layout can end a layer in the down tiles (``Tiling.down_res``: opcodes.rows.RowsLayout)
    DOWN_RES: ClassVar[bool] = False
    MODEL_TENSORS: ClassVar[tuple[tuple[str, str], ...]] = (
        ("embed", "embed_ptr"), ("final_norm", "fnorm_ptr"), ("lm_head", "lmh_ptr"))

    def __post_init__(self):
        if isinstance(self.max_seq, bool) or not isinstance(self.max_seq, int) or self.max_seq <= 0:
            raise ValueError(f"max_seq_len must be a positive int, got {self.max_seq!r}")
        t, c = self.tiling, self.cfg
        if c.hd % t.qkv_rows:
            raise ValueError(f"Tiling.qkv_rows = {t.qkv_rows} must divide hd = {c.hd}")
        if c.hd % self.kv_rows:
            raise ValueError(f"Tiling.kv_rows = {t.kv_rows} must divide hd = {c.hd}")
        if t.o_k and t.o_k < c.q_dim and t.o_k % c.hd:
            raise ValueError(f"Tiling.o_k = {t.o_k} must be a multiple of hd = {c.hd} (a K chunk waits "
                             "for whole attention heads)")
        if t.warp_rows and not (t.row_bytes and Tiling.warp_rows_fit(c.d)):
            raise ValueError(f"Tiling.warp_rows = 1 needs the row loop (row_bytes > 0, got {t.row_bytes}) and d a "
                             f"power of two times 256 (the warp's [d / 256, 256] rows), got d = {c.d}")

    @classmethod
    def column(cls, key: str) -> int:
        """The offset-table column of per-layer tensor ``key``."""
        return [k for k, _ in cls.TENSORS].index(key)

    # ---- derived counts -----------------------------------------------------------
    @property
    def kv_rows(self) -> int:
        """Output rows per K or V tile (``Tiling.kv_rows``, 0: ``qkv_rows``)."""
        return self.tiling.kv_rows or self.tiling.qkv_rows

    @property
    def prefix_splits(self) -> int:
        """Attention splits over the cache prefix ``[0, pos)``: ``attn_splits - 1``; the key at ``pos``
        is the last split's, or with ``Tiling.key_in_reduce`` ATTN_REDUCE's. (0 with ``attn_splits`` 1: the
        one split attends to the prefix and the key at pos.)"""
        return self.tiling.attn_splits - 1

    @property
    def attn_merged(self) -> bool:
        """One attention instruction a KV head (``Tiling.attn_splits`` 1): it writes the merged output
        and there is no ATTN_REDUCE."""
        return self.tiling.attn_splits == 1

    @property
    def attn_instr_splits(self) -> int:
        """ATTN_PARTIAL instructions per KV head: the prefix splits and, unless ATTN_REDUCE takes the
        key at ``pos`` (``Tiling.key_in_reduce``), the last split."""
        return self.tiling.attn_splits - self.tiling.key_in_reduce

    def section_rows(self, sec: int) -> int:
        """Output rows per QKV tile of section ``sec`` (0: q, ``qkv_rows``; 1, 2: k, v, :attr:`kv_rows`)."""
        return self.tiling.qkv_rows if sec == 0 else self.kv_rows

    def n_tiles_per_head(self, sec: int) -> int:
        """QKV tiles per head of section ``sec`` (0: q, 1: k, 2: v)."""
        return self.cfg.hd // self.section_rows(sec)

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

    @property
    def folds_residual(self) -> bool:
        """Whether layers but the last have no RESIDUAL: the next layer's QKV and O / O_REDUCE tiles
        sum ``x1 + dpart`` themselves (``Tiling.res_fold``; never in a tensor-parallel layout, whose
        RESIDUAL is the cross-rank reduction)."""
        return bool(self.tiling.res_fold) and getattr(self, "tp_size", 1) == 1

    def xout_row(self, layer: int) -> int:
        """The row of scratch buffer ``xout`` (RESIDUAL's outputs) holding ``layer``'s output: every
        layer has one, or with :attr:`folds_residual` only the last (row 0)."""
        return 0 if self.folds_residual else layer

    @property
    def n_xout_rows(self) -> int:
        return 1 if self.folds_residual else self.cfg.layers

    def input_regions(self, layer: int, lo: int, hi: int) -> list:
        """The scratch regions holding rows ``[lo, hi)`` of the residual stream entering ``layer``
        (none for layer 0: the caller's x): ``xout`` of the layer before, or with
        :attr:`folds_residual` its ``x1`` and down partials."""
        if layer == 0:
            return []
        d, L = self.cfg.d, layer - 1
        if not self.folds_residual:
            return [Region("xout", L * d + lo, L * d + hi)]
        n = self.n_down_k
        return [Region("x1", L * d + lo, L * d + hi)] + \
            [Region("dpart", (L * n + k) * d + lo, (L * n + k) * d + hi) for k in range(n)]

    @property
    def o_partial(self) -> bool:
        """Whether OPROJ writes per-chunk partials ``opart`` (another opcode adds them and the
        residual) instead of ``x1`` itself: with a split O projection, and always in a
        tensor-parallel layout (``opcodes.tp.TPLayout``), where the ranks' partials are all-reduced."""
        return self.n_o_k > 1

    def constexprs(self, interp: bool = False) -> dict:
        """Kernel constants of the model's shape and of the streaming loops (opcodes add their
        own, :attr:`Instruction.CONSTEXPRS`); ``interp``: running under the Triton interpreter."""
        c, t = self.cfg, self.tiling
        return dict(LAYERS=c.layers, D=c.d, DP=next_pow2(c.d), FFN=c.ffn, NQ=c.n_q, NKV=c.n_kv, HD=c.hd,
                    MAX_SEQ=self.max_seq,
                    EPS=float(c.eps), BK=t.bk, STAGES=t.stages, INTERP=bool(interp), WARP_ROWS=bool(t.warp_rows),
                    RES_FOLD=bool(self.folds_residual), DOWN_CHUNKS=self.n_down_k)

    # ---- serialisation --------------------------------------------------------------
    def extra(self) -> dict:
        """Fields of a subclass beyond (cfg, tiling, max_seq), for :meth:`to_json`."""
        return {}

    def to_json(self) -> dict:
        return {"kind": type(self).__name__, "cfg": self.cfg.to_dict(), "cfg_name": self.cfg.name,
                "tiling": dataclasses.asdict(self.tiling), "max_seq": self.max_seq, "extra": self.extra()}


LAYOUTS: dict[str, type[Layout]] = {"Layout": Layout}


def register_layout(cls: type[Layout]) -> type[Layout]:
    """Make a Layout subclass known to :func:`layout_from_json` by its class name."""
    LAYOUTS[cls.__name__] = cls
    return cls


def layout_from_json(obj: dict) -> Layout:
    kind = obj.get("kind", "Layout")
    if kind not in LAYOUTS:
        raise ValueError(f"unknown layout kind {kind!r} (known: {sorted(LAYOUTS)})")
    cfg = ModelConfig.from_dict(obj["cfg"], name=obj.get("cfg_name", "custom"))
    return LAYOUTS[kind](cfg, Tiling(**obj["tiling"]), obj["max_seq"], **obj.get("extra", {}))


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


class Timing:
    """How the cost models time an opcode (:attr:`Instruction.TIMING`)."""

    STREAM = "stream"     # streams its HBM bytes at the SM's share of the bandwidth
    LATENCY = "latency"   # bound by dependent HBM round trips: :meth:`Instruction.latency_time`
    FIXED = "fixed"       # moves no weights: a fixed time (``FIXED_S`` if measured, else overhead + L2 time)


class Instruction:
    """Base of every opcode. Subclasses are frozen dataclasses of int operands and declare:

    ``NAME``        short opcode name (the CLI and listings use it)
    ``STAGE``       position in the layer's dataflow (plots)
    ``ARGS``        the kernel parameters its device function takes after its operands: pointers
                    (``*_ptr``), constexprs, or ``pos``
    ``CONSTEXPRS``  the constexprs it introduces: name -> function of the layout, defined for every
                    layout (the interpreter kernel holds every opcode's branch, see
                    :func:`kernel_constexprs`)
    ``TIMING``      its timing class (:class:`Timing`), with ``FIXED_S`` / :meth:`latency_time` /
                    :meth:`stream_rows` as the class needs
    ``device``      the ``@triton.jit`` function: ``device(<operands...>, <ARGS...>)``
    ``SCRATCH``     the scratch buffers it writes, name -> dtype (kernel pointer ``<name>_ptr``;
                    shapes from :meth:`scratch_shapes`); ``STATE`` likewise for device buffers that
                    persist across calls; ``TABLES`` read-only tensors it builds (:meth:`tables`)
    :meth:`reads` / :meth:`writes`  the regions of scratch buffers it touches (the verifier)
    :meth:`cost`    bytes and flops (the scheduler), :meth:`run_torch` its semantics (the VM)
    """

    NAME: ClassVar[str] = ""
    OPCODE: ClassVar[int] = 0
    ARGS: ClassVar[tuple[str, ...]] = ()
    STAGE: ClassVar[int] = 0
    CONSTEXPRS: ClassVar[dict] = {}
    SCRATCH: ClassVar[dict[str, str]] = {}    # scratch buffers it writes (every call): name -> dtype
    STATE: ClassVar[dict[str, str]] = {}      # device buffers that persist across calls: name -> dtype
    TABLES: ClassVar[dict[str, str]] = {}     # kernel pointer -> dtype of the tensors :meth:`tables` builds
    VIRTUAL: ClassVar[tuple[str, ...]] = ()   # scratch names that are views of the caller's memory (not allocated)
    TIMING: ClassVar[str] = Timing.STREAM
    #: True: the opcode's branch is in every interpreter kernel; False: only in the kernels of
    #: tapes that hold it (every branch changes the register allocation of the whole loop, so a
    #: rarely used opcode should not tax the kernels that never run it)
    IN_EVERY_KERNEL: ClassVar[bool] = True
    #: True: an opcode of many-rows programs (``opcodes.rows``); a kernel of a tape holding one has only the
    #: tape's opcodes (the one-row branches would tax its registers and are never taken)
    ROWS_OPCODE: ClassVar[bool] = False
    #: True: the opcode belongs to whole-model programs (it embeds tokens or reads the logits) and
    #: applies only to a layout with ``Layout.WHOLE_MODEL``
    WHOLE_MODEL: ClassVar[bool] = False
    FIXED_S: ClassVar[float | None] = None
    #: tensor parallel: True where the instruction's signal is a counter of the PEER rank (same
    #: index in the peer's tape), not of its own rank
    SIGNALS_PEER: ClassVar[bool] = False
    #: tensor parallel: True where the regions :meth:`writes` names are in the PEER rank's buffers
    WRITES_PEER: ClassVar[bool] = False
    #: scratch buffers allocated as several slots, call ``epoch`` using slot ``epoch % n``:
    #: name -> n. :meth:`scratch_shapes` gives the whole allocation; :meth:`reads` / :meth:`writes`
    #: name offsets inside one slot (the verifier checks one slot per call)
    PARITY_SLOTS: ClassVar[dict[str, int]] = {}
    #: tensor parallel: kernel pointers into the PEER rank's memory, pointer -> the peer's buffer it
    #: points at (a scratch buffer of this opcode, e.g. ``{"peer_recv_ptr": "tp_recv"}``); the runtime
    #: binds them to the peer's tensors (``interp.tp``: a CPU loopback, or the peer GPU's mapped memory)
    PEER_POINTERS: ClassVar[dict[str, str]] = {}
    #: how far the device function may be from ``run_torch`` on the same inputs (relative; fp32
    #: sums in another order). Opcodes that round operands to bf16 on purpose allow more.
    TORCH_RTOL: ClassVar[float] = 1e-4
    #: the name of one of its ``CONSTEXPRS`` under which the device function makes the instruction's
    #: waits itself, after its streaming loop's prologue has issued the first weight loads (the
    #: weights do not depend on the step; what the waits guard is read after them). Where the
    #: constexpr is true the kernel skips the instruction's waits and passes :data:`WAIT_ARGS` after
    #: ``ARGS``; the device function (always taking them) then returns ``(counter, seen, t_exec)``
    #: of the first wait not met exactly (counter -1: all met; t_exec: when they were,
    #: under ``PROFILE``) and stores nothing when one is not met (``opcodes.common.tape_waits``).
    WAIT_INSIDE: ClassVar[str | None] = None
    device = None                     # set by subclasses (a triton JITFunction)

    # ---- declarations ---------------------------------------------------------------
    @classmethod
    def applies(cls, lay: Layout) -> bool:
        """Whether programs of this layout can hold the opcode (its buffers exist): a
        ``WHOLE_MODEL`` opcode only those of a whole-model layout."""
        return lay.WHOLE_MODEL or not cls.WHOLE_MODEL

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict[str, tuple[int, ...]]:
        """The shapes of the :attr:`SCRATCH` buffers for ``lay`` (only asked where it applies)."""
        return {}

    @classmethod
    def state_shapes(cls, lay: Layout) -> dict[str, tuple[int, ...]]:
        """The shapes of the :attr:`STATE` buffers for ``lay`` (only asked where it applies)."""
        return {}

    @classmethod
    def tables(cls, lay: Layout, device) -> dict:
        """The tensors of :attr:`TABLES` (read-only, built once per handle), by kernel pointer."""
        return {}

    @classmethod
    def stream_rows(cls, lay: Layout) -> int:
        """Weight rows one streaming block covers (bytes in flight per SM, for the H200 model)."""
        return 0

    @classmethod
    def stream_width(cls, lay: Layout) -> int:
        """Columns one streaming block covers (:meth:`stream_rows` x this x 2 bytes per stage)."""
        return lay.tiling.bk

    def latency_time(self, lay: Layout) -> float:
        raise NotImplementedError

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
    if cls.TIMING not in (Timing.STREAM, Timing.LATENCY, Timing.FIXED):
        raise TypeError(f"{cls.NAME}: TIMING must be one of Timing.STREAM / LATENCY / FIXED, got {cls.TIMING!r}")
    cls.OPCODE = max(BY_OPCODE, default=0) + 1
    REGISTRY[cls.NAME] = cls
    BY_OPCODE[cls.OPCODE] = cls
    return cls


def unregister(cls: type[Instruction]) -> None:
    """Remove the most recently registered opcode (for opcodes defined in tests)."""
    if BY_OPCODE.get(max(BY_OPCODE, default=0)) is not cls:
        raise ValueError(f"{cls.NAME} is not the last registered opcode")
    del REGISTRY[cls.NAME]
    del BY_OPCODE[cls.OPCODE]


# ---- what a set of opcodes needs from the kernel ------------------------------------------

def _merge(into: dict, new: dict, what: str, owner: str) -> None:
    for k, v in new.items():
        if k in into and into[k][1] != v:
            raise TypeError(f"{what} {k!r}: {owner} declares {v!r}, {into[k][0]} declared {into[k][1]!r}")
        into.setdefault(k, (owner, v))


#: elements a buffer may hold: the kernels index them with int32 offsets (a layer's base times its slice)
MAX_BUFFER_ELEMENTS = 2**31 - 1


def _fits(bufs: dict, what: str, lay: Layout) -> dict:
    for name, (shape, _) in bufs.items():
        n = math.prod(shape)
        if n > MAX_BUFFER_ELEMENTS:
            rows = getattr(lay, "rows", None)
            raise ValueError(
                f"{what} {name!r} of shape {shape} holds {n} elements, more than the kernel's int32 offsets reach "
                f"({MAX_BUFFER_ELEMENTS}); {lay.cfg.layers} layers of d {lay.cfg.d}, ffn {lay.cfg.ffn}"
                + (f" at {rows} rows a step: use fewer rows a step (a smaller bucket)" if rows else "")
                + " or fewer layers a launch")
    return bufs


def scratch_buffers(lay: Layout, classes) -> dict[str, tuple[tuple[int, ...], str]]:
    """The scratch buffers the opcodes ``classes`` write, by name: (shape, dtype). Two opcodes
    that declare one buffer must declare it alike; none may hold more than :data:`MAX_BUFFER_ELEMENTS`."""
    out: dict = {}
    for cls in classes:
        shapes = cls.scratch_shapes(lay)
        _merge(out, {n: (tuple(shapes[n]), dt) for n, dt in cls.SCRATCH.items()}, "scratch buffer", cls.NAME)
    return _fits({k: v for k, (_, v) in out.items()}, "scratch buffer", lay)


def state_buffers(lay: Layout, classes) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict = {}
    for cls in classes:
        shapes = cls.state_shapes(lay)
        _merge(out, {n: (tuple(shapes[n]), dt) for n, dt in cls.STATE.items()}, "state buffer", cls.NAME)
    return _fits({k: v for k, (_, v) in out.items()}, "state buffer", lay)


def kernel_classes(used=()) -> list[type[Instruction]]:
    """The opcodes an interpreter kernel dispatches: every registered one with
    ``IN_EVERY_KERNEL``, and the others in ``used`` (the opcodes of the tape), by opcode number. A tape of
    many-rows opcodes (``ROWS_OPCODE``) gets its own opcodes only."""
    used = set(used)
    if any(cls.ROWS_OPCODE for cls in used):
        return [cls for cls in REGISTRY.values() if cls in used]
    return [cls for cls in REGISTRY.values() if cls.IN_EVERY_KERNEL or cls in used]


def kernel_constexprs(lay: Layout, interp: bool = False, used=()) -> dict:
    """Values of the layout's constexprs and of the kernel's opcodes' (:func:`kernel_classes`)."""
    out = {k: ("layout", v) for k, v in lay.constexprs(interp).items()}
    for cls in kernel_classes(used):
        _merge(out, {k: f(lay) for k, f in cls.CONSTEXPRS.items()}, "constexpr", cls.NAME)
    return {k: v for k, (_, v) in out.items()}


#: pointers that change with every call: the layer-0 input and the last layer's output
PER_CALL_POINTERS = {"x_ptr": "bf16", "out_ptr": "bf16"}
#: tensor parallel: the pointers of a kernel that holds a ``SIGNALS_PEER`` opcode: the peer's counters
#: (where such an opcode's signal goes), per counter of this rank 1 if the peer signals it (a wait
#: on it may find the counter past its target: the peer may be a call ahead, ``schedule.verify``),
#: and the time bound of every wait (one int64, nanoseconds; ``interp.tp`` sets it)
TP_POINTERS = {"peer_cnt_ptr": "i32", "peer_sig_ptr": "i32", "tp_wait_ptr": "i64"}


def signals_peer(classes) -> bool:
    """Whether a kernel of these opcodes is a tensor-parallel one (it signals the peer's counters)."""
    return any(cls.SIGNALS_PEER for cls in classes)
#: the per-layer offset table of :attr:`Layout.TENSORS`
TABLE_POINTER = ("wtab_ptr", "i64")


def pointer_types(lay: Layout, used=()) -> dict[str, str]:
    """Every kernel pointer an owner declares, with its element type, in the order of the
    kernel's address table: the offset table and the layout's tensors, then per opcode (in
    opcode order) its tables, scratch and state, then the whole-model tensors."""
    out: dict = {TABLE_POINTER[0]: ("runtime", TABLE_POINTER[1])}
    _merge(out, {p: "bf16" for _, p in lay.TENSORS}, "pointer", type(lay).__name__)
    for cls in kernel_classes(used):
        own = {f"{n}_ptr": dt for n, dt in {**cls.SCRATCH, **cls.STATE}.items() if n not in cls.VIRTUAL}
        peer = {p: {**cls.SCRATCH, **cls.STATE}[b] for p, b in cls.PEER_POINTERS.items()}
        _merge(out, {**cls.TABLES, **own, **peer}, "pointer", cls.NAME)
    _merge(out, {p: "bf16" for _, p in lay.MODEL_TENSORS}, "pointer", type(lay).__name__)
    if signals_peer(kernel_classes(used)):
        _merge(out, dict(TP_POINTERS), "pointer", "the tensor-parallel runtime")
    return {k: v for k, (_, v) in out.items()}


def kernel_pointers(lay: Layout, used=()) -> dict[str, str]:
    """The build-time pointers the kernel's opcodes' (:func:`kernel_classes`) device functions take,
    with their element types, in address-table order. A pointer nobody declares is an error naming
    the opcode."""
    known = pointer_types(lay, used)
    taken = set()
    for cls in kernel_classes(used):
        for a in cls.ARGS:
            if a.endswith("_ptr") and a not in PER_CALL_POINTERS:
                if a not in known:
                    raise TypeError(f"opcode {cls.NAME} takes pointer {a!r}, which no opcode or layout declares "
                                    f"(declared: {sorted(known)})")
                taken.add(a)
    if signals_peer(kernel_classes(used)):
        taken.update(TP_POINTERS)
    return {k: v for k, v in known.items() if k in taken}
