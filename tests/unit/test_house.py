"""The house rules of the package's layout, read from its source (no module is imported): no import circle, the
recording wing apart from the investigation and analysis wings, and a short list of loose modules at the root."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).parents[2] / "src" / "detrace"


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _statements(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement of a module, at its top and inside its functions (an import a function makes when it
    runs closes a circle as surely), but for those under `if TYPE_CHECKING:`, which never run."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            yield from (s for child in node.orelse for s in _statements(ast.Module(body=[child], type_ignores=[])))
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _statements(node)


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Which of the package's modules each of its modules names in an import: `from P import n` names P.n where that
    is a module, else P. A module naming its own package is left out (the package is what imports it)."""
    modules = _modules()
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for statement in _statements(ast.parse(path.read_text(), str(path))):
            if isinstance(statement, ast.Import):
                named = [alias.name for alias in statement.names]
            else:
                base = statement.module or ""
                if statement.level:
                    anchor = package.rsplit(".", statement.level - 1)[0] if statement.level > 1 else package
                    base = f"{anchor}.{base}" if base else anchor
                named = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                         for alias in statement.names]
            for target in named:
                while target and target not in modules:  # `import detrace.x.y` of a name inside a module
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of `graph` (its modules in order, the first repeated at the end), or None."""
    done: set[str] = set()
    path: list[str] = []
    on_path: set[str] = set()

    def visit(module: str) -> list[str] | None:
        path.append(module)
        on_path.add(module)
        for target in sorted(graph[module]):
            if target in on_path:
                return [*path[path.index(target):], target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        on_path.discard(path.pop())
        done.add(module)
        return None

    for module in sorted(graph):
        if module not in done:
            cycle = visit(module)
            if cycle:
                return cycle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """The modules that importing the modules of `start` (a package, with everything under it) can import."""
    seen = {name for name in graph if name == start or name.startswith(start + ".")}
    todo = list(seen)
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def test_find_cycle_names_a_circle_and_passes_a_tree() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_import_graph_sees_imports_inside_functions() -> None:
    graph = import_graph()
    # detrace.record's tracer starts its rungs from inside a function; the launcher's hook imports the tracer so too
    assert "detrace.record.rungs" in graph["detrace.record"]
    assert "detrace.record" in graph["detrace.launch.inject.sitecustomize"]


def test_the_package_has_no_import_circle() -> None:
    # The circle of issue 48: the tracer armed `detrace audit`'s probe, whose judge took the sample-key type from the
    # integrations, which import the tracer. Each such circle makes the import order matter, and a wing load others.
    cycle = find_cycle(import_graph())
    assert cycle is None, "an import circle: " + " -> ".join(cycle or [])


def test_recording_imports_neither_the_investigation_nor_the_analysis_wing() -> None:
    wings = reachable(import_graph(), "detrace.record")
    assert sorted(m for m in wings if m.startswith(("detrace.investigate", "detrace.analyze"))) == []


def test_analysis_does_not_import_the_tracer() -> None:
    assert sorted(m for m in reachable(import_graph(), "detrace.analyze") if m.startswith("detrace.record")) == []


def test_at_most_eight_loose_modules_at_the_package_root() -> None:
    # Everything else lives in a wing; a module that only a wing needs goes there (tracefile.schemes, for instance).
    loose = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(loose) <= 8, loose
