"""The README's generated parts and promises stay true."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import reference_markdown

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def test_config_reference_is_current():
    text = (ROOT / "README.md").read_text()
    body = text.split(START, 1)[1].split(END, 1)[0]
    assert body.strip() == reference_markdown().strip(), "run: python scripts/update_readme.py"


def test_first_screen_commands_exist():
    text = (ROOT / "README.md").read_text()
    first_screen = text.split("---", 1)[0]
    assert "bash scripts/demo.sh" in first_screen and "bash .ci/run" in first_screen
    assert (ROOT / "scripts" / "demo.sh").exists() and (ROOT / ".ci" / "run").exists()
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
