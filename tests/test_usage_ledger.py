"""One usage ledger: the same calls give the same figures in a stage's stats, the client's totals, the replies'
costs and a trajectory's usage (`records.Usage`); stats.json and run-folder tables of older builders still load.

The sequence: a request answered, the same request again (from the response cache), a reply cut at its budget
and asked again grown, and a request the server refuses. By the rule: 3 calls (the cut reply and its regrowth
are two), 1 cached call whose tokens are not spent, 1 failed call, 1 regrowth.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.llm import ChatRequest, LLMRequestError, Reply, ResponseCache, ScriptedModel, TokenUsage, tool_reply
from builder.llm.connect import client_for
from builder.pipeline import LazyModel
from builder.records import ChatMessage, Sampling, Trajectory
from builder.run.folder import INPUT_ID, RunFolder
from builder.sandbox.runtime import Sandbox
from builder.stages.rollout import rollout
from builder.stats import StageStats, load_stats, save_stats
from builder.tables import to_frame
from builder.usage import Usage
from tests.fixtures.ledger import attempt
from tests.fixtures.run_tables import write_stage
from tests.fixtures.scenarios import bank_scenario, environment

SEQUENCE = Usage(calls=3, cached_calls=1, failed_calls=1, regrowths=1, prompt_tokens=300, completion_tokens=140)
BUDGET = 1000  # the requests' completion budget; a cut reply is answered whole at twice that
ANSWERED, CUT, WHOLE = TokenUsage(prompt_tokens=100, completion_tokens=10), TokenUsage(prompt_tokens=100,
    completion_tokens=50), TokenUsage(prompt_tokens=100, completion_tokens=80)  # fmt: skip
LLM = ["llm.max_model_len=32768", "llm.thinking=off", "llm.max_retries=0", "llm.max_budget_growths=1"]


def refusal() -> LLMRequestError:
    return LLMRequestError("HTTP 400: the request is wrong", status_code=400)


def sized(reply: Reply, usage: TokenUsage, finish_reason: str | None = None) -> Reply:
    return reply.model_copy(update={"usage": usage, "finish_reason": finish_reason or reply.finish_reason})


def asked(text: str) -> ChatRequest:
    return ChatRequest(messages=(ChatMessage(role="user", content=text),), sampling=Sampling(max_tokens=BUDGET))


def cut_or_whole(request: ChatRequest, reply: Reply) -> Reply:
    """`reply`, cut at the budget the request was asked with and whole once the client grew it."""
    if request.sampling.max_tokens <= BUDGET:
        return sized(reply, CUT, "length")
    return sized(reply, WHOLE)


async def test_the_sequence_gives_the_same_figures_in_stats_totals_and_costs(tmp_path) -> None:
    config = load_config(None, LLM)

    def answer(request: ChatRequest) -> Reply | BaseException:
        text = request.messages[-1].content
        if text == "refused":
            return refusal()
        if text == "long":
            return cut_or_whole(request, Reply(content="a long answer"))
        return sized(Reply(content="ok"), ANSWERED)

    model = ScriptedModel(answer, prompt_tokens=lambda request: 100)
    stats, clients = StageStats("code"), []
    with ResponseCache(tmp_path / "cache.sqlite") as cache:

        def open_client(on_call):
            clients.append(client_for(config.llm, model, model_id="m", cache=cache, on_call=on_call))
            return clients[-1]

        llm = LazyModel(config.llm, open_client).for_stage(stats)
        costs = []
        for text in ("ok", "ok", "long"):
            costs.append((await llm.chat(asked(text))).cost)
        with pytest.raises(LLMRequestError) as refused:
            await llm.chat(asked("refused"))
        costs.append(refused.value.cost)
    assert costs == [
        Usage(calls=1, prompt_tokens=100, completion_tokens=10),
        Usage(cached_calls=1),  # the reply is replayed, its tokens were spent by the first request
        Usage(calls=2, regrowths=1, prompt_tokens=200, completion_tokens=130),  # the cut reply was paid for too
        Usage(failed_calls=1),
    ]
    assert stats.usage == clients[0].totals == sum(costs, Usage()) == SEQUENCE
    assert len(model.requests) == 4  # every call but the cache hit reached the server
    assert StageStats.from_json(json.loads(json.dumps(stats.to_json()))).usage == SEQUENCE


async def test_a_failed_regrowth_costs_the_cut_reply_and_the_failure() -> None:
    config = load_config(None, LLM)

    def answer(request: ChatRequest) -> Reply | BaseException:
        return refusal() if request.sampling.max_tokens > BUDGET else sized(Reply(content="cut"), CUT, "length")

    stats, model = StageStats("code"), ScriptedModel(answer, prompt_tokens=lambda request: 100)
    llm = client_for(config.llm, model, model_id="m", on_call=stats.add_call)
    with pytest.raises(LLMRequestError) as refused:
        await llm.chat(asked("x"))
    expected = Usage(calls=1, failed_calls=1, regrowths=1, prompt_tokens=100, completion_tokens=50)
    assert refused.value.cost == stats.usage == llm.totals == expected


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)) as runtime:
        yield runtime


async def test_a_trajectory_counts_the_sequence_as_the_stage_and_the_client_do(tmp_path, sandbox) -> None:
    """An attempt whose episode failed when the server went away (`llm_error`, a failed sample), then one once it
    is back: its first reply comes from the cache, the second is answered, the third is cut and asked again grown,
    the fourth is refused (`llm_error`)."""
    config = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'store'))}", *LLM,
                                "rollout.samples_per_scenario=1", f"rollout.max_reply_tokens={BUDGET}"])  # fmt: skip
    write_stage(tmp_path, "evaluate", [environment("bank"), environment("library")])
    transfer = tool_reply(("transfer", {"source": "acc-1", "target": "acc-2", "amount": 300}))
    server_gone = True

    def answer(request: ChatRequest) -> Reply | BaseException:
        turn = sum(message.role == "assistant" for message in request.messages)
        if turn == 0:
            return sized(tool_reply(("get_account", {"account_id": "acc-1"})), ANSWERED)
        if turn == 1:
            return LLMRequestError("connection refused", retryable=True) if server_gone else sized(transfer, ANSWERED)
        if turn == 2:
            return cut_or_whole(request, tool_reply(("get_account", {"account_id": "acc-2"})))
        return refusal()

    model = ScriptedModel(answer, prompt_tokens=lambda request: 100)
    with ResponseCache(tmp_path / "llm_cache.sqlite") as cache:
        first = attempt("rollout", config, model, cache, tmp_path, sandbox, model_id="agent")
        (failed,) = await rollout(bank_scenario(), first)
        assert (failed.end_reason, failed.num_turns) == ("llm_error", 1)
        assert first.stats.usage == Usage(calls=1, failed_calls=1, prompt_tokens=100, completion_tokens=10)
        server_gone = False
        resumed = attempt("rollout", config, model, cache, tmp_path, sandbox, model_id="agent")
        (trajectory,) = await rollout(bank_scenario(), resumed)
    assert (trajectory.end_reason, trajectory.num_turns) == ("llm_error", 3)
    assert trajectory.usage == resumed.stats.usage == resumed.llm.totals == SEQUENCE
    # Over both attempts the run paid for each answer once: the cache hit repeats no cost.
    assert (first.stats.usage + resumed.stats.usage).calls == len(model.requests) - 2  # two got no answer


def test_stats_json_of_an_older_builder_loads_into_the_ledger(tmp_path) -> None:
    # Before the one ledger a stage's counters were flat, and `llm_calls` counted the failed requests too.
    old = {"stage": "mine", "inputs": 4, "resumed": 0, "kept": 3, "dropped": {"x": 1}, "llm_calls": 7,
           "llm_cache_hits": 2, "llm_failures": 1, "llm_latency_s": 1.5, "llm_regrowths": 1, "prompt_tokens": 600,
           "completion_tokens": 60, "wall_s": 3.0, "report": {}, "tokens_per_kept": 220.0, "yield": 0.75,
           "per_kept": {"llm_calls": 2.33}}  # fmt: skip
    path = tmp_path / "stats.json"
    path.write_text(json.dumps({"stages": {"mine": old}, "prompt_tokens": 600}))
    stats = load_stats(path)["mine"]
    expected = Usage(calls=6, cached_calls=2, failed_calls=1, regrowths=1, prompt_tokens=600, completion_tokens=60)
    assert (stats.usage, stats.llm_latency_s, stats.kept, dict(stats.dropped)) == (expected, 1.5, 3, {"x": 1})
    save_stats(path, {"mine": stats})
    saved = json.loads(path.read_text())["stages"]["mine"]
    assert saved["usage"] == expected.model_dump() and "llm_calls" not in saved
    assert saved["per_kept"] == {"calls": 2.0, "prompt_tokens": 200.0, "completion_tokens": 20.0, "wall_s": 1.0}
    assert load_stats(path)["mine"] == stats


def test_a_run_folder_table_with_the_older_usage_struct_is_compacted_with_new_rows(tmp_path) -> None:
    """A rollout table an older builder wrote (usage: calls and tokens only) resumed by this one."""
    folder = RunFolder(tmp_path)
    older = _trajectory(0, Usage(calls=2, prompt_tokens=30, completion_tokens=4))
    frame = to_frame(Trajectory, [older]).with_columns(pl.lit(older.id).alias(INPUT_ID))
    kept = [pl.col("usage").struct.field(name) for name in ("calls", "prompt_tokens", "completion_tokens")]
    frame.with_columns(pl.struct(kept).alias("usage")).write_parquet(folder.table("rollout"))
    older_fields = list(pl.read_parquet(folder.table("rollout")).schema["usage"].to_schema())
    assert older_fields == ["calls", "prompt_tokens", "completion_tokens"]
    newer = _trajectory(1, SEQUENCE)
    write_stage(tmp_path, "rollout", [newer])
    back = {t.sample_index: t for t in folder.read("rollout", Trajectory)}
    assert back[0].usage == Usage(calls=2, prompt_tokens=30, completion_tokens=4)  # the counts it did not keep: 0
    assert back[1].usage == SEQUENCE


def _trajectory(index: int, usage: Usage) -> Trajectory:
    return Trajectory(
        provenance={"config_hash": "h"}, scenario_id="scen-1", env_id="env-1", mode="non_conversational",
        model="m", sampling=Sampling(), sample_index=index, messages=(ChatMessage(role="user", content="hi"),),
        tools=[], reward=0.0, solved=False, checks_passed=(), end_reason="agent_done", usage=usage,
    )  # fmt: skip
