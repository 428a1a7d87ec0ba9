"""Names as builder spells them (tool, entity and environment names)."""

from __future__ import annotations

import re


def snake_case(text: str) -> str:
    """`"Get Member"` -> `get_member`; camelCase is split too (`getMember` -> `get_member`)."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", text.strip())
    return re.sub(r"[^a-z0-9]+", "_", spaced.casefold()).strip("_")
