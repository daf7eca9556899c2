"""The reference's imports run one way: no cycles, no harness imports, parts in the documented order.

Every ``import`` / ``from ... import`` statement of ``reference/`` counts, wherever it stands
(module level or inside a function), and so does ``importlib.import_module("<literal>")``.
Not edges: imports under ``if TYPE_CHECKING:`` (annotations only, never executed) and the
implicit import of a parent package.
The order of the parts is the one stated in ``reference/__init__.py``'s docstring.
"""

from __future__ import annotations

import ast
from pathlib import Path

REFERENCE = Path(__file__).resolve().parents[2] / "reference"

# part -> the parts it may import (besides itself); see reference/__init__.py's docstring
ALLOWED = {
    "api": set(),
    "wrap": {"api"},
    "fsdp1": {"api", "wrap"},
    "fsdp2": {"api"},
    "package": {"api", "wrap", "fsdp1", "fsdp2"},
}
HARNESS = ("conformance", "perf", "tests")


def _part(module: str) -> str:
    for prefix, part in (
        ("reference.api", "api"),
        ("reference.wrap", "wrap"),
        ("reference._fsdp1", "fsdp1"),
        ("reference._fully_shard", "fsdp2"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return part
    if module == "reference":
        return "package"
    raise AssertionError(f"{module} belongs to no part: add it to ALLOWED and the docstring")


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root`` (a package)."""
    result = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        result[".".join(parts)] = path
    return result


def _executed_nodes(tree: ast.AST):
    """Every node of ``tree`` except the bodies of ``if TYPE_CHECKING:`` (never executed)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
        else:
            stack.extend(ast.iter_child_nodes(node))


def _imported_names(module: str, path: Path, known: set[str]) -> list[tuple[str, int]]:
    """``(imported module, line)`` for every import in the file, resolved to a known module
    where a ``from`` import names a submodule."""
    is_package = path.name == "__init__.py"
    found: list[tuple[str, int]] = []
    for node in _executed_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.append((sub if sub in known else base, node.lineno))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            found.append((node.args[0].value, node.lineno))
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[str]]:
    """Edges between the package's modules, and the harness imports found (as messages)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    harness: list[str] = []
    for module, path in modules.items():
        for target, line in _imported_names(module, path, set(modules)):
            if target.split(".")[0] in HARNESS:
                harness.append(f"{path}:{line} imports {target}")
            while target and target not in modules and "." in target:
                target = target.rsplit(".", 1)[0]  # `import a.b.c` of a name, not a module
            if target in modules and target != module:
                graph[module].add(target)
    return graph, harness


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as ``[a, b, ..., a]``, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_reference_imports_have_no_cycle():
    """No cycle among the reference's modules, function-level imports included."""
    graph, _ = import_graph(REFERENCE)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_reference_never_imports_the_harness():
    _, harness = import_graph(REFERENCE)
    assert not harness, "reference/ must import torch only:\n" + "\n".join(harness)


def test_parts_import_downward_only():
    """api <- wrap <- fsdp1, api <- fsdp2; the package's __init__ may name every part."""
    graph, _ = import_graph(REFERENCE)
    upward = [
        f"{a} ({_part(a)}) imports {b} ({_part(b)})"
        for a, targets in sorted(graph.items())
        for b in sorted(targets)
        if _part(b) != _part(a) and _part(b) not in ALLOWED[_part(a)]
    ]
    assert not upward, "imports against the order of the parts:\n" + "\n".join(upward)


def test_the_checker_sees_lazy_and_relative_cycles(tmp_path):
    """The checks above can fail: a planted function-level cycle through a relative import."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from .b import f\n")
    (pkg / "sub" / "b.py").write_text(
        "def f():\n    import importlib\n    importlib.import_module('pkg.c')\n"
    )
    (pkg / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.d\n"
        "def g():\n    from pkg.sub import a\n    import conformance\n"
    )
    (pkg / "d.py").write_text("import pkg.c\n")
    graph, harness = import_graph(pkg)
    assert find_cycle(graph) == ["pkg.c", "pkg.sub.a", "pkg.sub.b", "pkg.c"]
    assert harness == [f"{pkg / 'c.py'}:6 imports conformance"]
    graph["pkg.c"].clear()
    assert find_cycle(graph) is None
