"""Many rows per step (issue 50): chunked prefill and batched decode on a decoder handle.

    h = build_decoder(weights, kv_cache, cfg, max_seq_len, batch=B)     # kv: (B, n_kv, max_seq_len, hd) per layer
    logits = prefill(h, prompt, start_pos=0, slot=0)                   # (1, vocab): the last position's
    logits = decode_step(h, tokens, pos)                               # tokens, pos: (B,) -> (B, vocab)
    logits = decode_step(h, tokens, pos, slots=[0, 3])                 # some slots only

A step of R rows runs one launch of the rows kernel of the smallest bucket (``opcodes.rows.BUCKETS``)
that holds R; each bucket's tape and kernel are built on first use (compile time, outside any step).
Row r is token ``tokens[r]`` of slot ``slots[r]`` at ``pos[r]``; every row's K/V is written into its
(slot, position) in place before any row attends, then row r attends to its slot's keys
``[0, pos[r]]`` (``opcodes.decoder.decoder_ref_rows``). Each row's logits are a function of that
row's inputs and its slot's cache alone: another request in the batch changes nothing in them
(``tl.dot`` columns are independent), bitwise within one bucket and across the decode buckets
(``opcodes.rows.DECODE_BUCKETS``).
Every check runs before anything is written: on an error the cache is untouched.
"""
from __future__ import annotations

import numpy as np
import torch

from opcodes.rows import BUCKETS, LOGIT_GROUP, rows_state, rows_tiling
from schedule.rows_program import rows_lowering

from . import runtime
from .common import arg_error, check_open, describe

#: the options of ``build_decoder`` the rows kernels take too (the rest: the one-row tape's)
ROWS_OPTIONS = ("num_sms", "spin_limit", "sync_check", "cooperative", "policy", "seed")


def bucket(R: int) -> int:
    """The rows bucket of an R-row step: the smallest of :data:`BUCKETS` >= R."""
    for b in BUCKETS:
        if R <= b:
            return b
    raise arg_error(ValueError, "tokens", f"at most {BUCKETS[-1]} rows a step (prefill chunks them)", f"{R} rows")


def rows_handle(dh, R: int, min_rows: int = 1):
    """The kernel handle of ``dh``'s rows bucket for max(R, ``min_rows``) rows, built on first use."""
    b = bucket(max(R, min_rows))
    h = dh.rows.get(b)
    if h is None:
        cfg = dh.cfg
        opts = {k: v for k, v in dh.rows_options.items() if k in ROWS_OPTIONS}
        h = runtime.build_validated(dh.weights, dh.kv_rows, cfg, dh.device, dh.max_seq,
                                    tiling=rows_tiling(cfg, b, dh.max_seq), lowering=rows_lowering(b, dh.batch),
                                    **opts)
        dh.rows[b] = h
    return h


def _int_vector(name: str, v, device=None) -> list[int]:
    """A 1-D integer tensor or a list / tuple of python ints, as python ints."""
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool:
            raise arg_error(TypeError, name, "an integer tensor", describe(v))
        if v.dim() != 1:
            raise arg_error(ValueError, name, "a 1-D tensor", describe(v))
        return [int(t) for t in v.tolist()]
    if isinstance(v, (list, tuple)) and (set(map(type, v)) <= {int}     # the common case, ~3x faster
                                         or all(isinstance(t, int) and not isinstance(t, bool) for t in v)):
        return list(v)
    raise arg_error(TypeError, name, "a 1-D integer tensor or a list of ints", describe(v))


def check_rows_args(dh, tokens, pos, slots) -> tuple[list[int], list[int], list[int]]:
    """(tokens, pos, slots) of one rows step as python ints, every check done."""
    toks = _int_vector("tokens", tokens)
    R = len(toks)
    if R == 0:
        raise arg_error(ValueError, "tokens", "at least one token", describe(tokens))
    if R > BUCKETS[-1]:
        raise arg_error(ValueError, "tokens", f"at most {BUCKETS[-1]} rows a step", f"{R} rows")
    pos = _int_vector("pos", pos)
    if len(pos) != R:
        raise arg_error(ValueError, "pos", f"{R} positions (one per token)", f"{len(pos)}")
    if slots is None:
        if R > dh.batch:
            raise arg_error(ValueError, "tokens", f"at most batch = {dh.batch} rows without slots= (row r is slot r)",
                            f"{R} rows")
        slots = list(range(R))
    else:
        slots = _int_vector("slots", slots)
        if len(slots) != R:
            raise arg_error(ValueError, "slots", f"{R} slots (one per token)", f"{len(slots)}")
    vocab, S = dh.cfg.vocab, dh.max_seq
    for r in range(R):
        if not 0 <= toks[r] < vocab:
            raise arg_error(ValueError, f"tokens[{r}]", f"a token id in [0, vocab={vocab})", toks[r])
        if not 0 <= slots[r] < dh.batch:
            raise arg_error(ValueError, f"slots[{r}]", f"a slot in [0, batch={dh.batch})", slots[r])
        if not 0 <= pos[r] < S:
            raise arg_error(ValueError, f"pos[{r}]", f"a position in [0, max_seq_len={S})"
                            + (" (past max_seq_len)" if pos[r] >= S else ""), pos[r])
    seen: dict = {}
    for r, sp in enumerate(zip(slots, pos)):
        if sp in seen:
            raise arg_error(ValueError, "slots / pos", "each (slot, position) at most once a step",
                            f"rows {seen[sp]} and {r} both at slot {sp[0]} position {sp[1]}")
        seen[sp] = r
    return toks, pos, slots


