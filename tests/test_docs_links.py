"""Docs point at files that exist: every relative markdown link in docs/*.md and README.md,
and every `docs/NAME.md` a module of motor or actors names (issue 15: motor/__init__.py
linked to a docs/embedding.md that did not exist)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _missing_links() -> list[tuple[str, str]]:
    missing = []
    for md in [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]:
        for match in re.finditer(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", md.read_text()):
            target = match.group(1)
            if not re.match(r"[a-z]+:", target) and not (md.parent / target).exists():
                missing.append((md.name, target))
    return missing


def _missing_mentions() -> list[tuple[str, str]]:
    missing = []
    for py in [*sorted((ROOT / "motor").rglob("*.py")), *sorted((ROOT / "actors").glob("*.py"))]:
        for match in re.finditer(r"(?<![\w/.])docs/[\w-]+\.md", py.read_text()):
            if not (ROOT / match.group(0)).exists():
                missing.append((str(py.relative_to(ROOT)), match.group(0)))
    return missing


def test_every_relative_link_in_the_docs_resolves():
    assert _missing_links() == []


def test_every_docs_file_the_code_names_exists():
    assert _missing_mentions() == []
