"""The config printed as TOML, every key preceded by its description (`python -m builder config`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from builder.config.tree import BuildConfig


def to_toml(config: BuildConfig) -> str:
    """The config as TOML, each key preceded by its description; `load_config` reads it back unchanged."""
    lines: list[str] = []
    for section_name in BuildConfig.model_fields:
        section = getattr(config, section_name)
        lines.append(f"[{section_name}]")
        for name, field in type(section).model_fields.items():
            value = getattr(section, name)
            lines.append(f"# {field.description}")
            lines.append(f"{name} = {_toml_value(value)}" if value is not None else f"# {name} = (unset)")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{" + ", ".join(f"{json.dumps(str(k))} = {_toml_value(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)
