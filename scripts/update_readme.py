"""Refresh the generated parts of the docs (docs/configuration.md: the config reference)."""

from __future__ import annotations

from pathlib import Path

from kvstore.config import reference_markdown

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
readme = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
text = readme.read_text()
head, rest = text.split(START, 1)
_, tail = rest.split(END, 1)
readme.write_text(f"{head}{START}\n{reference_markdown()}{END}{tail}")
print(f"updated {readme}")
