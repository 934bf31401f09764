"""The package's top-level modules import each other without circles: every import of a
detgemm_cute module (top-level or inside a function) is an edge, and the graph has no
cycle. Library modules import what they use from the module that defines it, not from the
package `__init__` (which only re-exports)."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "detgemm_cute"


def _module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    p = PKG.parent.joinpath(*name.split("."))
    return p.with_suffix(".py").is_file() or (p / "__init__.py").is_file()


def _edges(path: Path) -> set[str]:
    """The detgemm_cute modules `path` imports (submodules where the name is one, else the
    package the name is read from)."""
    me = _module_name(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "detgemm_cute"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - (node.level - 1)]
                src = ".".join(base + ([node.module] if node.module else []))
            else:
                src = node.module or ""
            if src.split(".")[0] != "detgemm_cute":
                continue
            for a in node.names:
                sub = f"{src}.{a.name}"
                out.add(sub if _is_module(sub) else src)
    out.discard(me)
    return out


def _graph() -> dict[str, set[str]]:
    """Edges between the package `__init__` and the modules directly in it."""
    top = {_module_name(p) for p in PKG.glob("*.py")}
    return {m: {e for e in _edges(PKG.parent / (m.replace(".", "/") + (
        "/__init__.py" if m == "detgemm_cute" else ".py"))) if e in top} for m in top}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert "detgemm_cute.cli" in graph and "detgemm_cute.demo" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_the_cycle_finder_finds_cycles():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_library_modules_do_not_import_the_package_init():
    """nn, functional, ops, mode, amp build on the modules that define things."""
    graph = _graph()
    for name in ("nn", "functional", "ops", "grads", "mode", "amp", "tables"):
        mod = f"detgemm_cute.{name}"
        if mod in graph:
            assert "detgemm_cute" not in graph[mod], f"{mod} imports the package __init__"
    assert "detgemm_cute.cli" not in graph["detgemm_cute.demo"]
