"""The package's shape (issue 11, docs/architecture.md): imports point down the layers, no
import cycle between modules, no module over 500 lines, and the engine never calls the KV
manager (the scheduler alone does). Every import counts, also one inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "pagedkv"

#: lowest first; a module may import its own package and anything of a lower or equal layer.
LAYERS = {
    "errors": 0, "cpu_isa": 1, "csrc": 1, "utils": 1, "_bundled": 1, "gguf_header": 1, "kv": 2, "attention": 3, "model": 4, "testing": 4,
    "worker": 5, "distributed": 6, "engine": 7, "native": 7, "server": 8, "serving": 9, "bench": 10, "cli": 11, "__init__": 11,
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(path: Path, mods: dict[str, Path]) -> set[str]:
    """pagedkv modules imported anywhere in ``path`` (resolved to module names)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            # ``from pkg import submodule`` depends on the submodule, ``from mod import name``
            # on the module (a package's own __init__ runs first either way: not an edge)
            names = [
                f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                for a in node.names
            ]
        else:
            continue
        for name in names:
            if not name.startswith("pagedkv"):
                continue
            while name not in mods and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in mods:
                out.add(name)
    return out


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    return {m: _imports(p, mods) - {m} for m, p in mods.items()}


def _layer(module: str) -> tuple[str, int]:
    top = module.split(".")[1] if "." in module else "__init__"
    return top, LAYERS[top]


def test_every_package_has_a_layer():
    tops = {_layer(m)[0] for m in _modules()}
    assert tops <= set(LAYERS), tops - set(LAYERS)


def test_imports_point_down_the_layers():
    upward = []
    for mod, deps in _graph().items():
        top, lvl = _layer(mod)
        for dep in deps:
            dtop, dlvl = _layer(dep)
            if dep == "pagedkv" and mod != "pagedkv":
                upward.append(f"{mod} -> pagedkv (import the submodule, not the facade)")
            elif dtop != top and dlvl > lvl:
                upward.append(f"{mod} -> {dep}")
    assert not upward, "upward imports:\n" + "\n".join(sorted(upward))


def test_no_import_cycle_between_modules():
    graph = _graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_cycle_detector_finds_a_planted_cycle(monkeypatch):
    """The detector above is not vacuous: a cycle a -> b -> a is reported."""
    fake = {"pagedkv.kv.a": {"pagedkv.kv.b"}, "pagedkv.kv.b": {"pagedkv.kv.a"}}
    monkeypatch.setitem(test_no_import_cycle_between_modules.__globals__, "_graph", lambda: fake)
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycle_between_modules()


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_module_size(path: Path):
    n = len(path.read_text().splitlines())
    assert n <= 500, f"{path.relative_to(PKG)} has {n} lines (at most 500)"


def test_engine_makes_no_call_on_the_kv_manager():
    """Only the scheduler drives the KV manager (vLLM v1's rule): engine.py never calls
    ``.kv.<method>`` nor imports ``KVCacheManager``."""
    tree = ast.parse((PKG / "engine" / "engine.py").read_text())
    calls = [
        ast.unparse(n.func) for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
        and isinstance(n.func.value, ast.Attribute) and n.func.value.attr in ("kv", "kv_manager")
    ]
    assert not calls, calls
    names = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert "KVCacheManager" not in names


def test_every_name_imported_from_pagedkv_exists():
    # a name moved between modules leaves a stale import that only fails when its function
    # runs (`pagedkv bench quality` imported markdown_table from bench.common after it moved
    # to bench.report): every ``from pagedkv... import name``, also inside functions, resolves
    import importlib

    mods = _modules()
    stale = []
    for path in mods.values():
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").startswith("pagedkv")):
                continue
            mod = importlib.import_module(node.module)
            stale += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                      if not hasattr(mod, a.name) and f"{node.module}.{a.name}" not in mods]
    assert stale == []
