"""Decontamination: word n-gram overlap between our texts and benchmark task texts (local files or Hub datasets).

A text's overlap with a benchmark is the largest share of its word n-grams that occur in any single benchmark
text (containment, so a short task copied into a long benchmark prompt still scores 1.0). Texts with fewer words
than `n` have no n-grams and score 0: too short to call a copy.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.errors import ConfigError
from builder.json_values import leaves

_WORD = re.compile(r"[a-z0-9]+")


@dataclass(frozen=True)
class BenchmarkText:
    source: str
    index: int
    text: str


@dataclass(frozen=True)
class Match:
    """The benchmark text a text overlaps most with, and the overlap (0-1)."""

    overlap: float
    benchmark: BenchmarkText | None


def ngrams(text: str, n: int) -> set[tuple[str, ...]]:
    words = _WORD.findall(text.casefold())
    return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}


def _strings(value: Any) -> Iterator[str]:
    return (leaf for leaf in leaves(value) if isinstance(leaf, str))


def read_benchmark(path: Path) -> list[BenchmarkText]:
    """The task texts of one file: `.txt` one per non-empty line; `.jsonl` one per line and `.json` one per item
    of a top-level list (or the whole object), each the joined strings of its record (any field layout:
    BFCL's nested `question` messages, tau-bench's `instruction`, ...).

    Raises:
        ConfigError: the file is missing or is not valid JSON / JSON lines.
    """
    source = str(path)
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as error:
        raise ConfigError(f"select.benchmarks: cannot read {path}: {error}") from None
    try:
        if path.suffix == ".jsonl":
            records: list[Any] = [json.loads(line) for line in raw.splitlines() if line.strip()]
        elif path.suffix == ".json":
            data = json.loads(raw)
            records = data if isinstance(data, list) else [data]
        else:
            records = [line for line in raw.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise ConfigError(f"select.benchmarks: {path} is not valid JSON: {error}") from None
    return [BenchmarkText(source, i, " ".join(_strings(record))) for i, record in enumerate(records)]


def read_source(source: str) -> list[BenchmarkText]:
    """`read_benchmark` for a file, or every row of a Hugging Face dataset for `hf:ORG/NAME[:SPLIT]` (default split
    `test`; read with `datasets`, so a dataset already in the local cache works offline).

    Raises:
        ConfigError: the file or dataset cannot be read.
    """
    if not source.startswith("hf:"):
        return read_benchmark(Path(source))
    name, _, split = source[3:].partition(":")
    try:
        import datasets

        rows = datasets.load_dataset(name, split=split or "test")
    except Exception as error:  # datasets raises many types (missing, offline, bad split)
        raise ConfigError(f"select.benchmarks: cannot load dataset {name!r}: {error}") from None
    return [BenchmarkText(source, i, " ".join(_strings(dict(row)))) for i, row in enumerate(rows)]


class BenchmarkIndex:
    """An inverted index from word n-grams to the benchmark texts holding them."""

    def __init__(self, texts: Iterable[BenchmarkText], n: int) -> None:
        self.n = n
        self.texts = list(texts)
        self._postings: dict[tuple[str, ...], list[int]] = defaultdict(list)
        for position, item in enumerate(self.texts):
            for gram in ngrams(item.text, n):
                self._postings[gram].append(position)

    @classmethod
    def from_files(cls, paths: Iterable[str | Path], n: int) -> BenchmarkIndex:
        """An index over benchmark sources: file paths, or `hf:ORG/NAME[:SPLIT]` dataset ids."""
        return cls((text for path in paths for text in read_source(str(path))), n)

    def match(self, text: str) -> Match:
        """The benchmark text sharing the largest share of `text`'s n-grams."""
        grams = ngrams(text, self.n)
        if not grams:
            return Match(0.0, None)
        hits: Counter[int] = Counter()
        for gram in grams:
            hits.update(self._postings.get(gram, ()))
        if not hits:
            return Match(0.0, None)
        position, count = min(hits.items(), key=lambda item: (-item[1], item[0]))
        return Match(count / len(grams), self.texts[position])
