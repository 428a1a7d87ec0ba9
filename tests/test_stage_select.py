"""The select stage: SFT rules, RL pass band, environment-disjoint splits, decontamination, report; and the
rollout → select path through the runner with a scripted agent."""

import json
from pathlib import Path

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.decontaminate import BenchmarkIndex, read_benchmark
from builder.llm import ChatRequest, ScriptedModel, tool_reply
from builder.llm.connect import client_for
from builder.records import (
    ChatMessage,
    Environment,
    FunctionCall,
    Rejection,
    Sampling,
    Scenario,
    Selection,
    ToolCall,
    Trajectory,
)
from builder.reports import SelectReport
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, StageContext
from builder.sandbox.runtime import Sandbox
from builder.splits import is_rl_environment
from builder.stages.select import select
from builder.stats import StageStats
from builder.store import Store
from tests.fixtures.run_tables import pipeline_stage, source_stage, write_stage
from tests.fixtures.scenarios import PROVENANCE, bank_scenario, environment, library_scenario

BENCHMARKS = Path(__file__).parent / "fixtures" / "benchmarks"
TOOLS = environment("bank").tools
TRANSFER = {"source": "acc-1", "target": "acc-2", "amount": 300}
POLICY = "builtin:SmolLM2-135M-Instruct"  # rollout.rl_agent_model: the band cuts a policy's pass rates


def env_ids(rl: bool, count: int, fraction: float = 0.5) -> list[str]:
    """Environment ids that fall into the rl (or train) split at `fraction`."""
    found = [f"env-{i:016x}" for i in range(200) if is_rl_environment(f"env-{i:016x}", fraction) == rl]
    return found[:count]


TRAIN_ENV, TRAIN_ENV_2 = env_ids(False, 2)
RL_ENV, RL_ENV_2 = env_ids(True, 2)


def call(name="transfer", arguments=TRANSFER, call_id="call_0"):
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ToolCall(id=call_id, function=FunctionCall(name=name, arguments=text))


def trajectory(env_id=TRAIN_ENV, scenario="scenario-a", sample=0, solved=True, calls=None, **fields):
    calls = [call()] if calls is None else calls
    messages = [
        ChatMessage(role="system", content="sys"),
        ChatMessage(role="user", content="Move 300 cents from acc-1 to acc-2."),
        ChatMessage(role="assistant", tool_calls=tuple(calls) or None),
        *[ChatMessage(role="tool", content="{}", tool_call_id=c.id, name=c.function.name) for c in calls],
        ChatMessage(role="assistant", content=fields.pop("final", "Done.")),
    ]
    if not calls:
        messages = [m for m in messages if m.role != "assistant" or m.content]
    values = dict(
        provenance=PROVENANCE, scenario_id=scenario, env_id=env_id, mode="non_conversational", model="m",
        sampling=Sampling(temperature=1.0, seed=sample), sample_index=sample, messages=tuple(messages), tools=TOOLS,
        reward=1.0 if solved else 0.0, solved=solved, checks_passed=(solved,), end_reason="agent_done",
        num_turns=2, num_tool_calls=len(calls),
    )  # fmt: skip
    values.update(fields)
    return Trajectory(**values)


def context(tmp_path, *overrides):
    config = load_config(
        None, [f"store.path={json.dumps(str(tmp_path / 'store'))}", "select.rl_env_fraction=0.5", *overrides]
    )
    needs = {Scenario: "scenarios", Environment: "evaluate"}
    return StageContext(config, "hash", tmp_path, StageStats("select", report=SelectReport()), needs=needs)


def verdicts(results):
    """{subject id: reason or 'sft'/'rl'}."""
    out = {}
    for record in results:
        if isinstance(record, Rejection):
            out[record.subject_id] = record.reason
        else:
            out[record.subject_id] = record.kind
    return out


