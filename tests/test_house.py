"""The house rules, read from the source (every import statement, at module level or inside a function):

* the wheel's top-level packages are the design card's — ``layersplit``, ``hicache``, ``dsa_kernels`` — and
  ``lsconfig``, the shared config below all three (``dsa_kernels`` reads its environment variables, so it
  cannot live inside ``layersplit`` without an arrow pointing up);
* arrows point down only: ``dsa_kernels`` <- ``hicache`` (``sanitizer`` <- ``runtime`` <- the tiers) <-
  ``layersplit`` (``plan`` at the bottom, pure arithmetic: no torch, nothing of ``engine``/``sglang_plugin``);
* ``layersplit.pd`` imports only the shared config (the LayerSplit ownership reaches it as data), and its two
  rooms (``abort``, ``spec``) share nothing;
* nothing imports the CLI but the CLI (and the maintainers' tools, which are command lines themselves);
  nothing in the wheel imports ``tools`` or ``tests``;
* no import circle among the wheel's modules.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

from tests.paths import ROOT

PACKAGES = ("dsa_kernels", "hicache", "layersplit", "lsconfig")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules(roots: tuple[str, ...] = PACKAGES + ("tools",)) -> dict[str, Path]:
    return {_module_name(p): p for r in roots for p in sorted((ROOT / r).rglob("*.py")) if "__pycache__" not in p.parts}


def _resolve(name: str, level: int, here: str, is_pkg: bool) -> str:
    if not level:
        return name
    base = here.split(".") if is_pkg else here.split(".")[:-1]
    base = base[: len(base) - level + 1]
    return ".".join(base + ([name] if name else []))


@cache
def imports(module: str) -> tuple[str, ...]:
    """Every module ``module`` imports (``from P import n`` counts as ``P.n`` where that is a module)."""
    path = modules()[module]
    known = modules()
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node.module or "", node.level, module, path.name == "__init__.py")
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known]
            out += subs if len(subs) == len(node.names) else [base, *subs]
    return tuple(out)


def _under(name: str, *prefixes: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _ours(name: str) -> bool:
    return _under(name, *PACKAGES, "tools", "tests")


def violations(sources: tuple[str, ...], allowed) -> dict[str, list[str]]:
    """``{module: [imports of ours it may not make]}`` for every module under ``sources``."""
    found = {}
    for m in modules():
        if _under(m, *sources):
            bad = [i for i in imports(m) if _ours(i) and not allowed(i)]
            if bad:
                found[m] = bad
    return found


def test_the_reader_sees_every_import_form():
    src = "import hicache.runtime.streams\nfrom . import core\ndef f():\n    from ..plan import choices\n"
    assert _resolve("", 1, "hicache.sanitizer", True) == "hicache.sanitizer"
    assert _resolve("plan", 2, "layersplit.engine.engine", False) == "layersplit.plan"
    tree = [n for n in ast.walk(ast.parse(src)) if isinstance(n, (ast.Import, ast.ImportFrom))]
    assert len(tree) == 3  # a function-level import is an import too


def test_the_wheel_holds_the_cards_packages_only():
    on_disk = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert on_disk == sorted(PACKAGES + ("tests", "tools"))
    text = (ROOT / "pyproject.toml").read_text()
    assert 'include = ["dsa_kernels*", "hicache*", "layersplit*", "lsconfig*"]' in text


RULES = {
    "dsa_kernels": ("dsa_kernels", "lsconfig"),
    "lsconfig": ("lsconfig",),
    "hicache.sanitizer": ("hicache.sanitizer", "dsa_kernels", "lsconfig"),
    "hicache.runtime": ("hicache.runtime", "hicache.sanitizer", "dsa_kernels", "lsconfig"),
    "hicache": ("hicache", "dsa_kernels", "lsconfig"),
    "layersplit.plan": ("layersplit.plan", "lsconfig", "dsa_kernels.layout"),
    "layersplit.pd": ("layersplit.pd", "lsconfig"),
    "layersplit.engine": ("layersplit.engine", "layersplit.plan", "hicache", "dsa_kernels", "lsconfig"),
    "layersplit.serving": ("layersplit.serving", "layersplit.engine", "layersplit.plan", "hicache", "dsa_kernels",
                           "lsconfig"),
    "layersplit.gpu_check": ("layersplit.gpu_check", "layersplit.engine", "layersplit.plan", "hicache", "dsa_kernels",
                             "lsconfig"),
    "layersplit.sglang_plugin": ("layersplit.sglang_plugin", "layersplit.plan", "layersplit.pd", "hicache",
                                 "dsa_kernels", "lsconfig"),
    "tools": ("tools", "layersplit", "hicache", "dsa_kernels", "lsconfig"),
    "layersplit.sglang_plugin.spec": ("layersplit.sglang_plugin.spec", "layersplit.sglang_plugin.compat",
                                      "layersplit.pd.spec", "lsconfig"),
}


@pytest.mark.parametrize("room", sorted(RULES))
def test_arrows_point_down(room):
    below = RULES[room]
    inner = [r for r in RULES if r != room and _under(r, room)]  # a sub-room has its own rule
    found = {m: bad for m, bad in violations((room,), lambda i: _under(i, *below)).items()
             if not any(_under(m, r) for r in inner)}
    assert found == {}


def test_the_plan_is_arithmetic():
    heavy = {m: [i for i in imports(m) if _under(i, "torch", "triton", "numpy", "sglang")]
             for m in modules() if _under(m, "layersplit.plan")}
    assert {m: v for m, v in heavy.items() if v} == {}


def test_the_pd_rooms_share_nothing():
    assert violations(("layersplit.pd.abort",), lambda i: not _under(i, "layersplit.pd.spec")) == {}
    assert violations(("layersplit.pd.spec",), lambda i: not _under(i, "layersplit.pd.abort")) == {}


def test_nothing_imports_the_cli_or_the_tools():
    product = violations(PACKAGES, lambda i: not _under(i, "tools", "tests", "layersplit.cli"))
    cli_only = {m: v for m, v in product.items() if not _under(m, "layersplit.cli") and m != "layersplit.__main__"}
    assert cli_only == {}
    assert {m: v for m, v in product.items() if any(_under(i, "tools", "tests") for i in v)} == {}


def test_no_import_circle():
    graph = {m: {i for i in imports(m) if i in modules()} for m in modules()}
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    assert cycles == []
