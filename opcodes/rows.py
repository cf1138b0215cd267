"""Many rows per step (issue 50): the layout of an R-row decoder program and the rows' metadata.

A step runs up to ``ROWS`` **rows**; row r is token ``tok[r]`` of sequence slot ``slot[r]`` at position
``pos[r]`` of a ``(BATCH, n_kv, max_seq, hd)`` cache. A prefill chunk is R consecutive positions of one
slot, batched decode one row a slot; both may share a step. The semantics are the oracle's,
``opcodes.decoder.decoder_ref_rows``: every row's K/V is written in place first, then row r attends to
its slot's keys ``[0, pos[r]]``.

The tape is static: ``ROWS`` (the bucket, a power of two >= 16: ``tl.dot`` needs every dimension >= 16)
is a constexpr of the :class:`RowsLayout`, and the actual rows (R <= ROWS) are device data, the STATE
buffer ``rows`` (int32) the host writes before each launch::

    [R, logits, 0, 0,  slot_0, pos_0, tok_0, 0,  slot_1, pos_1, tok_1, 0,  ...]

(``logits`` 0: the step's LM head tiles return at once: a prefill chunk before the prompt's last; 1: every
row's logits; ``2 + k``: only columns ``[16 k, 16 k + 16)``'s (the prompt's last row, in the prefill buckets:
``LOGIT_GROUP`` columns, tl.dot's narrowest N, instead of the bucket's; the decode buckets compute every column).)

Activations are feature-major in blocks of ``NT`` columns (``RowsLayout.n_tile``: every row of a bucket up to
256 rows, 256 past it): ``[L, ROWS / NT, width, NT]``, element (f, n) of a layer at
``(n // NT) * width * NT + f * NT + n % NT`` (a K block of a GEMM's B operand is one contiguous span; a tile's
output one region). A GEMM tile covers one block of columns (its ``n0`` operand, a multiple of ``NT``):
the tiles of a bucket past 256 rows stream the same weight rows once a block, adjacent in the tape. The
attention output ``attn_r`` is ``[L, ROWS, q_dim]``: an attention instruction computes one row. Columns
``n >= R`` are padding: zero from the embedding on, never mixed with real columns (the columns of a dot are
independent), never stored to the cache.
See bench/notes/rows-design.md.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from .base import Instruction, Layout, register_layout
from .config import ModelConfig
from .decoder import DecoderLayout
from .tiling import H200_SMS, Tiling, next_pow2

#: words of the ``rows`` state buffer before the rows, and per row
ROWS_HEADER = 4
ROW_WORDS = 4
#: columns of the LM head's one-group mode (the ``rows`` buffer's logits word ``2 + k``)
LOGIT_GROUP = 16
#: the row buckets a handle builds tapes for (``ROWS``), smallest first
BUCKETS = (16, 32, 64, 128, 256, 512, 1024)
#: the widest column block of a GEMM tile (``RowsLayout.n_tile``): a 512-row bucket's tiles are 2 blocks wide,
#: a 1024-row bucket's 4
N_TILE_MAX = 256
#: the decode buckets: tiled alike but for the dots' N (the same M, K blocks, warps, one attention instruction
#: a row, the normed operands' sums of squares in the same parts), so a row's logits and K/V are bitwise the
#: same in any of them: a server may run a step in the smallest that holds its rows
DECODE_BUCKETS = (16, 32)
#: the largest decode bucket, and the one-group LM head's columns, for the kernels (constexprs)
DECODE_ROWS_MAX = tl.constexpr(DECODE_BUCKETS[-1])
LOGIT_GROUP_C = tl.constexpr(LOGIT_GROUP)


def rows_state_shape(rows: int) -> tuple[int]:
    return (ROWS_HEADER + ROW_WORDS * rows,)


def rows_state(rows: int, slots, pos, tokens, logits: bool = True, group: int | None = None) -> torch.Tensor:
    """The ``rows`` state buffer's contents (int32, CPU) for ``len(slots)`` rows of a ``rows`` bucket;
    ``logits`` False: the LM head is skipped (a prefill chunk before the prompt's last); ``group`` k: only
    columns ``[16 k, 16 k + 16)`` get logits (the rows of the others are not computed), past the decode
    buckets (theirs compute every column: the word says all)."""
    R = len(slots)
    if group is not None and not 0 <= group < rows // LOGIT_GROUP:
        raise ValueError(f"group {group} not in [0, {rows // LOGIT_GROUP}) for a {rows}-row bucket")
    if rows <= DECODE_BUCKETS[-1]:
        group = None
    # numpy from python ints: 0.06 ms for 1024 rows where three torch.as_tensor took 0.19 (a prompt's first chunk
    # builds it before any launch)
    out = np.zeros(rows_state_shape(rows), dtype=np.int32)
    out[0] = R
    out[1] = 0 if not logits else 1 if group is None else 2 + group
    body = out[ROWS_HEADER:].reshape(rows, ROW_WORDS)
    body[:R, 0] = slots
    body[:R, 1] = pos
    body[:R, 2] = tokens
    return torch.from_numpy(out)


def logit_columns(st, rows: int) -> range:
    """VM: the step's columns that get logits, from the ``rows`` buffer's logits word."""
    w = int(st.state["rows"].reshape(-1)[1])
    if w < 2:
        return range(rows if w else 0)
    return range(LOGIT_GROUP * (w - 2), LOGIT_GROUP * (w - 1))


def read_rows(st) -> tuple[int, list[int], list[int], list[int]]:
    """(R, slots, pos, tokens) from a VM state's ``rows`` buffer."""
    buf = st.state["rows"].reshape(-1)
    R = int(buf[0])
    body = buf[ROWS_HEADER:].view(-1, ROW_WORDS)[:R]
    return R, body[:, 0].tolist(), body[:, 1].tolist(), body[:, 2].tolist()


@triton.jit
def row_meta(rows_ptr, n, ROWS: tl.constexpr):
    """(live, slot, pos, tok) of row indices ``n`` (any shape): ``live`` where ``n < R``; the others 0."""
    R = tl.load(rows_ptr)
    live = n < R
    b = rows_ptr + 4 + 4 * n
    slot = tl.load(b, mask=live, other=0)
    pos = tl.load(b + 1, mask=live, other=0)
    tok = tl.load(b + 2, mask=live, other=0)
    return live, slot, pos, tok


def rows_tiling(cfg: ModelConfig, rows: int, max_seq: int, **over) -> Tiling:
    """The tiling of an R-row program: ``Tiling.for_config``'s attention, every GEMM a ``tl.dot`` tile of
    weight rows (M) by the ``rows`` columns, the column loop only (no row loop, residual fold, split O, waits
    inside), one merged attention instruction per (KV head, row), the down projection in K chunks of 2048
    (the 1B: 256 tiles, not 64), K blocks of 128 (64 from 128 rows; 256 in the decode buckets lost, runs 291-292:
    R16 -2.7% in the profile, R32 +6..7% in the rows bench, 88 bytes of stack on the 8B's R32; the buckets share
    one tiling so a row's bits do not depend on its batch).
    Decode buckets (<= 32 rows): 4 warps (run 277: 1B R16 B16 1598 us against 1935 at 8 warps, the 8B 7855
    against 9897) and gate/up tiles of 32 + 32 rows (run 277 / 279: -6% on the 1B, -4.8% on the 8B; 32 bytes
    of stack). The prefill buckets: at 128 rows 4 warps, gate/up 64 + 64, down and residual tiles of 64 rows
    (run 280, a 1B chunk: 1708 us against 2438 at 8 warps and M 32; 4 warps at M 128 ran 2.2x slower); at 256
    rows 8 warps (4 at M 64 ran 2x slower), gate/up 64 + 64, O, down and residual 64 (run 280: 2862 us a 1B
    chunk, 11.2 us a token; 512 rows: those tiles on two column blocks of 256), QKV 64 (at most hd) and 4 stages
    (run 285, 512 rows: 1B 4015 us against 4469 at QKV 32 and 3 stages, the 8B 21957 against 23214). Between
    them (64 rows): 8 warps, gate/up 16 + 16. Past the decode buckets the attention tiles pipeline 2 key
    blocks deep, not 3 (3 spilled on the 1B at 128 rows), but from 256 rows 3 deep over tiles of 128 (row,
    head) pairs (runs 289-293, H200, the last 512-row chunk of a 4096-token prompt: 1B 6846.9 -> 4121.3 us at
    128 pairs against 32 (5630.2 at 256: 64 tiles leave half the SMs idle), the 8B 32888.1 -> 20432.3 against 16
    pairs; 3 stages -2.8% / -2.2% more). The O projection 16 rows where d / 32 would leave SMs idle.
    ``over``: fields to set instead (a probe's variants); the pipeline depth then fits their tiles: as many
    stages (2-5; 2-8 in the decode buckets) as 200 KB of shared memory holds blocks of the largest weight tile plus
    the rows."""
    base = Tiling.for_config(cfg, max_seq=max_seq)
    decode = rows <= DECODE_BUCKETS[-1]
    bk = min(128 if rows <= 64 else 64, next_pow2(cfg.d))
    # RESIDUAL_R's [red, rows] blocks, normed for the next GEMM (4096 spilled); one part size in the decode buckets
    red = max(32, 2048 // max(rows, DECODE_BUCKETS[-1]))
    o_rows = 16 if cfg.d // 32 < H200_SMS else 32
    t = dataclasses.replace(
        base, qkv_rows=min(32, cfg.hd), kv_rows=0, o_rows=o_rows, o_bk=0, o_k=0, gu_rows=32 if decode else 16,
        gu_tiles=0, down_rows=32, down_bk=0, down_k=min(cfg.ffn, 2048), red_rows=red, attn_splits=1,
        key_in_reduce=0, bk=bk, row_bytes=0, res_fold=0, down_wait=0, warp_rows=0, num_warps=4 if decode else 8,
        attn_stages=base.attn_stages if decode else 2)
    if rows == 128:
        t = dataclasses.replace(t, num_warps=4, gu_rows=64, down_rows=64, red_rows=max(red, 64))
    elif rows >= 256:
        t = dataclasses.replace(t, gu_rows=64, o_rows=64, down_rows=64, red_rows=max(red, 64), qkv_rows=min(64, cfg.hd),
                                attn_pairs=128, attn_stages=3)
        over = {"stages": 4, **over}
    if rows >= 1024:    # the down projection in 2 K chunks: 1 partial less to write and read back, K blocks of
        # twice the length a tile (run 312, H100, a 1024-row chunk at pos 0: 1B 6044 -> 5670 us, 8B 35502 -> 33546);
        # the last chunk's tiles end the layer (DOWN_RES_R, no RESIDUAL_R: run 314, H100, the 1B 5579 -> 5280 us,
        # bitwise the same; the 8B not measured with it)
        dk = min(cfg.ffn, max(2048, -(-cfg.ffn // 128) * 64))
        t = dataclasses.replace(t, down_k=dk, down_res=int(dk < cfg.ffn))    # it needs another chunk's partials
        if cfg.d // 128 * (rows // N_TILE_MAX) >= 128:    # O tiles of 128 rows, where they still fill a wave (the
            # 8B's 128 tiles, not 256 in two: runs 316-318, H100, its chunk at pos 0 -2.1 / -2.5 / -2.2%, accuracy
            # met; the 1B's would be 64); down and residual tiles of 128 rows likewise (128 a K chunk: run 328,
            # H100, the 8B's chunk 31385.7 -> 30068.3 us, -4.2%, accuracy met; the 1B's 64 tiles lost, s47.md)
            t = dataclasses.replace(t, o_rows=128, down_rows=128, red_rows=128)
    t = dataclasses.replace(t, **{k: v for k, v in over.items() if k != "stages"})
    if "stages" in over:
        return dataclasses.replace(t, stages=over["stages"])
    m = max(2 * t.gu_rows, 2 * max(16, t.qkv_rows // 2), t.o_rows, t.down_rows, 32)    # a block's weight rows
    stage = 2 * t.bk * (m + min(max(rows, DECODE_BUCKETS[-1]), N_TILE_MAX))
    # the decode buckets 8 stages deep (7 buffers, 6 in flight: 96 KB of gate/up an SM, not 48; runs 314-315, H100,
    # R16 B16 pos 1024: 1B 1488 -> 1457 us, 8B 7481 -> 7303), the others at most 5
    return dataclasses.replace(t, stages=max(2, min(8 if decode else 5, (200 * 1024) // stage)))


@register_layout
@dataclass(frozen=True)
class RowsLayout(DecoderLayout):
    """A :class:`DecoderLayout` for programs of up to ``rows`` rows a step over a cache of ``batch``
    sequence slots. ``rows``: a power of two >= 16 (the ``tl.dot`` N side)."""

    rows: int = 16
    batch: int = 1
    DOWN_RES = True

    def __post_init__(self):
        super().__post_init__()
        r, b = self.rows, self.batch
        if isinstance(r, bool) or not isinstance(r, int) or r < 16 or r & (r - 1):
            raise ValueError(f"RowsLayout.rows must be a power of two >= 16 (tl.dot's N), got {r!r}")
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ValueError(f"RowsLayout.batch must be an int >= 1, got {b!r}")
        c, t = self.cfg, self.tiling
        if self.kv_rows != t.qkv_rows:
            raise ValueError(f"a rows program needs kv_rows = qkv_rows, got qkv_rows {t.qkv_rows}, kv_rows {self.kv_rows}")
        for k in ("o_rows", "down_rows"):
            if getattr(t, k) < 16:
                raise ValueError(f"a rows program needs Tiling.{k} >= 16 (tl.dot's M), got {getattr(t, k)}")
        if t.down_res and (t.down_rows != t.red_rows or self.n_down_k < 2):
            raise ValueError(f"Tiling.down_res = 1 needs down_rows = red_rows (a down tile's rows one residual "
                             f"block) and 2 or more down K chunks (down_k < ffn: the other chunks' DOWN_R write the "
                             f"partials), got down_rows {t.down_rows}, red_rows {t.red_rows}, down_k {t.down_k}, ffn {c.ffn}")
        if t.gu_rows < 16 or self.lm_rows < 16:
            raise ValueError(f"a rows program needs gu_rows and lm_rows >= 16, got {t.gu_rows}, {self.lm_rows}")
        if not self.attn_merged or t.row_bytes or t.res_fold or t.down_wait or t.gu_tiles or self.o_partial:
            raise ValueError("a rows program needs attn_splits 1, no row loop, residual fold, down_wait, gu_tiles "
                             "or split O (opcodes.rows.rows_tiling)")

    @classmethod
    def of(cls, lay, rows: int = 16, batch: int = 1, **tiles) -> "RowsLayout":
        emb = tiles.pop("emb_cols", 0) or min(next_pow2(lay.cfg.d),
                                               max(16, 8192 // max(rows, DECODE_BUCKETS[-1])))
        # the LM head's tiles: 128 vocabulary rows from 128 rows up (run 311, H200, 1B: a 1024-row prompt's one
        # chunk 6.45 -> 6.01 ms, 64 rows 6.12; a 128-row one 1.68 -> 1.58 ms: a prompt's one logits group streams
        # 16 KB a stage in flight, not 4), where rows_tiling's stages already hold 128 weight rows (gate/up 64 + 64;
        # the 64-row bucket's 5 stages of 32 would take 240 KB of shared memory with them); else 32
        lm = tiles.pop("lm_rows", 0) or (128 if rows >= 128 else 32)
        return cls(lay.cfg, lay.tiling, lay.max_seq, lm_rows=lm, emb_cols=emb,
                   rows=rows, batch=batch)

    @property
    def attn_rt(self) -> int:
        """Rows per attention instruction: 1 in the decode buckets (<= 32 rows: rows are other slots', and
        R x n_kv instructions fill the SMs), else ``Tiling.attn_pairs`` (row, head) pairs of one slot's rows
        (``rows_tiling``: 128 from 256 rows), where 0: min(64, 2048 / hd) (32 at hd 64, 16 at hd 128: more
        spilled registers on the 1B and 8B at 128 rows)."""
        if self.rows <= DECODE_BUCKETS[-1]:
            return 1
        pairs = self.tiling.attn_pairs or min(64, 2048 // self.cfg.hd)
        return min(self.rows, max(1, pairs // next_pow2(self.cfg.group)))

    @property
    def n_tile(self) -> int:
        """Columns of a GEMM tile (``NT``), the block of the activations' layout: every row up to 256."""
        return min(self.rows, N_TILE_MAX)

    @property
    def n_blocks(self) -> int:
        return self.rows // self.n_tile

    def col_blocks(self) -> range:
        """The ``n0`` operands of a GEMM tile: the first column of each block."""
        return range(0, self.rows, self.n_tile)

    @property
    def ss_parts(self) -> tuple[int, int, int]:
        """Sum-of-squares parts of the normed GEMM operands (``common_rows.store_normed``): of the layer-0
        input (one an EMBED_R tile), of the other layers' inputs and the LM head's (one a RESIDUAL_R tile),
        of the MLP's input (one an OPROJ_R tile)."""
        d, t = self.cfg.d, self.tiling
        return -(-d // self.emb_cols), -(-d // t.red_rows), -(-d // t.o_rows)

    def constexprs(self, interp: bool = False) -> dict:
        p_emb, p_res, p_o = self.ss_parts
        return {**super().constexprs(interp), "ROWS": self.rows, "NT": self.n_tile, "BATCH": self.batch, "SS_P0": p_emb,
                "SS_P": p_res, "SS_PP": next_pow2(max(p_emb, p_res)), "SS2_P": p_o, "SS2_PP": next_pow2(p_o)}

    def extra(self) -> dict:
        return {**super().extra(), "rows": self.rows, "batch": self.batch}


class RowsInstruction(Instruction):
    """Base of the rows opcodes: they belong to whole-model programs of a :class:`RowsLayout` only, and are in
    the kernels of the tapes that hold them only (whose kernels hold nothing else: ``ROWS_OPCODE``)."""

    WHOLE_MODEL = True
    IN_EVERY_KERNEL = False
    ROWS_OPCODE = True

    @classmethod
    def applies(cls, lay: Layout) -> bool:
        return isinstance(lay, RowsLayout)


@triton.jit
def blk(n, F: tl.constexpr, NT: tl.constexpr, ROWS: tl.constexpr):
    """The offset of column(s) ``n`` of a feature-major ``[width F]`` activation in its blocked layout
    (``opcodes.rows``): ``n`` itself when one block holds every row."""
    if NT == ROWS:
        return n
    else:
        return (n // NT) * (F * NT) + n % NT


def bview(buf: torch.Tensor, lay, width: int, *lead: int) -> torch.Tensor:
    """VM: a blocked activation buffer as ``[*lead, n_blocks, width, NT]``."""
    return buf.view(*lead, lay.n_blocks, width, lay.n_tile)


def bregion(buf: str, lay, width: int, lead: int, lo: int, hi: int, n0: int) -> "Region":
    """Features ``[lo, hi)`` of column block ``n0`` of the ``lead``-th ``[width, ROWS]`` slice of a blocked
    activation buffer: one contiguous region."""
    from .base import Region
    base = lead * width * lay.rows + n0 * width
    return Region(buf, base + lo * lay.n_tile, base + hi * lay.n_tile)


def check_n0(n0: int, lay) -> list[str]:
    """``[]`` or the message for a column block start that is not a multiple of ``NT`` in ``[0, ROWS)``."""
    return [] if 0 <= n0 < lay.rows and n0 % lay.n_tile == 0 else \
        [f"n0 {n0} not a multiple of NT = {lay.n_tile} in [0, {lay.rows})"]


def layer_input_r(st, layer: int, b: int = 0) -> torch.Tensor:
    """VM: column block ``b`` of the feature-major residual stream entering ``layer``, ``[d, NT]`` (bf16)."""
    lay = st.lay
    d = lay.cfg.d
    if layer == 0:
        return bview(st.buf["x0_r"], lay, d)[b]
    return bview(st.buf["xout_r"], lay, d, lay.cfg.layers)[layer - 1, b]


def store_normed_r(x: torch.Tensor, lo: int, hi: int, nw: torch.Tensor, hn: torch.Tensor, ss: torch.Tensor,
                   part: int) -> None:
    """VM: ``common_rows.store_normed`` for features [lo, hi) of the fp32 ``x`` [hi - lo, NT]; ``hn``
    [d, NT] and ``ss`` [parts, NT] are views of a column block of the operand's buffers."""
    hn[lo:hi] = (x * nw[lo:hi].float()[:, None]).to(torch.bfloat16)
    ss[part] = feature_sums_r(x, ss.shape[-1], squares=True)


def col_rstd_r(ss: torch.Tensor, parts: int, d: int, eps: float, nt: int | None = None) -> torch.Tensor:
    """VM: ``common_rows.col_rstd`` over the first ``parts`` rows of ``ss`` [parts, columns] (a column block of
    ``nt`` columns, default all of ``ss``'s: a decode bucket's block sums in fp64, as the kernel)."""
    return torch.rsqrt(feature_sums_r(ss[:parts], ss.shape[-1] if nt is None else nt) / d + eps)


def feature_sums_r(t: torch.Tensor, nt: int, squares: bool = False) -> torch.Tensor:
    """VM: the kernels' sums over a column block's features (axis 0) of ``t`` (or of its squares): in fp64,
    rounded once, where the block is a decode bucket's (``nt`` columns), as ``common_rows``' are."""
    if nt <= DECODE_BUCKETS[-1]:
        t = t.double()
        return (t * t if squares else t).sum(0).float()
    return (t * t if squares else t).sum(0)


def bf16_dot(w: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
    """VM: ``w . xb`` as the tile computes it: bf16 operands, fp32 sums."""
    return w.float() @ xb.to(torch.bfloat16).float()
