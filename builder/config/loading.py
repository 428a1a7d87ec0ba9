"""Loading the config: built-in defaults, a packaged profile, a TOML file and `--set key=value` overrides, with
one error per invalid value naming the key, the value and what it is for."""

from __future__ import annotations

import json
import tomllib
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from builder.config.tree import BuildConfig
from builder.errors import ConfigError
from builder.hardware import detect_device

PROFILES = ("auto", "cpu", "gpu", "none")
PROFILE_DIR = Path(__file__).parent.parent / "profiles"


def resolve_profile(profile: str) -> str:
    """The packaged profile `profile` names: `auto` is `gpu` when `nvidia-smi` lists a GPU, else `cpu`."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; profiles are: {', '.join(PROFILES)}")
    if profile != "auto":
        return profile
    return detect_device()


def load_config(
    path: Path | None = None, overrides: list[str] | tuple[str, ...] = (), profile: str = "none"
) -> BuildConfig:
    """Load the config: built-in defaults, then a packaged profile, then a TOML file (or a `.json` one, such as
    a run folder's config.json), then `section.key=value` overrides, each layer replacing the keys it sets.

    `profile` is `none` (built-in defaults only), `cpu` or `gpu` (builder/profiles/<name>.toml), or `auto`
    (the command line's default: the profile for this machine's hardware).

    Override values are parsed as TOML values (`3`, `0.5`, `true`, `[0.1, 0.9]`, `"text"`); anything that is not
    valid TOML is taken as a plain string, so `--set llm.model=Qwen/Qwen3-8B` needs no quotes; `none` unsets a key
    that may be unset (e.g. `--set mine.max_seeds=none`).

    Raises:
        ConfigError: the file is missing or not TOML, an override is malformed, or a value is invalid.
    """
    data: dict[str, Any] = {}
    chosen = resolve_profile(profile)
    if chosen != "none":
        data = tomllib.loads((PROFILE_DIR / f"{chosen}.toml").read_text())
    if path is not None:
        layer = _read_file(Path(path))
        for section, values in layer.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    for override in overrides:
        _apply_override(data, override)
    try:
        return BuildConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, data)) from None


def _read_file(path: Path) -> dict[str, Any]:
    """A config file's keys: TOML, or JSON for a `.json` file (a run folder's config.json, which is complete)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    if path.suffix.lower() == ".json":
        try:
            layer = json.loads(text)
        except json.JSONDecodeError as error:
            raise ConfigError(f"config file {path} is not valid JSON: {error}") from None
        if not isinstance(layer, dict):
            raise ConfigError(f"config file {path} is not a JSON object of sections")
        return layer
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {override!r}")
    section, name = parts
    if section not in BuildConfig.model_fields:
        allowed = ", ".join(BuildConfig.model_fields)
        raise ConfigError(f"--set {key}: unknown section {section!r}; sections are: {allowed}")
    target = data.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"--set {key}: {section!r} in the config file is not a table")
    target[name] = None if raw.strip() == "none" and _optional(section, name) else _parse_value(raw.strip())


def _optional(section: str, name: str) -> bool:
    """Whether `section.name` accepts None (then `--set section.name=none` unsets it; TOML has no null)."""
    field = BuildConfig.model_fields[section].annotation.model_fields.get(name)  # type: ignore[union-attr]
    return field is not None and not field.is_required() and type(None) in typing.get_args(field.annotation)


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def _describe(error: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key; allowed here: {_allowed_keys(item['loc'][:-1])}")
            continue
        value = item.get("input")
        lines.append(f"{key} = {value!r}: {item['msg']}{_allowed_hint(item['loc'])}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _allowed_keys(section_loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = BuildConfig
    for part in section_loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "(not a table)"
        model = annotation
    return ", ".join(model.model_fields)


def _allowed_hint(loc: tuple[Any, ...]) -> str:
    """The field's own description, so the error says what the value is for."""
    if len(loc) < 2 or loc[0] not in BuildConfig.model_fields:
        return ""
    section = BuildConfig.model_fields[str(loc[0])].annotation
    field = getattr(section, "model_fields", {}).get(str(loc[1]))
    return f" ({field.description})" if field is not None and field.description else ""
