"""Prompt templates, one Markdown file per model call. A template's version is a hash of its text, so changing a
prompt changes the provenance of everything it produces."""

from __future__ import annotations

import hashlib
from functools import cache
from importlib import resources


@cache
def prompt(name: str) -> str:
    """The text of `prompts/<name>.md`."""
    return resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8").strip()


def prompt_version(name: str) -> str:
    """`<name>@<8 hex digits of the text's sha256>`, recorded in provenance."""
    return f"{name}@{hashlib.sha256(prompt(name).encode()).hexdigest()[:8]}"
