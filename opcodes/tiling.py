"""How a layer is cut into instructions: :class:`Tiling` (every field a kernel constexpr), its
defaults per model shape (:data:`DEFAULTS`, one table: condition, field values, reason) and the
knobs no default sets (:data:`EXPERIMENTAL`).

``Tiling.for_config(cfg)`` starts from the field defaults below and applies the rows of
:data:`DEFAULTS` in order; the caller's overrides win. The measurements in the reasons are H200
times of the default build (the 1B, 8B and 70B shapes: ``PRESETS`` llama3.2-1b, llama3-8b,
llama70b-layer; "TP": a rank of two).
"""
from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass
from typing import Callable

from .config import ModelConfig


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


#: bytes per pipeline stage of the row-streaming GEMV loop where a default turns it on
ROW_BYTES = 32768
#: the SMs of the H200 the defaults are tuned on (the gate/up tile count where d <= 2048)
H200_SMS = 132

#: fields where 0 is allowed: off, or "take another field's value" (each field's comment says which)
_ZERO_ALLOWED = ("kv_rows", "o_bk", "o_k", "gu_tiles", "down_bk", "key_in_reduce", "row_bytes", "res_fold",
                "down_wait", "warp_rows", "attn_pairs", "down_res", "attn_kg")
#: fields that are switches (0 or 1)
_SWITCHES = ("res_fold", "key_in_reduce", "down_wait", "warp_rows", "down_res")