async def test_sft_rules_each_with_its_reason(tmp_path):
    kept = trajectory(sample=0)
    cases = {
        "not_solved": trajectory(sample=1, solved=False),
        "malformed_call": trajectory(sample=2, calls=[call(arguments='{"source": "acc-1"')]),
        "cut": trajectory(sample=3, end_reason="max_turns"),
        "collateral": trajectory(sample=4, collateral=("accounts.acc-3.frozen",), flags=("collateral",)),
        "void": trajectory(sample=5, end_reason="user_leak"),
        "duplicate": trajectory(sample=6, calls=[call(call_id="other_id")]),  # same talk, other call id
        "too_short": trajectory(sample=7, calls=[]),
        "too_long": trajectory(sample=8, final="x" * 50_000),
    }
    unknown = trajectory(sample=9, calls=[call(name="teleport")])
    schema_break = trajectory(sample=10, calls=[call(arguments={"source": "acc-1", "target": "acc-2", "amount": "3"})])
    results = await select([kept, *cases.values(), unknown, schema_break], context(tmp_path))
    got = verdicts(results)
    assert got[kept.id] == "sft"
    assert {reason: got[t.id] for reason, t in cases.items()} == {reason: reason for reason in cases}
    assert got[unknown.id] == got[schema_break.id] == "malformed_call"
    (selection,) = [r for r in results if isinstance(r, Selection)]
    assert (selection.split, selection.scenario_id, selection.num_rollouts) == ("train", "scenario-a", 10)
    # `void` is not graded: the pass rate counts the other ten rollouts.
    assert selection.pass_rate == pytest.approx(sum(t.solved for t in [kept, *cases.values(), unknown, schema_break]
                                                    if t.end_reason != "user_leak") / 10)  # fmt: skip


async def test_rl_pass_band_on_held_out_environments(tmp_path):
    group = [trajectory(RL_ENV, "mixed", i, solved=i % 2 == 0, model=POLICY) for i in range(4)]
    group += [trajectory(RL_ENV, "easy", i, model=POLICY) for i in range(4)]
    group += [trajectory(RL_ENV_2, "hard", i, solved=False, model=POLICY) for i in range(4)]
    group += [trajectory(RL_ENV_2, "lonely", 0, solved=False, model=POLICY)]
    group += [trajectory(RL_ENV_2, "lonely", 1, end_reason="llm_error", model=POLICY)]
    ctx = context(tmp_path, "select.rl_pass_band=[0.1, 0.9]", f"rollout.rl_agent_model={POLICY}")
    results = await select(group, ctx)
    got = verdicts(results)
    assert got == {"mixed": "rl", "easy": "pass_rate_out_of_band", "hard": "pass_rate_out_of_band",
                   "lonely": "too_few_rollouts"}  # fmt: skip
    (chosen,) = [r for r in results if isinstance(r, Selection)]
    assert (chosen.split, chosen.pass_rate, chosen.num_rollouts) == ("rl", 0.5, 4)
    assert not any(isinstance(r, Selection) and r.kind == "sft" for r in results)  # no SFT from rl environments
    assert ctx.stats.report.rl_band == {"applied": True, "band": [0.1, 0.9], "measured_with": POLICY, "reason": ""}


async def test_without_a_policy_the_band_is_not_applied_and_rl_keeps_measured_rates(tmp_path):
    # The synthesis model played the rl environments: a teacher that solves everything would empty any band.
    group = [trajectory(RL_ENV, "easy", i) for i in range(2)]
    group += [trajectory(RL_ENV, "mixed", i, solved=i == 0) for i in range(2)]
    group += [trajectory(RL_ENV_2, "hard", i, solved=False) for i in range(2)]
    group += [trajectory(RL_ENV_2, "lonely", 0), trajectory(RL_ENV_2, "lonely", 1, end_reason="llm_error")]
    ctx = context(tmp_path, "llm.url=http://teacher.invalid/v1", "llm.served_model_name=teacher")
    results = await select(group, ctx)
    # No band to place a rate in: one graded rollout measures it (the other ended on an infrastructure error).
    assert verdicts(results) == {"easy": "rl", "mixed": "rl", "hard": "rl", "lonely": "rl"}
    rates = {r.subject_id: (r.pass_rate, r.num_rollouts) for r in results if isinstance(r, Selection)}
    assert rates == {"easy": (1.0, 2), "mixed": (0.5, 2), "hard": (0.0, 2), "lonely": (1.0, 1)}
    band = ctx.stats.report.rl_band
    # Whose pass rates these are: the model the rl trajectories carry (the config would name `teacher`).
    assert (band["applied"], band["band"], band["measured_with"]) == (False, [0.0, 1.0], "m")
    assert "rollout.rl_agent_model is not set" in band["reason"]
    assert ctx.stats.report.rl_kept == 4


