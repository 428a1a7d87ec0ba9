"""collect: read seed tasks (user requests to tool-using agents) from the configured source."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import polars as pl

from builder.errors import ConfigError
from builder.records import Record, SeedTask
from builder.runner import StageContext

BUILTIN = "builtin"


async def collect(_: Sequence[Record], ctx: StageContext) -> list[Record]:
    """Seed tasks from `mine.seeds`; exact repeats of a request are rejected as `duplicate`."""
    source = ctx.config.mine.seeds
    results: list[Record] = []
    seen: set[str] = set()
    for ref, row in _rows(source, ctx.config.mine.max_seeds):
        request = row.get(ctx.config.mine.request_field)
        if not isinstance(request, str) or not request.strip():
            raise ConfigError(
                f"mine.request_field = {ctx.config.mine.request_field!r}: row {ref} of {source} has no text there; "
                f"its fields are: {', '.join(map(str, row))}"
            )
        seed = SeedTask(
            provenance=ctx.provenance(),
            source=source,
            source_ref=ref,
            request=" ".join(request.split()),
            domain=row.get("domain"),
        )
        if seed.id in seen:
            results.append(ctx.reject(seed.id, "duplicate", f"request repeats an earlier one (row {ref})"))
            continue
        seen.add(seed.id)
        results.append(seed)
    return results


def _rows(source: str, limit: int | None) -> Iterator[tuple[str, dict[str, Any]]]:
    rows = _read(source)
    for index, row in enumerate(rows):
        if limit is not None and index >= limit:
            return
        yield str(index), row


def _read(source: str) -> list[dict[str, Any]]:
    if source == BUILTIN:
        text = resources.files("builder.data").joinpath("seed_tasks.jsonl").read_text(encoding="utf-8")
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"mine.seeds = {source!r}: no such file (give 'builtin' or a .json/.jsonl/.parquet file)")
    if path.suffix == ".parquet":
        return pl.read_parquet(path).to_dicts()
    try:
        if path.suffix == ".jsonl":
            return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ConfigError(f"mine.seeds = {source!r}: not valid JSON ({error})") from None
    if not isinstance(data, list) or not all(isinstance(row, dict) for row in data):
        raise ConfigError(f"mine.seeds = {source!r}: expected a JSON list of objects")
    return data
