"""The layout's rules, read from the code's own imports (nothing is imported or run).

Imports run one way: bench -> clients -> service -> engine -> cuda, and inside engine/
frontend -> core -> worker -> (kv_io, sample) -> kv -> the shared record types at the top of
engine/. No module imports itself back through others (no circles). Imports under
`if TYPE_CHECKING:` are annotations only and are left out: the worker names the core's step
types in its signatures without importing the core.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bench", "clients", "service", "engine", "cuda")
GENERATED = ("service/api/",)
PACKAGE_FLOORS = {"bench": 5, "clients": 4, "service": 3, "engine": 2, "cuda": 1}
ENGINE_FLOORS = {
    "testing": 8,
    "frontend": 7,
    "core": 6,
    "executor": 5,
    "worker": 4,
    "kv_io": 3,
    "sample": 3,
    "kv": 2,
}
"""engine/'s rooms, top down; a module directly in engine/ is floor 1 (shared record types).
engine/testing (random checkpoints for tests and benchmarks) is above them all: nothing in the
engine imports it."""
MAX_LINES = 500
MAX_ENGINE_TOP_FILES = 8


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if not rel.startswith(GENERATED):
                out[_module_name(path)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(node: ast.AST, type_only: bool = False) -> Iterator[ast.AST]:
    """Every node below `node`, except the bodies of `if TYPE_CHECKING:` blocks (unless
    `type_only`: then every node)."""
    for child in ast.iter_child_nodes(node):
        yield child
        if isinstance(child, ast.If) and _is_type_checking(child.test) and not type_only:
            for sub in child.orelse:
                yield sub
                yield from _runtime_nodes(sub)
        else:
            yield from _runtime_nodes(child, type_only)


def _imported(
    tree: ast.AST, module: str, is_pkg: bool, type_only: bool = False
) -> Iterator[tuple[str, int]]:
    """(imported module or module.name, line) for every runtime import, nested ones included;
    with `type_only`, the imports under `if TYPE_CHECKING:` too."""
    for node in _runtime_nodes(tree, type_only):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_pkg else 0)]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                yield f"{base}.{alias.name}", node.lineno
            yield base, node.lineno


def _graph(type_only: bool = False) -> dict[str, dict[str, int]]:
    """module -> {imported module of this tree: first line}; `type_only`: annotations' imports
    (under `if TYPE_CHECKING:`) count too."""
    sources = _sources()
    graph: dict[str, dict[str, int]] = {}
    for module, path in sources.items():
        tree = ast.parse(path.read_text(), str(path))
        edges: dict[str, int] = {}
        for name, line in _imported(tree, module, path.name == "__init__.py", type_only):
            if name in sources and name != module:
                edges.setdefault(name, line)
        graph[module] = edges
    return graph


def _floor(module: str) -> tuple[int, int]:
    parts = module.split(".")
    inner = 0
    if parts[0] == "engine" and len(parts) > 1:
        inner = ENGINE_FLOORS.get(parts[1], 1)
    return PACKAGE_FLOORS[parts[0]], inner


def test_imports_run_one_way() -> None:
    graph = _graph()
    upward = []
    for module, edges in graph.items():
        if module == "engine":
            continue  # the package's public face re-exports from every room (LLM lazily)
        for target, line in edges.items():
            if _floor(target) > _floor(module):
                upward.append(f"{module}:{line} imports {target}")
    assert not upward, "imports that run up a floor:\n" + "\n".join(upward)


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


@pytest.mark.parametrize("type_only", [False, True], ids=["runtime", "with-type-only"])
def test_no_import_circles(type_only: bool) -> None:
    """No module imports itself back through others, not even for annotations: a type that two
    modules need lives below both."""
    cycles = _cycles(_graph(type_only))
    assert not cycles, "modules that import each other: " + "; ".join(map(", ".join, cycles))


def test_the_worker_imports_nothing_from_the_core() -> None:
    """engine/worker/ gets each step as plain data (engine/worker/step_record.py) and keeps its
    own state: it names nothing of engine/core/, not even for type checking."""
    found = [
        f"{module}:{line} imports {target}"
        for module, edges in _graph(type_only=True).items()
        if module.startswith("engine.worker")
        for target, line in edges.items()
        if target.startswith("engine.core")
    ]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(
    ("graph", "expected"),
    [
        ({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}, [["a", "b", "c"]]),
        ({"a": {"b": 1}, "b": {}, "c": {"b": 1}}, []),
    ],
)
def test_cycle_finder(graph: dict[str, dict[str, int]], expected: list[list[str]]) -> None:
    assert _cycles(graph) == expected


def test_a_type_checking_import_is_not_a_runtime_edge() -> None:
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "import engine.config\n"
        "if TYPE_CHECKING:\n    from engine.core import scheduler\n"
        "def f():\n    from engine.frontend import llm\n"
    )
    names = {name for name, _ in _imported(tree, "engine.worker.x", False)}
    assert "engine.config" in names and "engine.frontend.llm" in names
    assert "engine.core.scheduler" not in names


def test_engine_top_is_small_and_files_are_short() -> None:
    top = sorted(p.name for p in (ROOT / "engine").glob("*.py"))
    assert len(top) <= MAX_ENGINE_TOP_FILES, top
    long = [
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in _sources().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    ]
    assert not long, "files over the limit: " + ", ".join(long)


def test_only_the_benchmarks_tests_import_bench() -> None:
    """Test support lives in tests/support and engine/testing, not in bench/."""
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("tests/bench/"):
            continue
        tree = ast.parse(path.read_text(), rel)
        for name, line in _imported(tree, _module_name(path), path.name == "__init__.py"):
            if name == "bench" or name.startswith("bench."):
                found.append(f"{rel}:{line} imports {name}")
    assert not found, "tests outside tests/bench that import bench:\n" + "\n".join(
        sorted(set(found))
    )


def _classes_and_functions(tree: ast.AST) -> Iterator[tuple[str | None, ast.AST]]:
    """(enclosing class name or None, function) for every function in a module."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield node.name, item
        elif isinstance(node, ast.Module):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    yield None, item


