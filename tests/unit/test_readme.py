"""The README and docs/ stay true: generated parts current, links alive, a short front door."""

from __future__ import annotations

import re
from pathlib import Path

from kvstore.config import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_config_reference_is_current():
    text = (ROOT / "docs" / "configuration.md").read_text()
    body = text.split(START, 1)[1].split(END, 1)[0]
    assert body.strip() == reference_markdown().strip(), "run: python scripts/update_readme.py"


def test_first_screen_commands_exist():
    text = (ROOT / "README.md").read_text()
    first_screen = text.split("---", 1)[0]
    assert "bash scripts/demo.sh" in first_screen and "bash .ci/run" in first_screen
    assert (ROOT / "scripts" / "demo.sh").exists() and (ROOT / ".ci" / "run").exists()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120, f"README.md has {len(lines)} lines: reference material goes in docs/"


def test_relative_links_resolve():
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    dead = []
    for page in pages:
        for target, _anchor in LINK.findall(page.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (page.parent / target).exists():
                dead.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not dead, dead


def test_docs_named_in_code_exist():
    """Modules that point readers to docs/<page>.md point at a page that exists."""
    named = set()
    for path in ROOT.glob("*/**/*.py"):
        if any(part.startswith(".venv") for part in path.parts):
            continue
        named.update(re.findall(r"\bdocs/([\w.-]+\.md)", path.read_text(errors="replace")))
    missing = sorted(n for n in named if not (ROOT / "docs" / n).exists())
    assert not missing, missing