def check_decoder(dh) -> None:
    """``dh`` is an open decoder handle (``build_decoder``): the first check of every rows call."""
    from .decoder import DecoderHandle      # (interp.decoder imports this module)
    if not isinstance(dh, DecoderHandle):
        raise arg_error(TypeError, "handle", "a DecoderHandle from build_decoder", describe(dh))
    check_open(dh)


def run_rows(dh, toks, pos, slots, logits_rows=None, min_rows: int = 1) -> torch.Tensor:
    """One launch over checked rows; returns the fp32 logits of rows ``logits_rows`` (default all),
    (n, vocab), a fresh tensor; ``logits_rows`` empty: None, and the launch skips the LM head."""
    R = len(toks)
    h = rows_handle(dh, R, min_rows)
    if dh.held_slot in slots:         # the held position (decode_step's pos=None) no longer follows that slot
        dh.held_slot = -1
    sel = list(range(R)) if logits_rows is None else list(logits_rows)
    # NOTE: from pageable memory: the copy has read the host tensor when it returns (no pinned buffer
    # the next step could overwrite before the device read it)
    # one group of 16 columns holds every row asked for (a prompt's last): the LM head computes those alone
    groups = {r // LOGIT_GROUP for r in logits_rows} if logits_rows is not None else set()
    meta = rows_state(h.lay.rows, slots, pos, toks, logits=logits_rows is None or len(logits_rows) > 0,
                      group=groups.pop() if len(groups) == 1 else None)
    with runtime.Stepping(h):
        h.state["rows"].copy_(meta)
        runtime.launch(h, dh.x0, 0, dh.hidden)
        if h.sync_check:
            h.check(sync=True)
        if not sel:
            return None
        lay = h.lay
        return read_logits(h.scratch["logits_r"].view(lay.n_blocks, dh.cfg.vocab, lay.n_tile), sel)


def read_logits(lg: torch.Tensor, sel: list[int]) -> torch.Tensor:
    """Rows ``sel`` of a step's logits, (len(sel), vocab), a fresh tensor: ``lg`` is the ``logits_r`` scratch as
    [column blocks, vocab, NT] (``opcodes.rows``: row n is column n % NT of block n // NT). Consecutive rows of
    one block (a prompt's last row, a decode bucket's rows) are one strided copy: no index tensor to send and no
    index arithmetic on the device (run 304, H100: a prompt's last chunk was followed by three small kernels and
    a copy, ~0.37 ms)."""
    nt = lg.shape[2]
    b, c = divmod(sel[0], nt)
    if sel == list(range(sel[0], sel[0] + len(sel))) and c + len(sel) <= nt:
        return lg[b, :, c:c + len(sel)].T.contiguous()
    n = torch.tensor(sel, device=lg.device)
    return lg[n // nt, :, n % nt]


def decode_rows(dh, tokens, pos, slots=None, min_rows: int = 1) -> torch.Tensor:
    """``decode_step``'s many-rows form. ``min_rows``: run in the bucket of at least that many rows, so
    that a row's logits are bitwise the same however many rows share its step: the 16- and 32-row buckets sum
    alike (runs 321-324; ``tests/test_kernels_compile.py::test_decode_buckets_sum_alike``), the larger ones tile
    attention and sum otherwise; a server with more than 32 slots passes its slot count."""
    check_decoder(dh)
    toks, pos, slots = check_rows_args(dh, tokens, pos, slots)
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or not 1 <= min_rows <= BUCKETS[-1]:
        raise arg_error(ValueError, "min_rows", f"an int in [1, {BUCKETS[-1]}]", describe(min_rows))
    return run_rows(dh, toks, pos, slots, min_rows=min_rows)


def check_slot(dh, slot) -> int:
    """``slot``, checked: a python int in [0, batch) (the error names ``slot``)."""
    if isinstance(slot, bool) or not isinstance(slot, int):
        raise arg_error(TypeError, "slot", "a python int", describe(slot))
    if not 0 <= slot < dh.batch:
        raise arg_error(ValueError, "slot", f"a slot in [0, batch={dh.batch})", slot)
    return slot


def prefill_chunks(P: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """The launches of a ``P``-token prompt as (first token, tokens): ``chunk`` tokens each (the last the
    rest), or by default the largest bucket's (1024) while that many remain and the rest in chunks of the
    next (512): a chunk shorter than its bucket still runs every column block of its GEMM tiles, so a rest
    of 600 runs as 512 + 88 (640 columns), not in one 1024-row launch. The 1B's last 1024 tokens of a
    4096-token prompt ran at 6.95 us a token in one chunk against 7.48 for its last 512 (bench/notes/s43.md,
    run 299, H100: ~5% of it fuller waves, the rest the 1024 chunk's fewer keys on average). A bucket's scratch is
    built on first use: the 1024-row one's is 1.75 GiB on the 1B shape, 6.9 GiB on the 8B (a chunk of 512 keeps
    it unbuilt)."""
    out, c0 = [], 0
    while c0 < P:
        left = P - c0
        n = min(left, chunk) if chunk else (BUCKETS[-1] if left >= BUCKETS[-1] else min(left, BUCKETS[-2]))
        out.append((c0, n))
        c0 += n
    return out


def prefill(dh, tokens, start_pos: int = 0, slot: int = 0, chunk: int | None = None,
            logits: bool = True) -> torch.Tensor | None:
    """Fill slot ``slot``'s cache with ``tokens`` at positions ``start_pos, start_pos + 1, ...``, in
    chunks of ``chunk`` rows (at most the largest bucket's, 1024; default: :func:`prefill_chunks`), one launch
    each; returns the last position's fp32 logits (1, vocab), or with ``logits`` False None and no launch runs the LM
    head (a part of a prompt that continues). Errors (tokens, positions past max_seq_len, the slot,
    the chunk) come before any launch."""
    check_decoder(dh)
    toks = _int_vector("tokens", tokens)
    P = len(toks)
    if P == 0:
        raise arg_error(ValueError, "tokens", "a non-empty 1-D token sequence", describe(tokens))
    if isinstance(start_pos, bool) or not isinstance(start_pos, int):
        raise arg_error(TypeError, "start_pos", "a python int", describe(start_pos))
    check_slot(dh, slot)
    if start_pos < 0 or start_pos + P > dh.max_seq:
        raise arg_error(ValueError, "start_pos / tokens", f"positions in [0, max_seq_len={dh.max_seq})",
                        f"positions {start_pos} .. {start_pos + P - 1} (past max_seq_len)" if start_pos >= 0
                        else start_pos)
    vocab = dh.cfg.vocab
    # NOTE: the host work before a prompt's first launch is time to first token (run 328, H100: 0.69 ms of a 1B
    # 1024-token prompt's 6.49, its chunk's kernel 5.80): the checks and the rows' metadata are numpy, not loops
    try:
        arr = np.fromiter(toks, dtype=np.int64, count=P)
    except OverflowError:               # an id past int64: the first bad one is named below
        arr = None
    bad = np.flatnonzero((arr < 0) | (arr >= vocab)) if arr is not None else \
        [next(i for i, t in enumerate(toks) if not 0 <= t < vocab)]
    if len(bad):
        raise arg_error(ValueError, f"tokens[{bad[0]}]", f"a token id in [0, vocab={vocab})", toks[bad[0]])
    if not isinstance(logits, bool):
        raise arg_error(TypeError, "logits", "a bool", describe(logits))
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or not 1 <= chunk <= BUCKETS[-1]):
        raise arg_error(ValueError if isinstance(chunk, int) and not isinstance(chunk, bool) else TypeError,
                        "chunk", f"an int in [1, {BUCKETS[-1]}]", describe(chunk))
    out = None
    for c0, n in prefill_chunks(P, chunk):
        last = c0 + n == P
        out = run_rows(dh, arr[c0:c0 + n], np.arange(start_pos + c0, start_pos + c0 + n), np.full(n, slot),
                       logits_rows=[n - 1] if last and logits else [])
    return out