@dataclass(frozen=True)
class Tiling:
    """How a layer is cut into instructions. Every field is a kernel constexpr."""

    qkv_rows: int = 32      # output rows per QKV tile: qkv_rows/2 from each RoPE half of one head
    kv_rows: int = 0        # output rows per K or V tile (0: qkv_rows)
    o_rows: int = 32        # output rows per O-projection tile
    o_bk: int = 0           # columns an O tile streams per pipeline stage (0: bk)
    # n_q*hd columns per O-projection tile (0: all, no split); a split writes per-chunk partials that
    # O_REDUCE adds to the residual
    o_k: int = 0
    gu_rows: int = 16       # rows of gate AND of up per gate/up tile (with gu_tiles: at most)
    # > 0: that many gate/up tiles, the ffn rows split as evenly as the row loop's stages allow (each
    # at most gu_rows). Needs the row loop (row_bytes) and one down K chunk. 0: ffn / gu_rows tiles
    # of gu_rows rows
    gu_tiles: int = 0
    down_rows: int = 32     # output rows per down-projection tile
    down_bk: int = 0        # columns a down tile streams per pipeline stage (0: bk)
    down_k: int = 7168      # ffn columns (K range) per down-projection tile
    red_rows: int = 1024    # rows per final residual reduction
    # splits of the key sequence per KV head; 1: one ATTN_PARTIAL a KV head attends to every key [0, pos] and
    # writes the merged output itself (no ATTN_REDUCE: one dependency hop less, one longer instruction)
    attn_splits: int = 16
    # 1: ATTN_REDUCE attends to the key at pos itself (the K/V tiles' new row) while it merges the
    # prefix splits; there is no last split, so the merge follows the K/V tiles directly instead of
    # a one-key split in between
    key_in_reduce: int = 0
    attn_block: int = 128   # keys per attention inner block
    # the many-rows kernels' prefill buckets (> 32 rows): (row, head) pairs of one attention tile, tl.dot's M,
    # each K/V block loaded once for them (opcodes.rows.RowsLayout.attn_rt); 0: min(64, 2048 / hd)
    attn_pairs: int = 0
    # the many-rows kernels' decode buckets: > 1 cuts each attention block's keys into that many groups, each
    # with its own running softmax, merged once after the loop (a batched tl.dot: the warps on the groups, so
    # a block's max and sum stay inside a warp); 0: one group (the block's keys across the warps)
    attn_kg: int = 0
    # software-pipelining depth of the attention key loop: 3 keeps two K/V blocks in flight, so a
    # split of a few blocks costs about two loaded HBM round trips instead of one per block
    attn_stages: int = 3
    bk: int = 512           # columns streamed per inner-loop iteration of a GEMV tile
    num_warps: int = 8      # warps per CTA (the kernel's launch option)
    # software-pipelining depth of the GEMV streaming loops (1: off): stages - 1 blocks of 32 KB in
    # flight per SM
    stages: int = 6
    # the loop of GATE_UP and LM_HEAD: 0 streams [rows, bk] blocks of a tile and sums over K at its
    # end (the loop of every GEMV); > 0 streams whole rows, about ``row_bytes`` bytes per pipeline
    # stage, each row summed as it arrives, so a tile can have any number of rows without more
    # registers. QKV, O and DOWN always use the column loop
    row_bytes: int = 0
    # 1: a layer's RESIDUAL is folded into the next layer's readers: its QKV and O (or O_REDUCE)
    # tiles sum x1 and the down partials themselves (in RESIDUAL's order, rounded as it rounds), so
    # the next layer waits on the down projection directly: one dependency hop less per layer but
    # the last. Never on a tensor-parallel rank (its RESIDUAL is the cross-rank reduction)
    res_fold: int = 0
    # 1: each DOWN tile makes its waits inside its pipelined loop (Instruction.WAIT_INSIDE): it streams
    # whole rows of its K chunk, the loop's prologue issues its first weight blocks before the waits,
    # and the first iteration waits and reads the act chunk
    down_wait: int = 0
    # 1: the row loop (row_bytes) of GATE_UP and LM_HEAD sums each row inside one warp
    # (opcodes.common.warp_rows_dot) instead of across the CTA's warps: needs d a power of two times
    # 256 (Layout checks); one row a warp where a stage's rows are a multiple of num_warps (the 1B:
    # 4 gate/up rows, 8 LM head rows a stage on 4 warps), else a row's warps still share its sum
    warp_rows: int = 0
    # 1 (rows programs only, opcodes.rows_down_res): the down tiles of the last K chunk end the layer (x1 plus
    # the other chunks' partials plus their own dot, then RESIDUAL_R's epilogue): no RESIDUAL_R. Needs
    # down_rows = red_rows (a down tile's rows are one residual block: the same sum-of-squares parts)
    down_res: int = 0

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name in _ZERO_ALLOWED and isinstance(v, int) and not isinstance(v, bool) and v == 0:
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"Tiling.{f.name} must be a positive int, got {v!r}")
        for k in ("qkv_rows", "kv_rows", "o_rows", "gu_rows", "down_rows", "red_rows", "attn_block", "bk", "num_warps",
                  "o_bk", "down_bk", "attn_pairs", "attn_kg"):
            v = getattr(self, k)
            if v & (v - 1):
                raise ValueError(f"Tiling.{k} must be a power of two, got {v}")
        if self.o_k < 0:
            raise ValueError(f"Tiling.o_k must be >= 0, got {self.o_k}")
        for k in _SWITCHES:
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
        if self.attn_kg and self.attn_block // self.attn_kg < 16:
            raise ValueError(f"Tiling.attn_kg = {self.attn_kg} leaves {self.attn_block // self.attn_kg} keys a group of "
                             f"attn_block = {self.attn_block}: tl.dot needs >= 16")

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

    @classmethod
    def parse_spec(cls, spec: str) -> dict:
        """The overrides of a ``"name=value,name=value"`` string (integers, Tiling fields; the errors name
        ``--tiling``)."""
        over = {}
        for item in filter(None, spec.replace(" ", "").split(",")):
            k, _, v = item.partition("=")
            if not v:
                raise ValueError(f"--tiling: expected name=value, got {item!r}")
            try:
                over[k] = int(v)
            except ValueError:
                raise ValueError(f"--tiling: {k} must be an integer, got {v!r}") from None
        fields = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(over) - set(fields))
        if unknown:
            raise ValueError(f"--tiling: unknown Tiling field(s) {', '.join(unknown)} (the fields: {', '.join(fields)})")
        return over

    @classmethod
    def for_config(cls, cfg: ModelConfig, max_seq: int | None = None, *, tp: bool = False,
                   **overrides) -> "Tiling":
        """The default tiling of the model ``cfg``: the field defaults with the rows of :data:`DEFAULTS`
        applied in order; ``overrides`` win. ``max_seq``: the KV cache's positions, where a row depends
        on them; ``tp``: ``cfg`` is a tensor-parallel rank's shard (``opcodes.tp.shard_config``)."""
        unknown = set(overrides) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown Tiling fields {sorted(unknown)}")
        s = types.SimpleNamespace(cfg=cfg, d=cfg.d, ffn=cfg.ffn, max_seq=max_seq, tp=bool(tp),
                                  t=types.SimpleNamespace(**dataclasses.asdict(cls())))
        t = None
        for row in DEFAULTS:
            if row.final and t is None:
                # the rows of the shape are done: the caller's overrides, then the rows that read them
                t = s.t = cls(**{**vars(s.t), **overrides})
            if not row.when(s):
                continue
            values = {k: (v(s) if callable(v) else v) for k, v in row.values.items()}
            if row.final:
                values = {k: v for k, v in values.items() if k not in overrides}
                if values:
                    t = s.t = dataclasses.replace(t, **values)
            else:
                vars(s.t).update(values)
        return t if t is not None else cls(**{**vars(s.t), **overrides})

    @classmethod
    def short_prefix(cls, cfg: ModelConfig, max_seq: int) -> int:
        """``P`` > 0 where the positions ``[0, P)`` of a cache of ``max_seq`` run faster on the default
        tiling of a cache of ``P`` positions (``for_config(cfg, max_seq=P)``) than on the cache's own
        (``for_config(cfg, max_seq=max_seq)``): a decoder may hold a second tape of it for them (both
        tapes are correct at every position). 0 where the two tilings are the same."""
        p = _merged_max_seq()
        if max_seq <= p or cls.for_config(cfg, max_seq=p) == cls.for_config(cfg, max_seq=max_seq):
            return 0
        return p


