"""Each opcode alone: one instruction's device function (through the real interpreter kernel, in the
Triton interpreter on the CPU) against its ``run_torch``, on random inputs.

For every opcode of a program, its first and its last instruction run alone: a one-SM tape whose
queue holds just that instruction (one instruction of every other opcode of the program sits after
the queue, never run, so that the kernel has every buffer the opcodes share). Every scratch buffer
starts from the same random values in the kernel and in the VM, and the regions the instruction
writes (``Instruction.writes``), its KV rows and its state must agree. Shapes are chosen so the
masked paths run: columns that do not divide the streaming width, rows that do not divide the
tile, a vocabulary that does not divide the LM head tile, a split O projection.
"""
from __future__ import annotations

import pytest
import torch

from interp.runtime import build_layer, launch, teardown
from opcodes import HEADER, NO_COUNTER, WORDS, Layout, ModelConfig, Tiling
from opcodes.reference import make_kv_cache, make_weights
from schedule.decoder_program import lower_decoder
from schedule.program import lower
from schedule.tape import Tape
from schedule.vm import VMState

POS = 21
MAX_SEQ = 32
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32}

# masks everywhere: d % bk, d % o_rows / down_rows, ffn % down_k, vocab % lm_rows, hd split of O
ODD = ModelConfig(layers=2, d=80, ffn=176, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="odd")
# gate/up's and the LM head's two loops (Tiling.row_bytes): [rows, bk] blocks (0) and whole rows;
# 256 bytes a stage gives blocks of 1 row (gate and up) to 2 rows (LM head) of the 80-column rows.
# The column-loop cases keep every layer's RESIDUAL (res_fold 0); the row-loop ones fold it into the
# next layer's QKV and O / O_REDUCE (Tiling.for_config's default at this size)
CASES = {
    "layer-masked": (ODD, dict(bk=64, o_rows=32, down_rows=32, gu_rows=16, down_k=128, red_rows=32, row_bytes=0,
                               res_fold=0), False),
    "layer-split-o": (ODD, dict(bk=32, o_k=32, o_rows=16, red_rows=32, down_rows=16, row_bytes=0, res_fold=0), False),
    "decoder": (ODD, dict(bk=64, row_bytes=0, res_fold=0), True),
    "rows-layer-masked": (ODD, dict(o_rows=32, down_rows=32, gu_rows=16, down_k=128, red_rows=32), False),
    "rows-split-o": (ODD, dict(o_k=32, o_rows=16, red_rows=32, down_rows=16, row_bytes=256), False),
    "rows-decoder": (ODD, dict(row_bytes=256), True),
}


def _words(ins) -> list[int]:
    ops = list(ins.operands())
    return [ins.OPCODE, NO_COUNTER, 0, NO_COUNTER, 0, NO_COUNTER] + ops + [0] * (WORDS - HEADER - len(ops))


def _weights(cfg: ModelConfig, decoder: bool) -> dict:
    w = make_weights(cfg, seed=3)
    if decoder:
        g = torch.Generator().manual_seed(4)
        w["embed"] = (0.5 * torch.randn(cfg.vocab, cfg.d, generator=g)).to(torch.bfloat16)
        w["final_norm"] = (1.0 + 0.1 * torch.randn(cfg.d, generator=g)).to(torch.bfloat16)
        w["lm_head"] = (torch.randn(cfg.vocab, cfg.d, generator=g) / cfg.d ** 0.5).to(torch.bfloat16)
    return w


