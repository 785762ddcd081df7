"""``pd`` stands beside ``layersplit``: the PD abort protocol and its stress must not import
layersplit, hicache or dsa_kernels (the LayerSplit ownership is passed in as data)."""

from __future__ import annotations

import ast
from pathlib import Path

import pd

FORBIDDEN = ("layersplit", "hicache", "dsa_kernels")
PD_DIR = Path(pd.__file__).parent


def imported(source: str) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names += [node.module or ""]
    return names


def forbidden_imports(source: str) -> list[str]:
    return [n for n in imported(source) if n.split(".")[0] in FORBIDDEN]


def source(name: str) -> str:
    """The source of ``pd.<name>`` (dotted, e.g. ``abort.stress``)."""
    path = PD_DIR.joinpath(*name.split("."))
    return (path / "__init__.py" if path.is_dir() else path.with_suffix(".py")).read_text()


def closure(root: str) -> set[str]:
    """``root`` and every ``pd`` module it imports, transitively."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += [m.split(".", 1)[1] for m in imported(source(name)) if m.startswith("pd.")]
    return seen


def test_the_checker_sees_every_import_form():
    source = "import layersplit.engine.ownership\nfrom hicache import x\ndef f():\n    from dsa_kernels.ops import y\n"
    assert forbidden_imports(source) == ["layersplit.engine.ownership", "hicache", "dsa_kernels.ops"]
    assert forbidden_imports("import pd.abort.sim\nfrom pd import topology\n") == []


def test_the_abort_stress_imports_none_of_them():
    modules = closure("abort.stress") | closure("abort.check")
    assert {f"abort.{m}" for m in ("decode_side", "prefill_side", "topology", "transfer_engine", "cluster")} <= modules
    assert not any(m.startswith("spec") for m in modules)  # the two rooms share nothing
    assert {m: forbidden_imports(source(m)) for m in sorted(modules) if forbidden_imports(source(m))} == {}