def _calls(node: ast.AST, name: str) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == name
        for n in ast.walk(node)
    )


def test_one_class_holds_the_core_loop() -> None:
    """The engine core's busy loop (take commands, step, send what it made, until told to stop)
    is written once, in one class, for the in-process and the separate-process engine alike.
    The offline `LLM` steps its own requests to completion and nothing else."""
    owners = set()
    for path in sorted((ROOT / "engine").rglob("*.py")) + sorted((ROOT / "service").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for cls, func in _classes_and_functions(tree):
            for loop in ast.walk(func):
                if isinstance(loop, ast.While) and _calls(loop, "step"):
                    owners.add(f"{path.relative_to(ROOT).as_posix()}:{cls}")
    assert owners == {"engine/core/core_loop.py:CoreLoop", "engine/frontend/llm.py:LLM"}, owners


_MESSAGE_NAMES = {"msg", "message", "cmd", "command", "reply", "item", "packed", "kind"}
_SENDS = {"send", "_send", "send_bytes", "put", "put_nowait", "_put", "_push", "_send_outputs"}


def _tagged_tuple(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Tuple)
        and bool(node.elts)
        and isinstance(node.elts[0], ast.Constant)
        and isinstance(node.elts[0].value, str)
    )


def test_no_message_protocol_of_string_tagged_tuples() -> None:
    """Messages between threads and processes are typed (a class per kind): nothing sends a
    tuple whose first item is a string tag, and nothing dispatches on `msg[0] == "tag"`."""
    found = []
    for path in _sources().values():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute | ast.Name)
                and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
                in _SENDS
                and any(_tagged_tuple(a) for a in node.args)
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} sends a tagged tuple")
            if (
                isinstance(node, ast.Compare)
                and isinstance(node.left, ast.Subscript)
                and isinstance(node.left.value, ast.Name)
                and node.left.value.id in _MESSAGE_NAMES
                and isinstance(node.left.slice, ast.Constant)
                and node.left.slice.value == 0
                and any(isinstance(c, ast.Constant) and isinstance(c.value, str)
                        for c in node.comparators)
            ):  # fmt: skip
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} dispatches on a tag")
    assert not found, "\n".join(found)


def test_no_long_functions_in_the_engine() -> None:
    """Functions in engine/ fit on a screen (80 lines); the core's constructor reads as a short
    list of named steps (40)."""
    long = []
    for path in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for cls, func in _classes_and_functions(tree):
            assert isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef)
            n = (func.end_lineno or func.lineno) - func.lineno + 1
            limit = 40 if (cls, func.name) == ("EngineCore", "__init__") else 80
            if n > limit:
                long.append(f"{path.relative_to(ROOT)}:{func.lineno} {cls}.{func.name}: {n} lines")
    assert not long, "\n".join(long)
