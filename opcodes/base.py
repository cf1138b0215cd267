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
from dataclasses import dataclass
from typing import ClassVar

from .config import ModelConfig

WORDS = 16
HEADER = 6          # opcode, wait_a, target_a, wait_b, target_b, signal
MAX_WAITS = 2
#: what the kernel passes after ``ARGS`` to the device function of an opcode with
#: ``Instruction.WAIT_INSIDE``: the instruction's tape words, the counters, this call's number, the
#: poll bound, the profiling switch (``opcodes.common.tape_waits`` takes them)
WAIT_ARGS = ("ins", "cnt_ptr", "epoch", "spin_limit", "PROFILE")
MAX_OPERANDS = WORDS - HEADER
NO_COUNTER = -1


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: bytes per pipeline stage of the row-streaming GEMV loop where ``Tiling.for_config`` picks it
ROW_BYTES = 32768
#: the SMs of the H200 the defaults are tuned on (``Tiling.for_config``: gate/up tiles where d <= 2048)
H200_SMS = 132


@dataclass(frozen=True)
class Tiling:
    """How a layer is cut into instructions. Every field is a kernel constexpr."""

    qkv_rows: int = 32      # output rows per QKV tile: qkv_rows/2 from each RoPE half of one head
    # output rows per K or V tile (0: qkv_rows). The list scheduler puts the K/V tiles after the Q
    # tiles (lower bottom level), so they are the tail wave of the QKV stage that every last attention
    # split waits for: smaller K/V tiles spread that tail over more SMs
    kv_rows: int = 0
    o_rows: int = 32        # output rows per O-projection tile
    # columns streamed per inner-loop iteration of an O tile (0: bk). With o_rows=64, o_bk=256 keeps
    # the pipeline's bytes per stage while halving the tile count (the 70B shape's O in one wave)
    o_bk: int = 0
    o_k: int = 0            # n_q*hd columns per O-projection tile (0: all, no split)
    gu_rows: int = 16       # rows of gate AND of up per gate/up tile
    # > 0: that many gate/up tiles, the ffn rows split as evenly as the row loop's stages allow (each
    # at most gu_rows), e.g. 132 for every SM of an H200 where ffn / gu_rows = 128 would leave 4 idle.
    # Needs the row loop (row_bytes) and one down K chunk. 0: ffn / gu_rows tiles of gu_rows rows
    gu_tiles: int = 0
    down_rows: int = 32     # output rows per down-projection tile
    # columns a down tile streams per pipeline stage (0: bk): down_rows=64, down_bk=256 on the 70B TP
    # shard (TPLayout.default_tiling; 20 layers -1.2%, run 83; the 70B layer on one GPU unchanged)
    down_bk: int = 0
    down_k: int = 7168      # ffn columns (K range) per down-projection tile
    red_rows: int = 1024    # rows per final residual reduction
    # splits of the key sequence per KV head; 1: one ATTN_PARTIAL a KV head attends to every key [0, pos] and
    # writes the merged output itself (no ATTN_REDUCE: one dependency hop less, one longer instruction)
    attn_splits: int = 16
    # 1: ATTN_REDUCE attends to the key at pos itself (the K/V tiles' new row) while it merges the
    # prefix splits; there is no last split, so the merge follows the K/V tiles directly instead of
    # a one-key split in between (the TP rank's K/V tail: run 79)
    key_in_reduce: int = 0
    attn_block: int = 128   # keys per attention inner block
    # software-pipelining depth of the attention key loop: 3 keeps two 128-key K/V blocks in
    # flight, so a ~270-key split costs ~2 loaded HBM round trips instead of one per block
    # (H200: 12.3 -> 7.4 us per split, 446 -> 436 us per layer; bench/NOTES.md v7)
    attn_stages: int = 3
    bk: int = 512           # columns streamed per inner-loop iteration of a GEMV tile
    num_warps: int = 8
    # software-pipelining depth of the GEMV streaming loops (1: off). 6 keeps five 32 KB blocks in
    # flight per SM (shared memory 139 -> 179 KB): an SM streams faster where fewer than ~115 SMs
    # stream (faster on the H200 than 4 or 5: bench/NOTES.md v14)
    stages: int = 6
    # the loop of GATE_UP and LM_HEAD: 0 streams [rows, bk] blocks of a tile and sums over K at its
    # end (the loop of every GEMV); > 0 streams whole rows, about ``row_bytes`` bytes per pipeline
    # stage, each row summed as it arrives, so a tile can have any number of rows without more
    # registers (Tiling.for_config: for d <= 2048, with coarser tiles). QKV, O and DOWN measured
    # slower with it (bench/NOTES.md v30) and always use the column loop
    row_bytes: int = 0
    # 1: a layer's RESIDUAL is folded into the next layer's readers: its QKV and O (or O_REDUCE)
    # tiles sum x1 and the down partials themselves (in RESIDUAL's order, rounded as it rounds), so
    # the next layer waits on the down projection directly: one dependency hop less per layer but
    # the last. Tiling.for_config: on for d <= 2048 (1B decoder -2.6% at pos 1024); the 8B shape
    # measured +4.0% and 16 layers of the 70B shape +1.5% with it (bench/NOTES.md v31, run 51)
    res_fold: int = 0
    # 1: each DOWN tile makes its waits inside its pipelined loop (Instruction.WAIT_INSIDE): it streams
    # whole rows of its K chunk, the loop's prologue issues its first weight blocks before the waits,
    # and the first iteration waits and reads the act chunk. Tiling.for_config: on for d <= 2048 (the
    # 1B decoder -0.8..-1.5%, runs 173-174); the 8B shape +5.5..+6.0%, and GATE_UP or O waiting inside
    # lost on the 1B alone and beside it (bench/NOTES.md v96-v102)
    down_wait: int = 0
    # 1: the row loop (row_bytes) of GATE_UP and LM_HEAD sums each row inside one warp
    # (opcodes.common.warp_rows_dot) instead of across the CTA's warps: needs d a power of two times
    # 256 (Layout checks); one row a warp where a stage's rows are a multiple of num_warps (the 1B:
    # 4 gate/up rows, 8 LM head rows a stage on 4 warps), else a row's warps still share its sum
    warp_rows: int = 0
    # 1: every 16-byte async copy (the weight streams' cp.async, the attention's K/V prefix) carries an L2
    # evict_first policy (interp.l2policy: Triton 3.6 drops a load's eviction_policy when it pipelines it
    # into cp.async), so the ~120 MB a layer streams stop evicting from the L2 what is read again: the
    # kernel's code and constants, the activations and the counters. A variant not yet measured on a GPU
    # (bench/NOTES.md v142); the Triton interpreter runs the kernel without it
    l2_first: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in ("o_k", "row_bytes", "res_fold", "kv_rows", "o_bk", "key_in_reduce", "down_bk", "down_wait", "gu_tiles", "warp_rows", "l2_first") and isinstance(v, int) and not isinstance(v, bool) \
                    and v == 0:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Tiling.{f.name} must be a positive int, got {v!r}")
        for k in ("qkv_rows", "kv_rows", "o_rows", "gu_rows", "down_rows", "red_rows", "attn_block", "bk", "num_warps",
                  "o_bk", "down_bk"):
            v = getattr(self, k)
            if v & (v - 1):
                raise ValueError(f"Tiling.{k} must be a power of two, got {v}")
        if self.o_k < 0:
            raise ValueError(f"Tiling.o_k must be >= 0, got {self.o_k}")
        for k in ("res_fold", "key_in_reduce", "down_wait", "warp_rows", "l2_first"):
            if getattr(self, k) not in (0, 1):
                raise ValueError(f"Tiling.{k} must be 0 or 1, got {getattr(self, k)}")
        if self.qkv_rows < 2:
            raise ValueError("Tiling.qkv_rows must be >= 2 (RoPE pairs)")
        for k in ("o_bk", "down_bk"):
            if 0 < getattr(self, k) < 16:
                raise ValueError(f"Tiling.{k} must be 0 (bk) or >= 16, got {getattr(self, k)}")
        if self.kv_rows == 1:
            raise ValueError("Tiling.kv_rows must be 0 (qkv_rows) or >= 2 (RoPE pairs)")
        if self.attn_splits == 1 and self.key_in_reduce:
            raise ValueError("Tiling.attn_splits = 1 (one attention instruction a KV head, no merge) cannot take "
                             "Tiling.key_in_reduce = 1 (the merge attends to the key at pos)")
        if self.attn_block < 16:
            raise ValueError("Tiling.attn_block must be >= 16 (tl.dot)")

    @staticmethod
    def warp_rows_fit(d: int) -> bool:
        """Whether ``warp_rows`` can stream rows of ``d`` columns: d is 256 times a power of two (a warp
        holds a row as [d / 256, 256])."""
        return d % 256 == 0 and next_pow2(d // 256) == d // 256

    def rows_per_block(self, k: int, mats: int, rows: int, row_bytes: int | None = None) -> int:
        """Rows per pipeline stage of a row-streaming GEMV (``row_bytes`` > 0; else 0): ``mats``
        matrices' rows of ``k`` columns (padded to a power of two), at most the tile's ``rows``.
        ``row_bytes``: the bytes a stage (default ``Tiling.row_bytes``), for a loop that streams whole
        rows whatever the layout's other loops do (DOWN's waiting loop)."""
        rb = self.row_bytes if row_bytes is None else row_bytes
        if not rb:
            return 0
        per = max(1, rb // (2 * mats * next_pow2(k)))
        return max(1, min(1 << (per.bit_length() - 1), next_pow2(rows)))

    @classmethod
    def from_spec(cls, cfg: ModelConfig, spec: str, max_seq: int | None = None) -> "Tiling":
        """``for_config`` with the overrides of a ``"name=value,name=value"`` string (integers),
        as the command line's ``--tiling`` takes them."""
        return cls.for_config(cfg, max_seq=max_seq, **cls.parse_spec(spec))

    @staticmethod
    def parse_spec(spec: str) -> dict:
        """The overrides of a ``"name=value,name=value"`` string (integers; the names are checked
        where they are applied)."""
        over = {}
        for item in filter(None, spec.replace(" ", "").split(",")):
            k, _, v = item.partition("=")
            if not v:
                raise ValueError(f"--tiling: expected name=value, got {item!r}")
            try:
                over[k] = int(v)
            except ValueError:
                raise ValueError(f"--tiling: {k} must be an integer, got {v!r}") from None
        return over

    @classmethod
    def for_config(cls, cfg: ModelConfig, max_seq: int | None = None, **overrides) -> "Tiling":
        """The default tiling clamped to the model's dimensions; ``overrides`` win. ``max_seq``: the KV
        cache's positions, where a choice depends on them (the attention of short caches, below)."""
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
        if d > 2048:
            # the key at pos merged by ATTN_REDUCE, no one-key split: the 8B decoder -1.3%, a TP rank of
            # the 70B shape -1.1%, 16 layers of it -1.2% with the O tiles below; the 1B decoder +2.4%
            # (its QKV is one wave: the prefix splits end with the last split; bench/NOTES.md v48)
            clamped.update(key_in_reduce=1)
        if 2048 < d <= 4096:
            # half the attention splits (the 8B shape: 64 prefix partials, one round on the ~72 SMs the
            # QKV stage's second wave leaves idle, instead of 128 in two): 4332-4405 -> 4265-4281 us at
            # pos 1024, 4308-4367 -> 4256-4284 at pos 128 (-1.6..-1.8% and -1.7% by medians, alternated,
            # runs 137-138; -1.2% on another card, run 141); the 70B layer measured -0.4% (its spread),
            # the 1B +1.0% (bench/NOTES.md v80, v77)
            clamped.update(attn_splits=8)
        if cdiv(d, 2 * base.o_rows) >= 128:
            # O tiles of twice the rows at half the width (the same 32 KB per pipeline stage) where O
            # keeps >= 128 of them: the 70B shape's O in one wave of 1 MB tiles (a TP rank's: 512 KB).
            # TP -1.3%, the 70B layer -0.4..-0.9%, its 16 layers -0.7% (bench/NOTES.md v45, runs 79-82)
            clamped.update(o_rows=2 * base.o_rows, o_bk=max(16, clamped["bk"] // 2))
        if d <= 2048:
            # small d: gate/up and the LM head stream whole rows in coarse tiles (one ~64-row gate/up
            # tile per SM, below), 5 stages (bench/NOTES.md v28-v30). Not at d 4096: the 8B shape measured
            # 5018 us with the row loop against 4425 without (run 47). The residual folded into the
            # next layer's readers: 1B 1005.0 -> 980.0 us at pos 1024 (run 51); the 8B shape +4.0%.
            # CTAs of 4 warps at half the streaming width (the same work per thread): the 1B's one-wave
            # stages are latency-bound and half the threads join each reduction and barrier: 1B
            # 979.6-986.8 -> 949.3-952.6 us at pos 1024 and 979.6-981.1 -> 950.9 at pos 128 (-3.0..-3.2%,
            # runs 96-97); the 8B shape +3.2% (run 98), so not there (bench/NOTES.md v58). Under 4 warps,
            # O and down in half-height tiles, down in one K chunk (one wave of 128 tiles each, half the
            # bytes per tile, one partial per row): 957.6-962.8 -> 921.7-931.2 us at pos 1024 (v59, run 101).
            # Down tiles wait inside their loop (down_wait): 919.7 / 922.7 -> 912.1 / 909.0 us at pos 1024,
            # 914.7-919.2 -> 904.6-909.7 at 128 (runs 173-174, v101-v102)
            clamped.update(row_bytes=ROW_BYTES, stages=5, gu_rows=min(64, next_pow2(ffn)), res_fold=1,
                           num_warps=4, bk=min(256, clamped["bk"]), o_rows=min(16, clamped["o_rows"]),
                           down_rows=min(16, clamped["down_rows"]), down_k=ffn, down_wait=1)
            if cls.warp_rows_fit(d):
                # each row of the gate/up and LM head loops summed inside one warp (no shared memory, no
                # barrier a stage): 1B 906.3-909.7 -> 892.6-896.3 us at pos 128 (-1.7%, run 219; GATE_UP
                # 18.9 -> 18.2 us a tile; bench/NOTES.md v121)
                clamped.update(warp_rows=1)
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Tiling fields {sorted(unknown)}")
        clamped.update(overrides)
        t = dataclasses.replace(base, **clamped)
        if d <= 2048 and max_seq is not None and "attn_splits" not in overrides and not t.key_in_reduce:
            # a cache of at most AttnPartial.MERGED_MAX_SEQ positions: one attention instruction a KV head
            # over every key, no merge stage (it measured faster or equal at every such position)
            from .attn_partial import AttnPartial   # (attn_partial imports this module: its fact, asked at call time)
            if max_seq <= AttnPartial.MERGED_MAX_SEQ:
                t = dataclasses.replace(t, attn_splits=1)
        if d <= 2048 and "gu_tiles" not in overrides:
            # gate/up on every SM of the H200 where ffn / gu_rows tiles would leave some idle (the 1B: 132
            # tiles of 64 and 60 rows, not 128 of 64): 910.4 -> 904.9 us at pos 128, -0.3..-0.4% at 1024
            # (runs 190-191, bench/NOTES.md v109)
            from .gate_up import GateUp         # (gate_up imports this module: its fact, asked at call time)
            bounds = GateUp.tile_bounds(cfg, t)
            if not isinstance(bounds, str) and bounds[0] < H200_SMS <= bounds[1]:
                t = dataclasses.replace(t, gu_tiles=H200_SMS)
        return t

    @classmethod
    def short_prefix(cls, cfg: ModelConfig, max_seq: int) -> int:
        """``P`` > 0 where the positions ``[0, P)`` of a cache of ``max_seq`` run faster on the default
        tiling of a cache of ``P`` positions (``for_config(cfg, max_seq=P)``) than on the cache's own
        (``for_config(cfg, max_seq=max_seq)``): a decoder may hold a second tape of it for them (both
        tapes are correct at every position). 0 where the two tilings are the same."""
        from .attn_partial import AttnPartial   # (attn_partial imports this module: its fact, asked at call time)
        p = AttnPartial.MERGED_MAX_SEQ
        if max_seq <= p or cls.for_config(cfg, max_seq=p) == cls.for_config(cfg, max_seq=max_seq):
            return 0
        return p


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
                    RES_FOLD=bool(self.folds_residual), DOWN_CHUNKS=self.n_down_k,
                    L2_FIRST=bool(t.l2_first) and not interp)

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
    #: rarely used opcode should not tax the kernels that never run it; bench/NOTES.md v21, v25)
    IN_EVERY_KERNEL: ClassVar[bool] = True
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


def scratch_buffers(lay: Layout, classes) -> dict[str, tuple[tuple[int, ...], str]]:
    """The scratch buffers the opcodes ``classes`` write, by name: (shape, dtype). Two opcodes
    that declare one buffer must declare it alike."""
    out: dict = {}
    for cls in classes:
        shapes = cls.scratch_shapes(lay)
        _merge(out, {n: (tuple(shapes[n]), dt) for n, dt in cls.SCRATCH.items()}, "scratch buffer", cls.NAME)
    return {k: v for k, (_, v) in out.items()}


def state_buffers(lay: Layout, classes) -> dict[str, tuple[tuple[int, ...], str]]:
    out: dict = {}
    for cls in classes:
        shapes = cls.state_shapes(lay)
        _merge(out, {n: (tuple(shapes[n]), dt) for n, dt in cls.STATE.items()}, "state buffer", cls.NAME)
    return {k: v for k, (_, v) in out.items()}


def kernel_classes(used=()) -> list[type[Instruction]]:
    """The opcodes an interpreter kernel dispatches: every registered one with
    ``IN_EVERY_KERNEL``, and the others in ``used`` (the opcodes of the tape), by opcode number."""
    used = set(used)
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
#: on it may find the counter past its target: the peer may be a call ahead, ``schedule.verify.verify_tp``),
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
