"""L2 prefetch of the weights of an SM's next instructions (``Tiling.pf_cols``, ``Tiling.pf_ahead``).

A weight tile's addresses do not depend on the step, so an SM can ask for the weights of the
instructions ahead of it in its queue before the current one waits: the SM's TMA engine takes one
``cp.async.bulk.prefetch.L2`` per weight row, and those instructions' loads then hit L2. The HBM
pipe keeps working while the SM waits on a counter, which is where a small model spends its time
(bench/NOTES.md, run 11: 27% of SM time waiting).

The host plans the prefetches (:func:`prefetch_table`): row ``i`` of the table is what the kernel
asks for when it starts tape slot ``i``, and rows ``len(tape) + sm * pf_ahead + a`` what SM ``sm``
asks for before its first instruction. A queue's streaming instructions (those with
:meth:`~opcodes.base.Instruction.weight_streams`) are prefetched ``pf_ahead`` of them ahead: the
first ``pf_ahead`` at the queue's start, and the ``k + pf_ahead``-th when the ``k``-th starts. Pool
slots go out by ticket, in order, one per SM per instruction: SM ``s``'s queue counts pool slot
``s`` as its last streaming instruction (the pool slot it likely takes first), and pool slot ``k``
prefetches pool slot ``k + num_sms``. Each row holds ``PF_DESCS`` descriptors ``(address, bytes
per row, rows, row stride in bytes)`` (rows = 0: none), each weight row cut to its first
``pf_cols`` columns. Prefetches change no value: they are hints.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

PF_DESCS = 2       # descriptors per row (one instruction's weight streams)
PF_WORDS = 4       # int64 words per descriptor: address, bytes per row, rows, row stride (bytes)
PF_LANES = 128     # rows one descriptor can name (one row per lane of the kernel's prefetch)
_DESCS = tl.constexpr(PF_DESCS)
_WORDS = tl.constexpr(PF_WORDS)
_LANES = tl.constexpr(PF_LANES)


def _tensor_of(stream, weights: dict) -> torch.Tensor:
    if stream.layer is None:
        if stream.tensor == "lm_head" and "lm_head" not in weights:
            return weights["embed"]         # tied embeddings
        return weights[stream.tensor]
    return weights["layers"][stream.layer][stream.tensor]


def _descriptors(ins, lay, weights: dict, pf_cols: int, slot: int) -> list[list[int]]:
    out = []
    streams = ins.weight_streams(lay)
    if len(streams) > PF_DESCS:
        raise ValueError(f"{ins.NAME}: {len(streams)} weight streams, a prefetch row holds {PF_DESCS}")
    for s in streams:
        t = _tensor_of(s, weights)
        row_len, es = t.shape[-1], t.element_size()
        if s.nrows > PF_LANES:
            raise ValueError(f"{ins.NAME}: a weight stream of {s.nrows} rows; a descriptor covers {PF_LANES}")
        if not (0 <= s.row0 and s.row0 + s.nrows <= t.shape[0] and 0 <= s.col0 and s.col0 + s.ncols <= row_len):
            raise ValueError(f"slot {slot} ({ins.NAME}): stream {s} outside {s.tensor} {tuple(t.shape)}")
        addr = t.data_ptr() + (s.row0 * row_len + s.col0) * es
        nbytes = min(s.ncols, pf_cols) * es
        if addr % 16 or nbytes % 16 or (row_len * es) % 16:
            continue                # the bulk prefetch moves 16-byte granules: no hint for this one
        out.append([addr, nbytes, s.nrows, row_len * es])
    return out


def prefetch_table(tape, weights: dict, pf_cols: int, device, pf_ahead: int = 1) -> torch.Tensor:
    """int64 ``[len(tape) + num_sms * pf_ahead, PF_DESCS, PF_WORDS]`` (flattened): the prefetch
    plan of the module docstring; all zero with ``pf_cols`` 0."""
    from opcodes import BY_OPCODE, HEADER
    n = len(tape)
    out = torch.zeros(n + tape.num_sms * pf_ahead, PF_DESCS, PF_WORDS, dtype=torch.int64)
    if pf_cols:
        lay, words = tape.lay, tape.words.tolist()

        def desc(slot):
            w = words[slot]
            return _descriptors(BY_OPCODE[w[0]].decode(w[HEADER:]), lay, weights, pf_cols, slot)

        pool = list(tape.pool_range())
        pool_desc = [desc(p) for p in pool]
        for sm in range(tape.num_sms):
            # the queue's streaming instructions, then the pool slot this SM likely takes first
            stream = [(slot, d) for slot in tape.sm_range(sm) for d in [desc(slot)] if d]
            if sm < len(pool) and pool_desc[sm]:
                stream.append((None, pool_desc[sm]))
            for k, (_, d) in enumerate(stream[:pf_ahead]):
                out[n + sm * pf_ahead + k, :len(d)] = torch.tensor(d)
            for k, (slot, _) in enumerate(stream[:max(0, len(stream) - pf_ahead)]):
                if slot is not None:
                    d = stream[k + pf_ahead][1]
                    out[slot, :len(d)] = torch.tensor(d)
        # tickets go out in order, one per SM per instruction: the SM holding pool slot k
        # prefetches slot k + num_sms, the one some SM takes about one instruction later
        for k, p in enumerate(pool[:max(0, len(pool) - tape.num_sms)]):
            d = pool_desc[k + tape.num_sms]
            if d:
                out[p, :len(d)] = torch.tensor(d)
    return out.reshape(-1).to(device)


@triton.jit
def _bulk_prefetch_l2(addr, nbytes, on):
    # one cp.async.bulk.prefetch.L2 per lane where ``on``: the SM's TMA engine fetches the bytes
    # into L2 without a destination in the SM (sm_90)
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $3; mov.u32 $0, 0; }",
        "=r,l,r,r", [addr, on, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_row(pf_ptr, row):
    """Prefetch into L2 what row ``row`` of the table describes."""
    lane = tl.arange(0, _LANES)
    for d in tl.static_range(_DESCS):
        base = pf_ptr + (row * _DESCS + d) * _WORDS
        addr = tl.load(base)
        nbytes = tl.load(base + 1).to(tl.int32)
        rows = tl.load(base + 2)
        stride = tl.load(base + 3)
        a = addr + lane.to(tl.int64) * stride
        _bulk_prefetch_l2(a, nbytes + lane * 0, (lane < rows).to(tl.int32))
