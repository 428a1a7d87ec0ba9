"""The fixture pipeline against a model that answers 20% of requests badly, as real servers and gateways do: it
keeps at least 95% of what the clean run keeps, and no input ends as `exception:*` (a bug).

The whole of `python -m builder run` runs (the real client with its retries, re-asks and reply cleaning, the
runner, the sandbox, the store); the scripted teacher of tests/fixtures/teacher.py stands behind `llm.url` as in
tests/test_pipeline_e2e.py, and a seeded injector in front of it turns a share of its answers into faults:
rate-limits with `Retry-After`, 5xx, dropped connections, and replies that are empty, cut at the token limit,
off the schema, or carry a lone surrogate and a NUL (agent turns get only the transient ones: a bad reply there
is the trajectory's own flaw, which select rightly drops). (The HTTP side of the same faults, non-JSON bodies included,
is tests/test_llm_faults.py's, against tests/faulty_llm.py's endpoint.)
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter

import pytest

from builder.llm import Reply, ScriptedModel, TransientLLMError
from builder.llm.base import ChatRequest
from builder.stats import load_stats
from tests.fixtures.teacher import teacher
from tests.test_import import ENVS, RL, run_import
from tests.test_import import agent as warehouse_agent
from tests.test_pipeline_e2e import run

pytestmark = pytest.mark.usefixtures("restore_logging")

TRANSIENT = ("status_429", "status_503", "drop")
CONTENT = ("empty", "cut", "off_schema", "surrogate")


class Faulty:
    """The teacher, with a seeded share of its answers replaced by faults. Whether the n-th sending of a request
    gets a fault (and which) is drawn from (seed, request, n), so a retry or a re-ask is a fresh draw."""

    def __init__(self, rate: float, seed: int = 7, script=teacher) -> None:
        self.model = ScriptedModel(script)
        self.rate, self.seed = rate, seed
        self.sent: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()

    async def count_prompt_tokens(self, request: ChatRequest) -> int | None:
        return await self.model.count_prompt_tokens(request)

    async def chat(self, request: ChatRequest) -> Reply:
        key = request.cache_key("teacher")
        self.sent[key] += 1
        digest = hashlib.sha256(f"{self.seed}:{key}:{self.sent[key]}".encode()).digest()
        draw = random.Random(int.from_bytes(digest[:8], "big"))
        if draw.random() >= self.rate:
            return await self.model.chat(request)
        # A bad reply in an agent's turn is that trajectory's own flaw (flagged, and filtered by select as it
        # should be), not something the pipeline can recover: agent turns get the transient faults only.
        kind = draw.choice(TRANSIENT if request.tools else TRANSIENT + CONTENT)
        self.injected[kind] += 1
        if kind == "status_429":
            raise TransientLLMError("HTTP 429 Too Many Requests", status_code=429, retry_after_s=0.0)
        if kind == "status_503":
            raise TransientLLMError("HTTP 503 Service Unavailable", status_code=503)
        if kind == "drop":
            raise TransientLLMError("connection reset by peer")
        good = await self.model.chat(request)
        if kind == "empty":
            return good.model_copy(update={"content": "", "tool_calls": ()})
        if kind == "cut":
            text = good.content or ""
            return good.model_copy(update={"content": text[: len(text) // 2], "finish_reason": "length"})
        if kind == "off_schema":
            return good.model_copy(update={"content": json.dumps({"unexpected": True}), "tool_calls": ()})
        return good.model_copy(update={"content": f"\ud800{good.content or ''}\x00"})  # surrogate


def kept(root) -> dict[str, int]:
    return {name: stats.kept for name, stats in load_stats(root / "run" / "stats.json").items()}


def test_twenty_percent_faults_keep_what_the_clean_run_keeps(tmp_path, monkeypatch):
    clean, faulty = Faulty(rate=0.0), Faulty(rate=0.2)
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: clean)
    assert run(tmp_path, "clean") == 0
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: faulty)
    assert run(tmp_path, "faulty") == 0
    assert sum(faulty.injected.values()) >= 10  # about 70 requests since evaluate batches its calls
    assert set(faulty.injected) & set(TRANSIENT) and set(faulty.injected) & set(CONTENT)
    expected, got = kept(tmp_path / "clean"), kept(tmp_path / "faulty")
    for stage, count in expected.items():
        assert got[stage] >= 0.95 * count, (stage, got, expected, faulty.injected)
    stats = load_stats(tmp_path / "faulty" / "run" / "stats.json")
    bugs = {stage: reasons for stage, s in stats.items() if (reasons := [r for r in s.dropped if ":" in r])}
    assert bugs == {}, bugs
    assert sum(s.usage.retries for s in stats.values()) > 0  # the transient faults were retried, and counted


def test_an_import_at_twenty_percent_faults_keeps_what_the_clean_import_keeps(tmp_path, monkeypatch):
    """EnvScaler environments and scenarios imported, then rolled out and selected with an agent behind a model
    that fails a fifth of the time (the import's model calls are the rollouts')."""
    rows = [row for row in json.loads(RL.read_text()) if row["task_id"] == "env_1_rl-task_1"]
    (tmp_path / "rl.json").write_text(json.dumps(rows))
    kept_by_run = {}
    for name, rate in (("clean", 0.0), ("faulty", 0.2)):
        backend = Faulty(rate=rate, seed=3, script=warehouse_agent)
        monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, _b=backend, **kwargs: _b)
        args = ("envscaler", str(ENVS), "--scenarios", str(tmp_path / "rl.json"))
        assert run_import(tmp_path / name, *args, "--set", "rollout.samples_per_scenario=4", until=None) == 0
        stats = load_stats(tmp_path / name / "run" / "stats.json")
        kept_by_run[name] = {stage: s.kept for stage, s in stats.items()}
        assert not [r for s in stats.values() for r in s.dropped if ":" in r]  # no exception:* rejection
    assert sum(backend.injected.values()) > 0
    for stage, count in kept_by_run["clean"].items():
        assert kept_by_run["faulty"][stage] >= 0.95 * count, (stage, kept_by_run)
