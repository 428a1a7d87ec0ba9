import json
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from builder.config import load_config
from builder.errors import ConfigError
from builder.records import Rejection, SeedTask
from builder.run.stage import StageContext
from builder.seeds import api_bank_request, read_seeds, toolace_request
from builder.stages.collect import cheap_filter_reason, collect
from builder.stats import StageStats

# The shared seed data sits beside the checkout (../shared); look upward so worktrees find it too.
API_BANK = next(
    (
        p / "shared" / "seeds" / "api-bank-lv3-train.json"
        for p in Path(__file__).resolve().parents
        if (p / "shared" / "seeds" / "api-bank-lv3-train.json").exists()
    ),
    Path(__file__).parents[2] / "shared" / "seeds" / "api-bank-lv3-train.json",
)


def context(tmp_path, *overrides: str) -> StageContext:
    return StageContext(load_config(None, list(overrides)), "hash", tmp_path, StageStats("collect"))


def split(results):
    return [r for r in results if isinstance(r, SeedTask)], [r for r in results if isinstance(r, Rejection)]


async def test_builtin_corpus_is_broad(tmp_path):
    kept, rejected = split(await collect([], context(tmp_path, "mine.max_seeds=none")))
    assert len(kept) >= 80
    domains = Counter(seed.domain for seed in kept)
    assert len(domains) >= 15
    assert max(domains.values()) <= len(kept) // 5  # no domain dominates the corpus
    assert {r.reason for r in rejected} <= {"media"}  # the corpus holds a few media requests on purpose
    assert rejected, "the builtin corpus should exercise the media filter"


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
async def test_local_files_with_duplicates_and_limit(tmp_path, suffix):
    rows = [{"q": "Book room 12 for me"}, {"q": "Cancel order 7 right now"}, {"q": "book  room 12 for me."}]
    rows.append({"q": "Refund order 9 to my card"})
    path = tmp_path / f"seeds{suffix}"
    if suffix == ".json":
        path.write_text(json.dumps(rows))
    elif suffix == ".jsonl":
        path.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    else:
        pl.DataFrame(rows).write_parquet(path)
    ctx = context(tmp_path, f"mine.seeds={path}", "mine.request_field=q", "mine.max_seeds=3")
    kept, rejected = split(await collect([], ctx))
    expected = ["Book room 12 for me", "Cancel order 7 right now", "Refund order 9 to my card"]
    assert [seed.request for seed in kept] == expected  # the duplicate does not count against max_seeds
    assert [r.reason for r in rejected] == ["duplicate"]
    assert "repeats row 0" in rejected[0].detail


@pytest.mark.parametrize(
    ("request_text", "reason"),
    [
        ("Cancel my booking H-2291 and rebook the same room for 3 nights", None),
        ("Réserve une chambre à l'hôtel près de la gare pour deux nuits", "language"),
        ("Generate an image of a cat wearing a hat", "media"),
        ("Transcribe this audio file from yesterday's meeting", "media"),
        ("Copy the order id to my clipboard and cancel order 55", None),  # not a media word on its own
        ("Help", "too_short"),
        ("the word " * 150, "too_long"),
    ],
)
def test_cheap_filters(request_text, reason):
    assert cheap_filter_reason(request_text, min_words=4, max_words=200) == reason


async def test_empty_requests_are_rejected(tmp_path):
    path = tmp_path / "s.jsonl"
    path.write_text('{"request": ""}\n{"request": null}\n{"request": "Pay invoice 42 from my checking account"}\n')
    kept, rejected = split(await collect([], context(tmp_path, f"mine.seeds={path}")))
    assert len(kept) == 1 and [r.reason for r in rejected] == ["empty", "empty"]


def test_api_bank_parser_on_real_data():
    rows = list(read_seeds(str(API_BANK), fmt="auto", request_field="request"))
    assert len(rows) == 1245
    assert rows[0].request == "Find a cardiologist in Los Angeles for a check-up appointment."
    requests = {row.request for row in rows}
    assert len(requests) > 300
    assert not any("TIME:" in r or "API-Request" in r or "User:" in r for r in requests)


async def test_api_bank_through_collect(tmp_path):
    kept, rejected = split(await collect([], context(tmp_path, f"mine.seeds={API_BANK}", "mine.max_seeds=none")))
    assert 250 < len(kept) < 400
    assert Counter(r.reason for r in rejected)["duplicate"] > 800  # lv3 repeats each utterance per API step
    # max_seeds counts kept tasks: the repeats in between do not use up the budget.
    capped, dropped = split(await collect([], context(tmp_path, f"mine.seeds={API_BANK}", "mine.max_seeds=30")))
    assert len(capped) == 30 and [seed.request for seed in capped] == [seed.request for seed in kept[:30]]
    assert dropped and {r.reason for r in dropped} == {"duplicate"}


def test_parsers_on_odd_rows():
    assert api_bank_request({"input": "no user turn"}) is None
    assert api_bank_request({"input": "x\nUser: Book a table for two.\nAI: ok\nUser: more"}) == "Book a table for two."
    assert toolace_request({"conversations": [{"from": "user", "value": " Find flight AA12 "}]}) == "Find flight AA12"
    assert toolace_request({"conversations": [{"from": "assistant", "value": "hi"}]}) is None
    assert toolace_request({"conversations": "oops"}) is None


async def test_toolace_file(tmp_path):
    path = tmp_path / "toolace.json"
    path.write_text(
        json.dumps(
            [
                {
                    "system": "tools...",
                    "conversations": [
                        {"from": "user", "value": "Transfer $40 from savings account 1002 to checking account 1001"},
                        {"from": "assistant", "value": "[transfer(...)]"},
                    ],
                }
            ]
        )
    )
    kept, _ = split(await collect([], context(tmp_path, f"mine.seeds={path}")))
    assert kept[0].request.startswith("Transfer $40")


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
    torn = tmp_path / "torn.jsonl"
    torn.write_text('{"request": "a b c d"}\n{"request": \n')
    with pytest.raises(ConfigError, match="line 2 is not valid JSON"):
        await collect([], context(tmp_path, f"mine.seeds={torn}"))
    wrong_field = tmp_path / "w.jsonl"
    wrong_field.write_text('{"text": "book a room for me"}\n')
    with pytest.raises(ConfigError, match="has no such field; its fields are: text"):
        await collect([], context(tmp_path, f"mine.seeds={wrong_field}", "mine.seed_format=records"))
    with pytest.raises(ConfigError, match="neither 'builtin', an existing file, nor a dataset id"):
        await collect([], context(tmp_path, "mine.seeds=not a dataset"))


async def test_hub_dataset_id_offline_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="cannot load split 'train' with datasets"):
        await collect([], context(tmp_path, "mine.seeds=someorg/no-such-dataset"))
