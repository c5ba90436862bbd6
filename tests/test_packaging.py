"""The package declares what its code imports: every third-party module that engine/, service/,
clients/, cuda/ or bench/ imports at module level comes from a required dependency in
pyproject.toml, and every one imported inside a function from a required dependency or an extra
(`pip install .` then `deja serve` must not die on a missing module)."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "service", "clients", "cuda", "bench")

NOT_INSTALLED_HERE = {"cupy": {"cupy-cuda12x"}}
"""Modules whose distribution is an extra not installed in the test environment."""
OWN_VENV = {"vllm"}
"""Peers that `deja bench peer` runs from their own virtual environment, never from ours."""


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _declared() -> tuple[set[str], set[str]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    required = {_name(r) for r in project["dependencies"]}
    extras = {_name(r) for reqs in project["optional-dependencies"].values() for r in reqs}
    return required, extras


def _imports() -> tuple[dict[str, str], dict[str, str]]:
    """(module-level, inside functions): third-party top-level module -> a file importing it."""
    ours = set(PACKAGES) | {"tests", "__future__"}
    top: dict[str, str] = {}
    lazy: dict[str, str] = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            tree = ast.parse(path.read_text(), str(path))
            module_level = {id(n) for n in tree.body}
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    names = [] if node.level or not node.module else [node.module]
                elif isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                else:
                    continue
                for name in names:
                    root = name.split(".")[0]
                    if root in ours or root in sys.stdlib_module_names:
                        continue
                    where = top if id(node) in module_level else lazy
                    where.setdefault(root, str(path.relative_to(ROOT)))
    return top, lazy


def _distributions(module: str) -> set[str]:
    found = md.packages_distributions().get(module, [])
    return {d.lower().replace("_", "-") for d in found} | NOT_INSTALLED_HERE.get(module, set())


def test_module_level_imports_are_required_dependencies() -> None:
    required, _ = _declared()
    top, _ = _imports()
    missing = {m: f for m, f in top.items() if not _distributions(m) & required}
    assert not missing, f"imported at module level but not in [project] dependencies: {missing}"


def test_imports_inside_functions_are_declared() -> None:
    required, extras = _declared()
    top, lazy = _imports()
    missing = {
        m: f
        for m, f in lazy.items()
        if m not in top and m not in OWN_VENV and not _distributions(m) & (required | extras)
    }
    assert not missing, f"imported but declared nowhere in pyproject.toml: {missing}"
