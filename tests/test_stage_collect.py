import json
from collections import Counter

import polars as pl
import pytest

from builder.config import load_config
from builder.errors import ConfigError
from builder.records import Rejection, SeedTask
from builder.runner import StageContext
from builder.stages.collect import collect
from builder.stats import StageStats


def context(tmp_path, *overrides: str) -> StageContext:
    return StageContext(load_config(None, list(overrides)), "hash", tmp_path, StageStats("collect"))


async def test_builtin_corpus_is_broad(tmp_path):
    results = await collect([], context(tmp_path))
    seeds = [r for r in results if isinstance(r, SeedTask)]
    assert len(seeds) >= 80
    domains = Counter(seed.domain for seed in seeds)
    assert len(domains) >= 15
    assert max(domains.values()) <= len(seeds) // 5  # no domain dominates the corpus


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
async def test_local_files_with_duplicates_and_limit(tmp_path, suffix):
    rows = [{"q": "Book room 12"}, {"q": "Cancel order 7"}, {"q": "Book  room 12 "}, {"q": "Refund 9"}]
    path = tmp_path / f"seeds{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    else:
        pl.DataFrame(rows).write_parquet(path)
    results = await collect([], context(tmp_path, f"mine.seeds={path}", "mine.request_field=q", "mine.max_seeds=3"))
    kept = [r for r in results if isinstance(r, SeedTask)]
    rejected = [r for r in results if isinstance(r, Rejection)]
    assert [seed.request for seed in kept] == ["Book room 12", "Cancel order 7"]  # whitespace normalised
    assert [r.reason for r in rejected] == ["duplicate"]
    assert rejected[0].subject_id == kept[0].id


async def test_bad_sources_are_clear_errors(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        await collect([], context(tmp_path, f"mine.seeds={tmp_path / 'none.jsonl'}"))
    broken = tmp_path / "broken.json"
    broken.write_text("[{")
    with pytest.raises(ConfigError, match="not valid JSON"):
        await collect([], context(tmp_path, f"mine.seeds={broken}"))
    scalar = tmp_path / "scalar.json"
    scalar.write_text('{"a": 1}')
    with pytest.raises(ConfigError, match="expected a JSON list of objects"):
        await collect([], context(tmp_path, f"mine.seeds={scalar}"))