async def test_splits_are_deterministic_and_environment_disjoint(tmp_path):
    envs = env_ids(False, 6, 0.3) + env_ids(True, 6, 0.3)
    group = [
        trajectory(env, f"s-{env}-{s}", i, solved=i != 1, final=f"Done {s}.")
        for env in envs
        for s in range(2)
        for i in range(3)
    ]
    first = await select(group, context(tmp_path, "select.rl_env_fraction=0.3"))
    again = await select(list(reversed(group)), context(tmp_path, "select.rl_env_fraction=0.3"))
    assert [r.id for r in first] == [r.id for r in again]
    chosen = [r for r in first if isinstance(r, Selection)]
    train = {r.env_id for r in chosen if r.split == "train"}
    rl = {r.env_id for r in chosen if r.split == "rl"}
    assert train and rl and not train & rl
    assert all(is_rl_environment(r.env_id, 0.3) == (r.split == "rl") for r in chosen)  # export agrees
    assert {r.kind for r in chosen if r.split == "train"} == {"sft"}
    assert {r.kind for r in chosen if r.split == "rl"} == {"rl"}


def test_benchmark_files_are_read_in_every_format():
    tau = read_benchmark(BENCHMARKS / "tau_sample.jsonl")
    bfcl = read_benchmark(BENCHMARKS / "bfcl_sample.json")
    plain = read_benchmark(BENCHMARKS / "plain_sample.txt")
    assert (len(tau), len(bfcl), len(plain)) == (3, 2, 1)
    assert "Mia Li" in tau[0].text and "final_report.pdf" in bfcl[0].text  # nested BFCL messages
    index = BenchmarkIndex([*tau, *bfcl, *plain], n=8)
    assert index.match("Please move 300 cents from my checking account acc-1 to my savings account acc-2").overlap == 1
    assert index.match("An unrelated sentence about a completely different topic entirely here").overlap == 0
    assert index.match("too short").benchmark is None


async def test_decontamination_drops_copied_scenarios_and_reports(tmp_path):
    bank, library = bank_scenario(), library_scenario()
    write_stage(tmp_path, "scenarios", [bank, library])
    write_stage(tmp_path, "evaluate", [environment("bank"), environment("library")])
    files = json.dumps([str(BENCHMARKS / name) for name in ("tau_sample.jsonl", "bfcl_sample.json")])
    group = [
        trajectory(bank.env_id, bank.id, 0),
        trajectory(library.env_id, library.id, 0),
    ]
    ctx = context(tmp_path, f"select.benchmarks={files}", "select.rl_env_fraction=0")
    got = verdicts(await select(group, ctx))
    assert got == {group[0].id: "contaminated", group[1].id: "contaminated"}
    report = ctx.stats.report.to_json()["decontamination"]
    assert report["checked"] and report["benchmark_texts"] == 5 and report["scenarios_checked"] == 2
    assert "tau_sample.jsonl#2" in report["scenarios_dropped"][bank.id]
    assert "bfcl_sample.json#1" in report["scenarios_dropped"][library.id]
    # The library task is a near copy (5 of its 9 8-grams): a stricter threshold keeps it.
    strict = context(tmp_path, f"select.benchmarks={files}", "select.rl_env_fraction=0",
                     "select.decontamination_threshold=0.6")  # fmt: skip
    got = verdicts(await select(group, strict))
    assert got == {group[0].id: "contaminated", group[1].id: "sft"}


