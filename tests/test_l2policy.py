"""interp.l2policy: the PTX rewrite that gives a marked kernel's 16-byte async copies an L2 evict_first
policy (``Tiling.l2_first``), and its hook on Triton's compiler. The compiled kernel is checked in
tests/test_kernels_compile.py (case ``l2first``: every copy hinted, the code under the instruction cache)."""
from __future__ import annotations

import pytest
import torch

from interp import l2policy

_COPIES = """
	// begin inline asm
	cp.async.cg.shared.global [ %r2619 + 0 ], [ %rd763 + 0 ], 0x10, %r2620;
	// end inline asm
	cp.async.cg.shared.global [ %r7 + 0 ], [ %rd8 + 0 ], 0x10;
	cp.async.ca.shared.global [ %r3330 + 0 ], [ %rd930 + 0 ], 0x8, %r3331;
"""


def test_unmarked_ptx_is_unchanged():
    assert l2policy.rewrite_ptx(_COPIES) == _COPIES


def test_marked_ptx_hints_every_16_byte_copy():
    src = f"// {l2policy.MARK}\n" + _COPIES
    out = l2policy.rewrite_ptx(src)
    assert out.count("createpolicy.fractional.L2::evict_first.b64 %mt_l2p, 1.0;") == 2
    assert "cp.async.cg.shared.global.L2::cache_hint [ %r2619 + 0 ], [ %rd763 + 0 ], 0x10, %r2620, %mt_l2p;" in out
    assert "cp.async.cg.shared.global.L2::cache_hint [ %r7 + 0 ], [ %rd8 + 0 ], 0x10, %mt_l2p;" in out
    assert "cp.async.ca.shared.global [ %r3330 + 0 ], [ %rd930 + 0 ], 0x8, %r3331;" in out     # 8 bytes: as it was
    assert "cp.async.cg.shared.global [" not in out
    # each policy register lives in a block of its own
    assert out.count("{ .reg .b64 %mt_l2p;") == 2 and out.count("%mt_l2p; }") == 2


def test_marked_ptx_with_an_unknown_copy_form_fails_loudly():
    src = f"// {l2policy.MARK}\n\tcp.async.cg.shared.global [ %r1 + 0 ], [ %rd2 + 0 ], 0x10, %rd9;\n"
    with pytest.raises(ValueError, match="cannot rewrite.*%rd9"):
        l2policy.rewrite_ptx(src)


def test_marked_ptx_without_copies_fails():
    with pytest.raises(ValueError, match="no 16-byte cp.async"):
        l2policy.rewrite_ptx(f"// {l2policy.MARK}\n\tld.global.b32 %r1, [%rd1];\n")


def test_install_chains_a_hook_once(monkeypatch):
    from triton import knobs
    seen = []

    def theirs(backend, stages, options, language, capability):
        seen.append(language)
    monkeypatch.setattr(knobs.runtime, "add_stages_inspection_hook", theirs)
    l2policy.install()
    l2policy.install()
    hook = knobs.runtime.add_stages_inspection_hook
    stages = {"ptx": lambda src, md: src, "cubin": lambda src, md: src}
    hook(None, stages, None, "triton", 90)
    assert seen == ["triton"]                    # theirs ran, once: the second install kept the first hook
    marked = f"// {l2policy.MARK}\n" + _COPIES
    assert stages["ptx"](marked, {}) == l2policy.rewrite_ptx(marked)
    assert stages["ptx"](_COPIES, {}) == _COPIES


def test_the_interpreter_runs_the_kernel_without_the_marker():
    from opcodes import PRESETS, Layout, Tiling
    cfg = PRESETS["llama3.2-1b"]
    lay = Layout(cfg, Tiling.for_config(cfg, max_seq=256, l2_first=1), 256)
    assert lay.constexprs(interp=False)["L2_FIRST"] is True
    assert lay.constexprs(interp=True)["L2_FIRST"] is False
    assert Layout(cfg, Tiling.for_config(cfg, max_seq=256), 256).constexprs()["L2_FIRST"] is False


def test_the_kernel_source_marks_only_through_its_constexpr():
    from interp.codegen import kernel_source
    from opcodes import PRESETS, Layout, Tiling
    from opcodes.base import kernel_constexprs, kernel_pointers
    cfg = PRESETS["llama3.2-1b"]
    lay = Layout(cfg, Tiling.for_config(cfg, max_seq=256), 256)
    src = kernel_source(kernel_pointers(lay), list(kernel_constexprs(lay)))
    assert l2policy.MARK in src and "    if L2_FIRST:\n        sm = _l2_first_mark(sm)\n" in src


def test_tiling_checks_l2_first():
    from opcodes import Tiling
    with pytest.raises(ValueError, match="l2_first must be 0 or 1"):
        Tiling(l2_first=2)


def test_an_l2_first_decoder_runs_in_the_interpreter_as_the_default():
    # the interpreter takes the kernel without the marker (no inline asm there): the same tokens and logits
    from conftest import decode_tokens, decoder_weights, require_interpreter
    from opcodes import ModelConfig, Tiling
    require_interpreter()
    cfg = ModelConfig(layers=1, d=64, ffn=160, n_q=4, n_kv=2, hd=16, theta=10000.0, vocab=200, name="tiny-decoder")
    w = decoder_weights(cfg, 0)
    toks = (5, 17)          # two steps: the loads' policy is the same at every position (interpreter time)
    base = decode_tokens(w, cfg, Tiling.for_config(cfg, gu_rows=32), toks, 16)
    hinted = decode_tokens(w, cfg, Tiling.for_config(cfg, gu_rows=32, l2_first=1), toks, 16)
    assert torch.equal(base[0], hinted[0]) and base[1] == hinted[1]
