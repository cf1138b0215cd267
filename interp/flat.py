"""The tables of the flat loop (``Tiling.flat``; the loop itself is ``interp.codegen._emit_flat``).

A *run* is a maximal sequence of consecutive streaming instructions (opcodes whose ``FLAT_BIT``
``Tiling.flat`` sets) in one SM's queue; a pool slot of such an opcode is a run of its own (an SM takes pool slots one at a
time). The kernel streams a run as one software-pipelined loop over its tiles' blocks
(``Instruction.flat_blocks``: ``FLAT_ROWS`` whole rows of d columns each), so the weights of a tile's
first blocks are in flight while the tile before it ends and while the SM waits for the tile's
inputs. Every tile of these opcodes takes this path, so an output row's sum does not depend on the
schedule.

``frun``  int32 [slots, 3]: at a run's first slot (first block, end block, slots in the run); 0 0 0
          elsewhere
``fblk``  int64 [blocks, 4]: the element offsets from ``fbase`` of the block's two halves' first
          rows (their first column included), their row stride, and ``slot | first << 32 |
          last << 33 | block-in-tile << 40`` (first / last: the tile's first / last block)
``fbase`` layer 0's Wq: the kernel reaches every streamed matrix from it
``fvec``  bf16 [SMs, d]: the current tile's input vector, written at its first block and read back
          in the layout of the blocks' columns
"""
from __future__ import annotations

import torch

from opcodes import FLAT_ROWS
from schedule.tape import Tape, decode_slot


def _runs(tape: Tape) -> list[list[int]]:
    """The runs of slots, in tape order."""
    mask = tape.lay.tiling.flat
    runs = []
    for sm in range(tape.num_sms):
        cur: list[int] = []
        for k in tape.sm_range(sm):
            if type(decode_slot(tape, k, sm).ins).FLAT_BIT & mask:
                cur.append(k)
            else:
                if cur:
                    runs.append(cur)
                cur = []
        if cur:
            runs.append(cur)
    runs += [[k] for k in tape.pool_range() if type(decode_slot(tape, k).ins).FLAT_BIT & mask]
    return runs


def flat_tables(tape: Tape, weights: dict, device) -> dict:
    """``frun_ptr``, ``fblk_ptr`` and ``fbase_ptr`` of a flat kernel for ``tape`` and the caller's
    ``weights`` (used in place: the block offsets are from ``fbase`` to the caller's tensors)."""
    lay = tape.lay
    d, half = lay.cfg.d, FLAT_ROWS // 2
    layers = weights["layers"]
    base = layers[0]["q"]
    addr0 = base.data_ptr()

    def offset(key, layer, row, col0):
        t = layers[layer][key]
        if t.dim() != 2 or t.stride(1) != 1 or t.dtype != base.dtype:
            raise ValueError(f"Tiling.flat: weights['layers'][{layer}][{key!r}] must be a row-major bf16 matrix")
        delta = t.data_ptr() - addr0
        if delta % 16 or (t.stride(0) * 2) % 16:
            raise ValueError(f"Tiling.flat: weights['layers'][{layer}][{key!r}] is not 16-byte aligned in its rows")
        return delta // 2 + row * t.stride(0) + col0, t.stride(0)

    frun = torch.zeros(len(tape), 3, dtype=torch.int32)
    blocks = []
    for run in _runs(tape):
        b0 = len(blocks)
        for slot in run:
            bl = decode_slot(tape, slot).ins.flat_blocks(lay)
            for bi, ((ka, ra), (kb, rb), layer, col0) in enumerate(bl):
                oa, sa = offset(ka, layer, ra, col0)
                ob, sb = offset(kb, layer, rb, col0)
                if sa != sb:
                    raise ValueError(f"Tiling.flat: {ka!r} and {kb!r} of one block have different row strides")
                if (ra + half > layers[layer][ka].shape[0] or rb + half > layers[layer][kb].shape[0]
                        or col0 + d > layers[layer][ka].shape[1]):
                    raise ValueError(f"Tiling.flat: slot {slot}'s block {bi} is outside its matrices")
                meta = slot | (int(bi == 0) << 32) | (int(bi == len(bl) - 1) << 33) | (bi << 40)
                blocks.append((oa, ob, sa, meta))
        frun[run[0]] = torch.tensor([b0, len(blocks), len(run)], dtype=torch.int32)
    fblk = torch.tensor(blocks or [(0, 0, 0, 0)], dtype=torch.int64)
    fvec = torch.zeros(tape.num_sms * d, dtype=torch.bfloat16, device=device)
    return {"frun_ptr": frun.reshape(-1).to(device), "fblk_ptr": fblk.reshape(-1).to(device), "fbase_ptr": base,
            "fvec_ptr": fvec}