async def test_report_has_rates_distributions_and_yield(tmp_path):
    group = [trajectory(sample=i, solved=i < 3, final=f"Done {i}.", num_turns=2 + i) for i in range(4)]
    ctx = context(tmp_path)
    await select(group, ctx)
    report = ctx.stats.report.to_json()
    assert report["solve_rate"][f"{TRAIN_ENV}/non_conversational"] == 0.75
    assert report["solve_rate"]["*/non_conversational"] == 0.75
    assert report["turns"]["min"] == 2 and report["turns"]["max"] == 5
    assert (report["sft_kept"], report["sft_yield"]) == (3, 0.75)
    assert report["decontamination"]["checked"] is False
    # One environment, and it hashes into train: the operator is told the RL split is empty.
    assert report["splits"]["train_envs"] == 1 and report["splits"]["rl_envs"] == 0
    assert "the rl split has no environment" in report["splits"]["warning"]
    balanced = context(tmp_path, "select.rl_env_fraction=0.3")
    envs = env_ids(False, 2, 0.3) + env_ids(True, 2, 0.3)
    await select([trajectory(env, f"s-{env}", 0) for env in envs], balanced)
    assert balanced.stats.report.to_json()["splits"] == {"train_envs": 2, "rl_envs": 2}


# ------------------------------------------------------------------------------ rollout → select, end to end


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig(call_timeout_s=2.0, kill_grace_s=1.0, memory_mb=256)) as runtime:
        yield runtime


async def test_rollout_then_select_through_the_runner(tmp_path, sandbox):
    config = load_config(
        None,
        [f"store.path={json.dumps(str(tmp_path / 'store'))}", "rollout.samples_per_scenario=2",
         "select.rl_env_fraction=0"],
    )  # fmt: skip

    async def scenarios(_, ctx):
        return [bank_scenario(), library_scenario()]

    def answer(request: ChatRequest):
        if any(m.role == "tool" for m in request.messages):
            return "Done."
        if "Emma" in request.messages[1].content:
            return tool_reply(("borrow", {"member_id": "m1", "book_id": "b2", "days": 7}))
        return tool_reply(("transfer", TRANSFER)) if request.sample_index == 0 else "I will not do that."

    model = client_for(config.llm, ScriptedModel(answer), model_id="agent")
    stages = (
        source_stage("evaluate", [environment("bank"), environment("library")]),
        BatchStage("scenarios", scenarios, input=None, output=type(bank_scenario())),
        pipeline_stage("rollout"),
        pipeline_stage("select"),
    )
    stats = await run_stages(stages, config, tmp_path / "run", llm=lambda s: model, sandbox=lambda: sandbox)
    assert (stats["rollout"].kept, stats["select"].kept) == (4, 2)
    assert dict(stats["select"].dropped) == {"not_solved": 1, "duplicate": 1}  # both library samples alike
    selections = pl.read_parquet(tmp_path / "run" / "select.parquet")
    assert set(selections["kind"]) == {"sft"} and set(selections["split"]) == {"train"}
    stored = json.loads((tmp_path / "run" / "stats.json").read_text())["stages"]["select"]["report"]
    assert stored["sft_kept"] == 2 and stored["solve_rate"]["*/non_conversational"] == 0.75
    assert len(Store(config.store.path).trajectories()) == 4


def test_benchmarks_from_a_hub_dataset_id(monkeypatch):
    import datasets

    from builder.decontaminate import read_source
    from builder.errors import ConfigError

    rows = [{"id": "t0", "question": [[{"role": "user", "content": "Book a table for two tonight at eight"}]]}]
    calls = []

    def fake_load(name, split):
        calls.append((name, split))
        if name == "missing/set":
            raise FileNotFoundError("no such dataset")
        return rows

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    (text,) = read_source("hf:gorilla/bfcl:train")
    assert (
        calls == [("gorilla/bfcl", "train")] and "Book a table" in text.text and text.source == "hf:gorilla/bfcl:train"
    )
    with pytest.raises(ConfigError, match="missing/set"):
        read_source("hf:missing/set")


