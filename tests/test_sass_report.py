"""bench.sass_report reads nvdisasm's listing: instructions by source line, loops as backward branches,
and the span from a source line to the next async copy (the CPU half; the disassembly itself needs only
Triton's bundled ptxas / nvdisasm)."""
from __future__ import annotations

import pytest

from bench.sass_report import kinds, loops, main, parse, report, span

SASS = """
\t.section\t.text.other,"ax",@progbits
\t//## File "/x/other.py", line 1
        /*0000*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
\t.section\t.text.megakernel,"ax",@progbits
\t.sectionflags\t@"SHF_BARRIERS=1"
megakernel:
\t//## File "/w/opcodes/gate_up.py", line 36
        /*0000*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
\t//## File "/w/opcodes/common.py", line 213 inlined at "/w/opcodes/gate_up.py", line 36
        /*0010*/                   SHFL.BFLY PT, R5, R4, 0x10, 0x1f ;
        /*0020*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0030*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
.L_x_7:
\t//## File "/w/opcodes/common.py", line 229
        /*0040*/                   LDS.128 R8, [R1] ;
        /*0050*/                   FFMA R9, R8, R8, R9 ;
        /*0060*/              @!P0 STS [R1], R9 ;
        /*0070*/                   LDGSTS.E.BYPASS.128 [R1], desc[UR4][R2.64] ;
        /*0080*/               @P1 BRA `(.L_x_7) ;
\t.section\t.nv.info,"",@"SHT_CUDA_INFO"
        /*0000*/                   FFMA R1, R1, R1, R1 ;
"""


def test_parse_takes_the_kernels_text_only_and_the_innermost_line():
    ins, labels = parse(SASS)
    assert [i.addr for i in ins] == list(range(0, 0x90, 0x10))
    assert labels == {".L_x_7": 0x40}
    assert ins[0].src == ("gate_up.py", 36) and ins[1].src == ("common.py", 213)
    assert [i.op for i in ins[4:7]] == ["LDS", "FFMA", "STS"]          # a predicate is not the mnemonic


def test_loops_and_spans():
    ins, labels = parse(SASS)
    (a, b, body), = loops(ins, labels, min_len=2)
    assert (a, b, len(body)) == (0x40, 0x80, 5)
    assert kinds(body) == {"STS": 1, "LDS": 1, "LDGSTS": 1, "FFMA": 1}
    assert loops(ins, labels, min_len=6) == []
    s = span(ins, ("gate_up.py", 36))
    assert len(s) == 3 and kinds(s) == {"BAR": 1, "SHFL": 1, "LDG": 1}
    with pytest.raises(ValueError, match="no instruction of qkv.py:1"):
        span(ins, ("qkv.py", 1))
    text = "\n".join(report(ins, labels, ("gate_up.py", 36)))
    assert text.startswith("9 instructions, 0.14 KB of code") and "gate_up.py:36 to the next LDGSTS: 3" in text


def test_bad_arguments_are_named(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path / "none.ptx")])
    assert "no PTX file at" in capsys.readouterr().err
    p = tmp_path / "k.ptx"
    p.write_text("")
    with pytest.raises(SystemExit):
        main([str(p), "--span", "gate_up.py"])
    assert "--span takes FILE:LINE" in capsys.readouterr().err


def test_a_loops_spills_are_counted():
    """Local-memory traffic (``STL`` / ``LDL``: ptxas's spills) is counted per loop: where a wider tile's registers
    push spills into another opcode's loop (bench/notes/s47.md: v179 + v178's 1024-row kernel)."""
    sass = SASS.replace("        /*0050*/                   FFMA R9, R8, R8, R9 ;",
                        "        /*0050*/                   LDL R9, [R1+0x10] ;")
    sass = sass.replace("        /*0060*/              @!P0 STS [R1], R9 ;",
                        "        /*0060*/                   STL [R1+0x10], R9 ;")
    ins, labels = parse(sass)
    (_, _, body), = loops(ins, labels, min_len=2)
    assert kinds(body) == {"LDS": 1, "LDGSTS": 1, "LDL": 1, "STL": 1}