class OneInstruction:
    """A kernel built once for a program's opcodes; :meth:`run` executes one instruction of it."""

    def __init__(self, case: str):
        cfg, tiling, decoder = CASES[case]
        lay = Layout(cfg, Tiling.for_config(cfg, **tiling), MAX_SEQ)
        self.prog = lower_decoder(lay) if decoder else lower(lay)
        self.lay = self.prog.lay
        reps = [next(i for i in self.prog.instrs if type(i) is c) for c in self.prog.classes()]
        words = torch.tensor([_words(i) for i in reps], dtype=torch.int32)
        self.tape = Tape(self.lay, 1, words, torch.tensor([0, 1, 1], dtype=torch.int32), [])
        self.weights = _weights(cfg, decoder)
        self.kv = make_kv_cache(cfg, MAX_SEQ, POS, seed=5)
        self.h = build_layer(self.weights, self.kv, cfg, MAX_SEQ, tape=self.tape, verify_tape=False)

    def run(self, ins, seed: int):
        """Run ``ins`` in the kernel and in the VM from the same random state; returns (kernel
        buffers, VM state, kernel KV, VM KV)."""
        h, lay, cfg = self.h, self.lay, self.lay.cfg
        g = torch.Generator().manual_seed(seed)
        for p in self.kv:                            # the rows this call may write start at zero
            for t in p:
                t[:, :, POS:] = 0
        st = VMState(lay, self.weights, [tuple(t.clone() for t in p) for p in self.kv],
                     torch.zeros(cfg.d), POS, self.tape.classes())
        for name, buf in st.buf.items():            # the same random inputs in both
            v = torch.randn(buf.numel(), generator=g)
            if name == "part_ml":                    # (running max, positive sum) pairs
                v.view(-1, 2)[:, 1] = v.view(-1, 2)[:, 1].abs() + 0.5
            if name == "amax":                       # (max logit, its index) pairs
                v.view(-1, 2)[:, 1] = torch.randperm(cfg.vocab, generator=g)[: v.numel() // 2].float()
            st.buf[name] = v.to(buf.dtype)
            if name in h.scratch:
                h.scratch[name].copy_(st.buf[name])
        if "tok" in h.state:
            h.state["tok"].fill_(int(torch.randint(cfg.vocab, (1,), generator=g)))
            st.x = h.state["tok"].clone()
        x = torch.randn(1, cfg.d, generator=g).to(torch.bfloat16)
        if "x0" in h.scratch:                        # a decoder's layer 0 reads the embedded row
            x = h.scratch["x0"].view(1, cfg.d)
        st.x = st.x if "tok" in h.state else x.reshape(-1).clone()
        last = lay.xout_row(cfg.layers - 1)         # the last layer's row
        out = st.buf["xout"].view(lay.n_xout_rows, cfg.d)[last:last + 1].clone()
        h.tape_dev[:WORDS] = torch.tensor(_words(ins), dtype=torch.int32)
        launch(h, x, POS, out)
        h.check()
        ins.run_torch(lay, st)
        got = dict(h.scratch)
        got["xout_last"] = out.reshape(-1)
        return got, st, self.kv

    def close(self):
        teardown(self.h)


@pytest.fixture(scope="module", params=list(CASES))
def harness(request):
    hx = OneInstruction(request.param)
    yield hx
    hx.close()


def _close(a: torch.Tensor, b: torch.Tensor, ins, what: str) -> None:
    """bf16 outputs may differ by one rounding step; fp32 ones by the opcode's ``TORCH_RTOL``."""
    rtol = max(1e-2 if a.dtype == torch.bfloat16 else 0.0, ins.TORCH_RTOL)
    assert torch.allclose(a.float(), b.float(), rtol=rtol, atol=rtol / 10), \
        f"{ins} {what}: max |kernel - torch| = {(a.float() - b.float()).abs().max():.3e}"


def test_every_opcode_alone_matches_run_torch(harness):
    lay, cfg = harness.lay, harness.lay.cfg
    checked = 0
    for k, cls in enumerate(harness.prog.classes()):
        mine = [i for i in harness.prog.instrs if type(i) is cls]
        for ins in {id(i): i for i in (mine[0], mine[-1])}.values():
            got, st, kv = harness.run(ins, seed=100 + k)
            for r in ins.writes(lay):
                if r.buf.startswith("kv_new"):       # the cache row at POS
                    j = 0 if r.buf == "kv_new_k" else 1
                    layer, rest = divmod(r.lo, cfg.kv_dim)
                    head, lo = divmod(rest, cfg.hd)
                    hi = lo + (r.hi - r.lo)
                    _close(kv[layer][j][0, head, POS, lo:hi], st.kv[layer][j][0, head, POS, lo:hi], ins, str(r))
                elif r.buf == "xout" and r.lo >= lay.xout_row(cfg.layers - 1) * cfg.d:   # the caller's output
                    o = lay.xout_row(cfg.layers - 1) * cfg.d
                    _close(got["xout_last"][r.lo - o:r.hi - o], st.buf["xout"][r.lo:r.hi], ins, str(r))
                else:
                    _close(got[r.buf][r.lo:r.hi], st.buf[r.buf][r.lo:r.hi], ins, str(r))
            if cls.NAME == "argmax":
                assert int(harness.h.state["tok"][0]) == st.next_token
                assert int(harness.h.state["toks"][POS]) == st.next_token
            checked += 1
    assert checked >= len(harness.prog.classes())