async def test_the_release_holds_exactly_what_select_chose(tmp_path):
    # Through the executor, as in a run: the stages before select are fixed records persisted as the pipeline
    # declares them. In the train environment select keeps one of three trajectories; in the rl environment a
    # strong agent solves one scenario every time (pass rate 1.0, outside the band) and the other half the time.
    # A second run then judges the kept trajectory again and drops it: the release must follow that, too.
    from builder.publish.export import build_tables

    fraction = 0.3  # library is `rl` at this fraction, bank `train` (tests/integration/test_rl_agent_vllm.py)
    bank, library = environment("bank"), environment("library")
    assert is_rl_environment(library.id, fraction) and not is_rl_environment(bank.id, fraction)
    easy, mixed = library_scenario(), library_scenario("conversational")
    good = trajectory(bank.id, bank_scenario().id, 0)
    truncated = trajectory(bank.id, bank_scenario().id, 1, flags=("truncated_reply",), final="Done, I mov")
    malformed = trajectory(bank.id, bank_scenario().id, 2, calls=[call(name="teleport")])
    played = [good, truncated, malformed]
    played += [trajectory(library.id, easy.id, i) for i in range(2)]
    played += [trajectory(library.id, mixed.id, i, solved=i == 0) for i in range(2)]

    def fixed(name, records, table):
        async def stage(_, ctx):
            return records

        return BatchStage(name, stage, input=None, output=type(records[0]), persist=table)

    rollouts = list(played)
    stages = (
        fixed("evaluate", [bank, library], "environments"),
        fixed("scenarios", [bank_scenario(), easy, mixed], "scenarios"),
        fixed("rollout", rollouts, "trajectories"),
        pipeline_stage("select"),
    )  # fmt: skip
    options = [f"store.path={json.dumps(str(tmp_path / 'store'))}", f"select.rl_env_fraction={fraction}",
               f"rollout.rl_agent_model={POLICY}"]  # fmt: skip
    config = load_config(None, options)

    def release_and_selection(run_dir):
        chosen = pl.read_parquet(run_dir / "select.parquet")
        store = Store(config.store.path)
        frames = [store.read_frame(n) for n in ("environments", "scenarios", "trajectories", "selections")]
        tables = build_tables(*frames, rl_fraction=fraction)
        by_kind = {kind: sorted(chosen.filter(pl.col("kind") == kind)["subject_id"]) for kind in ("sft", "rl")}
        return tables, by_kind

    await run_stages(stages, config, tmp_path / "run-1")
    tables, chosen = release_and_selection(tmp_path / "run-1")
    assert chosen == {"sft": [good.id], "rl": [mixed.id]}
    assert sorted(tables["sft"]["train"]["trajectory_id"]) == chosen["sft"]
    assert sorted(tables["scenarios"]["rl"]["scenario_id"]) == chosen["rl"]
    assert tables["scenarios"]["rl"]["pass_rate"].to_list() == [0.5] and tables["environments"]["rl"].height == 1
    assert tables["scenarios"]["train"]["scenario_id"].to_list() == [bank_scenario().id]  # train: all scenarios

    # Run 2 replays the same ids, but the good trajectory now carries a cut reply: select drops it.
    rollouts[0] = good.model_copy(update={"flags": ("truncated_reply",)})
    await run_stages(stages, config, tmp_path / "run-2")
    tables, chosen = release_and_selection(tmp_path / "run-2")
    assert chosen == {"sft": [], "rl": [mixed.id]} and tables["sft"]["train"].height == 0
    assert sorted(tables["scenarios"]["rl"]["scenario_id"]) == [mixed.id]
