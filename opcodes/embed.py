"""EMBED: gather one column block of the token's embedding row into the layer-0 input.

    x[c] = embed[tok, c]        for c in [col0, col0 + EMB_COLS)   (bf16 copy)

``tok`` is read from a device int32 buffer (``tok_ptr``): the host writes it for a step it drives
(``decode_step``), the previous call's ARGMAX writes it during greedy generation, so the host
never has to see the token. ``x`` is the call's ``x_ptr`` (the decoder passes its ``x0`` scratch
row every call), which layer 0's tiles read once every EMBED tile has signalled.
A token outside ``[0, vocab)`` is clamped into it (the host checks tokens it is handed).
Streams ``EMB_COLS * 2`` bytes of the embedding table.
"""
from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from .base import Cost, Instruction, Layout, Region, register, tile_start


@triton.jit
def embed_device(col0, x_ptr, tok_ptr, embed_ptr, D: tl.constexpr, VOCAB: tl.constexpr, EMB_COLS: tl.constexpr):
    tok = tl.load(tok_ptr, cache_modifier=".cg")
    tok = tl.minimum(tl.maximum(tok, 0), VOCAB - 1).to(tl.int64)
    cols = col0 + tl.arange(0, EMB_COLS)
    cm = cols < D
    row = tl.load(embed_ptr + tok * D + cols, mask=cm, other=0.0)
    tl.store(x_ptr + cols, row, mask=cm)


@register
@dataclass(frozen=True)
class Embed(Instruction):
    col0: int

    NAME = "embed"
    STAGE = 0
    ARGS = ("x_ptr", "tok_ptr", "embed_ptr", "D", "VOCAB", "EMB_COLS")
    # the branch is in every kernel; on a layout without a vocabulary it is never taken and is
    # compiled at the smallest tile
    CONSTEXPRS = {"VOCAB": lambda lay: max(1, lay.cfg.vocab),
                  "EMB_COLS": lambda lay: lay.emb_cols if Embed.applies(lay) else 16}
    WHOLE_MODEL = True
    device = embed_device

    SCRATCH = {"x0": "bf16"}     # the embedded token: layer 0's input, reaching the kernel as x_ptr
    STATE = {"tok": "i32"}       # the token this call embeds (ARGMAX's output)

    @classmethod
    def scratch_shapes(cls, lay: Layout) -> dict:
        return {"x0": (1, lay.cfg.d)}

    @classmethod
    def state_shapes(cls, lay: Layout) -> dict:
        return {"tok": (1,)}

    def check_operands(self, lay: Layout) -> list[str]:
        if not self.applies(lay):
            return ["embed needs a DecoderLayout (opcodes.decoder)"]
        return tile_start("col0", self.col0, lay.emb_cols, lay.cfg.d)

    def _cols(self, lay: Layout) -> tuple[int, int]:
        return self.col0, min(self.col0 + lay.emb_cols, lay.cfg.d)

    def writes(self, lay: Layout) -> list[Region]:
        lo, hi = self._cols(lay)
        return [Region("x0", lo, hi)]

    def cost(self, lay: Layout) -> Cost:
        lo, hi = self._cols(lay)
        return Cost(hbm_bytes=2 * (hi - lo), l2_bytes=2 * (hi - lo) + 4, flops=0)

    def run_torch(self, lay: Layout, st) -> None:
        # the VM runs a decoder call with x = the (1,) token and weights = the whole-model dict
        tok = min(max(int(st.x.reshape(-1)[0]), 0), lay.cfg.vocab - 1)
        lo, hi = self._cols(lay)
        st.buf["x0"][lo:hi] = st.model["embed"][tok, lo:hi]
