"""The wall between the product and the lab: the product (opcodes, schedule, interp, megatape) never
imports ``bench``, not even inside a function; and inside the product the imports go one way,
opcodes <- schedule <- interp <- megatape. Checked on the source with ``ast`` (every import
statement anywhere in a file, relative imports resolved, and ``importlib.import_module`` /
``__import__`` of a constant name)."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: the product's packages, lowest first: each may import only those before it
ORDER = ("opcodes", "schedule", "interp", "megatape")
#: what no product package may import
LAB = "bench"
#: schedule is compile time: no command line and no pictures
EXTRA_BANNED = {"schedule": ("argparse", "matplotlib")}


def banned_for(pkg: str) -> set[str]:
    return {LAB, *ORDER[ORDER.index(pkg) + 1:], *EXTRA_BANNED.get(pkg, ())}


def _module_of(path: pathlib.Path, root: pathlib.Path) -> list[str]:
    """The dotted package a file's relative imports start from (``megatape/views/x.py`` -> [megatape, views])."""
    return list(path.relative_to(root).parent.parts)


def imported_names(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``: ``import a.b``, ``from a.b import c``
    (``a.b``), relative imports resolved against the file's package,
    and ``importlib.import_module("a.b")`` / ``__import__("a.b")`` with a constant name; at module
    level or nested anywhere (functions, classes, ``if TYPE_CHECKING``, ``try``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    pkg = _module_of(path, root)
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:     # relative: from the file's package up; past the top, from the root
                base = pkg[:max(0, len(pkg) - (node.level - 1))]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            # 'from .. import bench' past the top of a package: the names are the modules
            out += [(node.lineno, mod)] if mod else [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""
            if name in ("import_module", "__import__"):
                out.append((node.lineno, node.args[0].value))
    return out


def wall_violations(root: pathlib.Path) -> list[str]:
    """Every import in ``root``'s product packages (all ``.py`` files below them) that crosses the
    wall or goes against the order, as 'path:line: pkg imports name'."""
    root = pathlib.Path(root)
    bad = []
    for pkg in ORDER:
        banned = banned_for(pkg)
        for f in sorted((root / pkg).rglob("*.py")):
            for line, name in sorted(imported_names(f, root)):
                top = name.split(".")[0]
                if top in banned:
                    bad.append(f"{f.relative_to(root)}:{line}: {pkg} imports {name}")
    return bad


def test_the_product_never_imports_the_lab_and_imports_go_one_way():
    files = [f for pkg in ORDER for f in (ROOT / pkg).rglob("*.py")]
    assert len(files) > 40 and (ROOT / "megatape" / "views").is_dir()     # the walk sees the packages
    assert wall_violations(ROOT) == []


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for pkg in ORDER:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for rel, src in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(src)
    return tmp_path


BAD = {
    "megatape/cli.py": "def cmd():\n    from bench.driver import run\n    return run\n",          # lazy, in a function
    "megatape/views/deep.py": "class A:\n    def f(self):\n        import bench\n",                # a subpackage
    "interp/rt.py": "import os\nif os.environ.get('X'):\n    from megatape import cli\n",
    "schedule/s.py": "import importlib\nm = importlib.import_module('interp.runtime')\n",
    "opcodes/o.py": "try:\n    from schedule.tape import Tape\nexcept ImportError:\n    pass\n",
    "opcodes/p.py": "from . import base\nfrom .. import bench\n",                                 # relative, out of the package
    "schedule/t.py": "import argparse\n",
    "interp/u.py": "x = __import__('bench.tp_bench')\n",
}


def test_the_checker_finds_every_kind_of_violation(tmp_path):
    """The check can fail: a tree with one violation per file, nested, lazy, relative, dynamic."""
    got = wall_violations(_tree(tmp_path, BAD))
    want = {"megatape/cli.py:2: megatape imports bench.driver", "megatape/views/deep.py:3: megatape imports bench",
            "interp/rt.py:3: interp imports megatape", "schedule/s.py:2: schedule imports interp.runtime",
            "opcodes/o.py:2: opcodes imports schedule.tape", "schedule/t.py:1: schedule imports argparse",
            "interp/u.py:1: interp imports bench.tp_bench"}
    assert want <= set(got), got
    assert [g for g in got if g.startswith("opcodes/p.py")], got      # '.. import bench' out of opcodes
    assert not [g for g in got if "opcodes/p.py:1" in g], got         # 'from . import base' is opcodes itself


def test_the_checker_passes_imports_that_go_the_right_way(tmp_path):
    ok = {
        "megatape/cli.py": "def f():\n    from interp import build_layer\n    import schedule, opcodes\n"
                           "    from megatape.views import viz\n    from .measure import time_step\n",
        "megatape/views/v.py": "from ..measure import log\nimport matplotlib\n",
        "interp/rt.py": "from schedule import compile_model\nfrom opcodes import Tiling\nimport benchmark_tools\n",
        "schedule/s.py": "from opcodes.base import Tiling\nfrom . import tape\n",
        "opcodes/o.py": "import torch\nfrom .base import Tiling\n",
    }
    assert wall_violations(_tree(tmp_path, ok)) == []


@pytest.mark.parametrize("pkg,banned", [("opcodes", {"schedule", "interp", "megatape", "bench"}),
                                        ("schedule", {"interp", "megatape", "bench"}),
                                        ("interp", {"megatape", "bench"}), ("megatape", {"bench"})])
def test_the_order(pkg, banned):
    assert banned_for(pkg) - {"argparse", "matplotlib"} == banned


def test_the_lab_is_not_installed():
    """pyproject.toml installs the product only: ``bench`` runs from a clone (``python -m bench``)."""
    tomllib = pytest.importorskip("tomllib")          # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = meta["tool"]["setuptools"]["packages"]
    assert LAB not in packages and not [p for p in packages if p.startswith(LAB + ".")]
    assert {p.split(".")[0] for p in packages} == set(ORDER)
