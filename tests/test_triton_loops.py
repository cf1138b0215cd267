"""A Triton pitfall the CPU tests cannot see, checked on the source instead.

Triton's frontend decides which variables a ``while`` or ``for`` loop carries by running the body
once and keeping the names whose value *object* changed (``CodeGenerator._find_carries``, both loops). If two names hold one value before the loop
(``lo = t``) and the body assigns one from the other (``t = lo``), the name looks unchanged and is
not carried: on the GPU the assignment is lost, while the Triton interpreter (the CPU tests) runs
Python and keeps it. SAMPLE's thresholds as one loop (bench/NOTES.md v115, session 25) drew wrong
tokens on the GPU this way and right ones in every CPU test. This test reads every ``@triton.jit``
function of the opcodes and the interpreter and fails on such an assignment; the README's "Adding an
opcode" says to give each loop variable its own initial value.
"""
from __future__ import annotations

import ast
import pathlib
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _name_pair(node: ast.AST):
    """(target, source) of ``a = b`` between two plain names, else None."""
    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
            and isinstance(node.value, ast.Name):
        return node.targets[0].id, node.value.id
    return None


def aliased_loop_assignments(fn: ast.FunctionDef) -> list[str]:
    """Problems of one function: a name that a loop (while or for) assigns only as ``a = b`` where ``a`` and
    ``b`` hold the same value object when the loop starts (assignments before the loop, in line
    order): the frontend sees no change and does not carry it. A name the loop also gives a new
    value (``a = f(...)``, ``a += 1``) is carried, aliases or not."""
    assigns = sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Assign, ast.AugAssign, ast.AnnAssign))),
                     key=lambda n: n.lineno)
    out = []
    for loop in (n for n in ast.walk(fn) if isinstance(n, (ast.While, ast.For))):
        inside = {id(n) for n in ast.walk(loop)}
        group: dict[str, int] = {}
        fresh = iter(range(1 << 30))
        for node in assigns:
            if node.lineno >= loop.lineno or id(node) in inside:
                continue
            pair = _name_pair(node)
            if pair:
                a, b = pair
                group[a] = group.setdefault(b, next(fresh))
            else:
                for t in ([node.target] if not isinstance(node, ast.Assign) else node.targets):
                    for nm in (x for x in ast.walk(t) if isinstance(x, ast.Name)):
                        group[nm.id] = next(fresh)
        # per name assigned in the loop: its assignments, and whether any gives it a new object
        seen: dict[str, list] = {}
        for node in ast.walk(loop):
            pair = _name_pair(node)
            if pair:
                seen.setdefault(pair[0], []).append((node, group.get(pair[1]) is not None
                                                     and group.get(pair[1]) == group.get(pair[0])))
            elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
                for t in ([node.target] if not isinstance(node, ast.Assign) else node.targets):
                    for nm in (x for x in ast.walk(t) if isinstance(x, ast.Name)):
                        seen.setdefault(nm.id, []).append((node, False))
        for name, hits in seen.items():
            if all(alias for _, alias in hits):
                node = hits[0][0]
                kind = "while" if isinstance(loop, ast.While) else "for"
                out.append(f"{fn.name}, line {node.lineno}: `{name} = {_name_pair(node)[1]}` in the {kind} loop of "
                           f"line {loop.lineno}, where both hold one value when it starts and nothing else in "
                           f"the loop assigns `{name}`: Triton does not carry it (give each loop variable its "
                           f"own initial value)")
    return out


def problems_in(source: str) -> list[str]:
    tree = ast.parse(source)
    return [p for fn in ast.walk(tree) if isinstance(fn, ast.FunctionDef) and _is_jit(fn)
            for p in aliased_loop_assignments(fn)]


def test_no_triton_loop_loses_an_aliased_assignment():
    files = sorted((ROOT / "opcodes").glob("*.py")) + sorted((ROOT / "interp").glob("*.py"))
    found = [f"{p.relative_to(ROOT)}: {msg}" for p in files for msg in problems_in(p.read_text())]
    assert not found, "\n".join(found)


def test_the_generated_kernels_have_none():
    """The interpreter kernel's source is generated (``interp.codegen``): its wait loops too, for a
    greedy and a sampling whole-model decoder."""
    from interp.codegen import kernel_source
    from opcodes import PRESETS, Tiling, kernel_constexprs, kernel_pointers
    from opcodes.decoder import DecoderLayout
    from schedule.decoder_program import lower_decoder
    cfg = PRESETS["llama3.2-1b"]
    lay = DecoderLayout(cfg, Tiling.for_config(cfg), 1152)
    for sample in (False, True):
        used = tuple(lower_decoder(lay, sample=sample).classes())
        src = kernel_source(kernel_pointers(lay, used), list(kernel_constexprs(lay, used=used)), used)
        assert "while " in src and problems_in(src) == [], sample


def test_the_check_finds_v115s_loop():
    """The shape of SAMPLE's v115 thresholds loop (34f5ffb) is flagged; with its own initial value
    for ``lo`` (the fix) it is not."""
    v115 = textwrap.dedent("""
        @triton.jit
        def thresholds(m, n):
            t = tl.full([], -1.0, tl.float32)
            lo = t
            ph = m
            it = 0
            while it < n:
                if lo == ph:
                    t = lo
                else:
                    lo = lo + 1.0
                it += 1
            return t
    """)
    found = problems_in(v115)
    assert len(found) == 1 and "`t = lo`" in found[0] and "thresholds, line 10" in found[0], found
    fixed = v115.replace("    lo = t\n", "    lo = tl.full([], -1.0, tl.float32)\n")
    assert fixed != v115 and problems_in(fixed) == []
    # a name given a new value before the loop no longer shares the old one
    assert problems_in(v115.replace("    ph = m\n", "    ph = m\n    t = m * 2.0\n")) == []
    # not jitted: plain Python, not the frontend's rule
    assert problems_in(v115.replace("@triton.jit\n", "")) == []
    # a for loop is carried by the same rule
    as_for = v115.replace("    while it < n:\n", "    for j in range(n):\n")
    found = problems_in(as_for)
    assert len(found) == 1 and "`t = lo` in the for loop" in found[0], found
