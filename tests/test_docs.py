"""The docs: the generated reference pages are current, the site builds with `mkdocs build
--strict` (a broken link or a page left out of the nav fails it), the README stays short and its
links resolve, and neither the README nor the docs refer to issue numbers."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
REFERENCE = ("cli.md", "grpc.md", "metrics.md")
ISSUE_REF = re.compile(r"issue [0-9]")


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEJA_")}
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's banner about MkDocs 2.0
    return env


def test_generated_reference_is_current(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_docs.py"), "--out", str(tmp_path)],
        cwd=ROOT,
        env=_clean_env(),
        check=True,
        capture_output=True,
        timeout=300,
    )
    stale = [
        name
        for name in REFERENCE
        if (tmp_path / name).read_text() != (DOCS / "reference" / name).read_text()
    ]
    assert not stale, f"stale docs/reference/ pages {stale}: run `python scripts/gen_docs.py`"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        env=_clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "WARNING" not in proc.stderr, proc.stderr


def test_every_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    missing = [p for p in pages if f": {p}" not in nav]
    assert not missing, f"pages missing from mkdocs.yml's nav: {missing}"


def test_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= 300, f"README.md has {lines} lines (at most 300); move detail into docs/"


def test_readme_links_resolve() -> None:
    text = README.read_text()
    broken = [
        target
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text)
        if "://" not in target and not (ROOT / target).exists()
    ]
    assert not broken, f"README.md links to missing files: {broken}"


def test_no_issue_numbers_in_readme_or_docs() -> None:
    found = []
    for path in [README, *sorted(DOCS.rglob("*.md"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if ISSUE_REF.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "references to issue numbers:\n" + "\n".join(found)