@dataclass(frozen=True)
class Default:
    """One row of :data:`DEFAULTS`: where ``when(s)`` holds, ``Tiling.for_config`` sets ``values``
    (field -> an int, or a function of ``s``). ``s``: ``cfg``, ``d``, ``ffn``, ``max_seq`` (None:
    not known), ``tp`` (a tensor-parallel rank's shard) and ``t``, the tiling so far. A row of the
    shape reads the defaults before the caller's overrides, which then replace what it set; a
    ``final`` row reads the tiling after them and sets no field the caller gave."""

    when: Callable
    values: dict
    why: str
    final: bool = False


def _merged_max_seq() -> int:
    from .attn_partial import AttnPartial   # (attn_partial imports base, which imports this module)
    return AttnPartial.MERGED_MAX_SEQ


def _gu_tiles_fill_the_sms(s) -> bool:
    from .gate_up import GateUp             # (gate_up imports base, which imports this module)
    bounds = GateUp.tile_bounds(s.cfg, s.t)
    return not isinstance(bounds, str) and bounds[0] < H200_SMS <= bounds[1]


#: every default of ``Tiling.for_config`` and why, in the order it applies them
DEFAULTS: tuple[Default, ...] = (
    # -- the shape's rows ------------------------------------------------------------------------------------------
    Default(lambda s: True,
            dict(qkv_rows=lambda s: min(s.t.qkv_rows, s.cfg.hd), o_rows=lambda s: min(s.t.o_rows, next_pow2(s.d)),
                 gu_rows=lambda s: min(s.t.gu_rows, next_pow2(s.ffn)),
                 down_rows=lambda s: min(s.t.down_rows, next_pow2(s.d)),
                 down_k=lambda s: min(s.ffn, cdiv(cdiv(s.ffn, cdiv(s.ffn, s.t.down_k)), 512) * 512),
                 red_rows=lambda s: min(s.t.red_rows, next_pow2(s.d)),
                 bk=lambda s: max(16, min(s.t.bk, next_pow2(min(s.d, s.ffn, s.cfg.q_dim))))),
            "no tile larger than the dimension it cuts; equal down K chunks (28672 = 4 x 7168), multiples of 512"),
    Default(lambda s: s.d > 2048, dict(key_in_reduce=1),
            "the merge takes the key at pos, no one-key split: 8B -1.3%, TP 70B -1.1%; 1B +2.4% (one QKV wave there)"),
    Default(lambda s: 2048 < s.d <= 4096, dict(attn_splits=8),
            "8B: 64 prefix partials, one round on the SMs QKV's second wave leaves idle: -1.6..-1.8%; the 1B +1.0%"),
    Default(lambda s: cdiv(s.d, 2 * s.t.o_rows) >= 128,
            dict(o_rows=lambda s: 2 * s.t.o_rows, o_bk=lambda s: max(16, s.t.bk // 2)),
            "O in one wave of twice the rows at half the width (32 KB a stage): 70B -0.4..-0.9%, TP 70B -1.3%"),
    Default(lambda s: s.d <= 2048, dict(row_bytes=ROW_BYTES, stages=5, gu_rows=lambda s: min(64, next_pow2(s.ffn))),
            "gate/up and LM head stream whole rows in coarse tiles; the 8B measured 13% slower with the row loop"),
    Default(lambda s: s.d <= 2048, dict(res_fold=1),
            "one dependency hop less a layer: 1B -2.5% at pos 1024; 8B +4.0%, 16 layers of the 70B +1.5%"),
    Default(lambda s: s.d <= 2048, dict(num_warps=4, bk=lambda s: min(256, s.t.bk)),
            "latency-bound one-wave stages, half the threads in each reduction and barrier: 1B -3.0..-3.2%; 8B +3.2%"),
    Default(lambda s: s.d <= 2048,
            dict(o_rows=lambda s: min(16, s.t.o_rows), down_rows=lambda s: min(16, s.t.down_rows),
                 down_k=lambda s: s.ffn),
            "O and down in one wave of 128 half-height tiles, down in one K chunk (one partial a row): 1B -3.5%"),
    Default(lambda s: s.d <= 2048 and not s.tp, dict(down_wait=1),
            "DOWN's first weight loads before its waits: 1B -0.8..-1.5%, the 8B +5.5%; a TP kernel makes every wait"),
    Default(lambda s: s.d <= 2048 and not s.tp and Tiling.warp_rows_fit(s.d), dict(warp_rows=1),
            "a row summed in one warp, no shared memory or barrier a stage: 1B -1.7% at pos 128; not measured on TP"),
    Default(lambda s: s.tp and cdiv(s.d, 2 * s.t.down_rows) >= 128,
            dict(down_rows=lambda s: 2 * s.t.down_rows, down_bk=lambda s: max(16, s.t.bk // 2)),
            "TP 70B: down in half the tiles at half the width (32 KB a stage): 20 layers -1.2%; one GPU's 70B: equal"),
    # -- the final rows: they read the tiling after the caller's overrides ------------------------------------------
    Default(lambda s: s.tp, dict(kv_rows=lambda s: max(2, s.t.qkv_rows // 2)),
            "TP: K/V tiles, scheduled last, are a tail wave; halved, they spread it: 70B -0.8%; one GPU's 8B +2.1%",
            final=True),
    Default(lambda s: s.d <= 2048 and s.max_seq is not None and not s.t.key_in_reduce
            and s.max_seq <= _merged_max_seq(), dict(attn_splits=1),
            "a short cache: one attention instruction a KV head, no merge: faster or equal at every such position",
            final=True),
    Default(lambda s: s.d <= 2048 and not s.tp and _gu_tiles_fill_the_sms(s), dict(gu_tiles=H200_SMS),
            "gate/up on every SM where ffn / gu_rows tiles leave some idle (1B: 132 tiles, not 128): -0.3..-0.6%",
            final=True),
)

#: the knobs no default sets (``--tiling`` / ``MEGATAPE_TILING`` set them for experiments), and why
EXPERIMENTAL: dict[str, str] = {
    "down_res": "the rows programs' down tiles of the last K chunk end the layer, no RESIDUAL_R; only "
                "opcodes.rows.rows_tiling sets it (the 1024-row bucket: run 314, H100, a 1B chunk -5.4%; s48.md v178)",
    "o_k": "the O projection split along K (O_REDUCE adds the chunks): measured slower (TP 70B +1.2%)",
    "attn_kg": "the rows kernels' decode attention in key groups, warps on the groups (s43.md v169): +1.2% on an H100 "
                "(run 304), back for its H200 run (s48.md)",
    "attn_pairs": "the rows kernels' prefill attention tiles' (row, head) pairs; only opcodes.rows.rows_tiling sets it "
                  "(128 from 256 rows: runs 289-293, a 4096-token prompt's last 1B chunk -40%, the 8B's -38%)",
}
