"""Reading seed tasks: user requests from existing task datasets, in whatever shape the source has them.

Sources are the packaged corpus (`builtin`), a local JSON/JSONL/Parquet file, or a Hugging Face dataset id read
with `datasets`. Formats are plain records (the request in one field), API-Bank (`{instruction, input, output}`,
the user turn cut out of `input`) and ToolACE-style conversations (the first user turn).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import polars as pl

from builder.errors import ConfigError

SeedFormat = Literal["auto", "records", "api_bank", "toolace"]
BUILTIN = "builtin"


@dataclass(frozen=True)
class SeedRow:
    ref: str
    request: str | None  # None when the row holds no usable user request
    domain: str | None


def read_seeds(source: str, *, fmt: SeedFormat, request_field: str, split: str = "train") -> Iterator[SeedRow]:
    """Yield the user request of every row of `source`, in source order.

    Raises:
        ConfigError: the source cannot be read, or its rows do not match the format.
    """
    rows = _load_rows(source, split)
    if fmt == "auto":
        fmt = _detect_format(rows[0] if rows else {}, request_field)
    extract = {"records": _record_request, "api_bank": api_bank_request, "toolace": toolace_request}[fmt]
    for index, row in enumerate(rows):
        if fmt == "records" and request_field not in row:
            raise ConfigError(
                f"mine.request_field = {request_field!r}: row {index} of {source} has no such field; "
                f"its fields are: {', '.join(map(str, row))}"
            )
        request = extract(row, request_field)
        domain = row.get("domain") if isinstance(row.get("domain"), str) else None
        yield SeedRow(ref=str(index), request=request, domain=domain)


def _record_request(row: dict[str, Any], field: str) -> str | None:
    value = row.get(field)
    return value if isinstance(value, str) else None


_API_BANK_STOPS = ("\nGenerate API Request:", "\nAPI-Request:", "TIME:", "\nAI:")


def api_bank_request(row: dict[str, Any], _: str = "") -> str | None:
    """The user's utterance inside an API-Bank `input`: after `User:`, before the time stamp or the next turn."""
    text = row.get("input")
    if not isinstance(text, str) or "User:" not in text:
        return None
    utterance = text.split("User:", 1)[1]
    for stop in _API_BANK_STOPS:
        utterance = utterance.split(stop, 1)[0]
    return utterance.strip() or None


def toolace_request(row: dict[str, Any], _: str = "") -> str | None:
    """The first user turn of a ToolACE-style conversation (`conversations: [{from, value}, ...]`)."""
    turns = row.get("conversations")
    if not isinstance(turns, list):
        return None
    for turn in turns:
        if isinstance(turn, dict) and turn.get("from") in ("user", "human") and isinstance(turn.get("value"), str):
            return turn["value"].strip() or None
    return None


def _detect_format(first_row: dict[str, Any], request_field: str) -> SeedFormat:
    if request_field in first_row:
        return "records"
    if {"instruction", "input", "output"} <= set(first_row):
        return "api_bank"
    if "conversations" in first_row:
        return "toolace"
    return "records"  # reported row by row with the fields that do exist


def _load_rows(source: str, split: str) -> list[dict[str, Any]]:
    if source == BUILTIN:
        text = resources.files("builder.data").joinpath("seed_tasks.jsonl").read_text(encoding="utf-8")
        return _jsonl(text, source)
    path = Path(source)
    if path.is_file():
        return _read_file(path)
    if path.suffix in (".json", ".jsonl", ".parquet") or source.startswith((".", "/")):
        raise ConfigError(f"mine.seeds = {source!r}: no such file")
    return _read_hub_dataset(source, split)


def _read_file(path: Path) -> list[dict[str, Any]]:
    source = str(path)
    if path.suffix == ".parquet":
        try:
            return pl.read_parquet(path).to_dicts()
        except Exception as error:  # polars raises several types for a damaged file
            raise ConfigError(f"mine.seeds = {source!r}: not a readable Parquet file ({error})") from None
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".jsonl":
        return _jsonl(text, source)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"mine.seeds = {source!r}: not valid JSON ({error})") from None
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ConfigError(f"mine.seeds = {source!r}: expected a JSON list of objects")
    return data


def _jsonl(text: str, source: str) -> list[dict[str, Any]]:
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"mine.seeds = {source!r}: line {number} is not valid JSON ({error})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"mine.seeds = {source!r}: line {number} is not a JSON object")
        rows.append(row)
    return rows


def _read_hub_dataset(dataset_id: str, split: str) -> list[dict[str, Any]]:
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)?", dataset_id):
        raise ConfigError(f"mine.seeds = {dataset_id!r}: neither 'builtin', an existing file, nor a dataset id")
    from datasets import load_dataset  # heavy import, needed only for Hub sources

    try:
        dataset = load_dataset(dataset_id, split=split)
    except Exception as error:  # datasets raises many types (network, missing split, bad id)
        raise ConfigError(f"mine.seeds = {dataset_id!r}: cannot load split {split!r} with datasets ({error})") from None
    return [dict(row) for row in dataset]
