"""The README's code blocks that tests and scripts run, found by an explicit marker: an HTML comment
``<!-- block: NAME -->`` on the line before the fence, never by heading text (the README can be
restructured freely; ``scripts/fresh_clone_check.sh`` reads the same markers)."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(name: str, readme: Path = README) -> str:
    """The text of the fenced block right after ``<!-- block: name -->``."""
    found = re.search(rf"^<!-- block: {re.escape(name)} -->\n```\w*\n(.*?)^```", readme.read_text(), re.M | re.S)
    if found is None:
        raise LookupError(f"README block {name!r}: no '<!-- block: {name} -->' marker before a fenced block")
    return found.group(1)


def readme_lines(name: str, readme: Path = README) -> list[str]:
    return [line for line in readme_block(name, readme).splitlines() if line.strip()]
