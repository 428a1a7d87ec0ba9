"""The whole pipeline, seeds to release candidate, through `python -m builder run` with a scripted teacher model.

The real CLI, runner, sandbox, Parquet store and export run; only the model backend is replaced: `llm.url` is
set, so `open_llm` builds its client (response cache, accounting) around `OpenAIChatModel`, which the test swaps
for the teacher of tests/fixtures/teacher.py. A second run on the same folder must resume everything, and a run
stopped half-way and resumed must end exactly like the one-shot run.
"""

from __future__ import annotations

import json

import polars as pl
import pytest

from builder.cli import main
from builder.llm import ScriptedModel
from builder.pipeline import STAGES
from builder.publish.export import CONFIG_SPLITS, is_rl_environment
from builder.stats import load_stats
from builder.store import Store
from builder.usage import Usage
from tests.fixtures.one_schema import assert_one_tool_schema
from tests.fixtures.teacher import CHECKS, GOLD, SEEDS, TASK, teacher

# The two environments' ids are hashes of their code, fixed by the fixtures; at this fraction one falls into
# `rl` (equipment_lending, 0.39) and the other into `train` (library_loans, 0.65); asserted below, so a fixture
# change that breaks the split says so. (The module docstring carries the plan's rules since the evaluate
# stage's tester and checker read them there, which changed both ids.)
RL_FRACTION = 0.5
STAGE_NAMES = [stage.name for stage in STAGES]


@pytest.fixture
def model(monkeypatch):
    """The teacher behind `llm.url`: every client `open_llm` builds talks to it."""
    scripted = ScriptedModel(teacher)
    monkeypatch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: scripted)
    return scripted


def run(tmp_path, name: str, *options: str) -> int:
    """`python -m builder run` over `tmp_path/<name>/` (run folder, store, Hub, releases); the seed file is shared,
    so every run has the same config and config hash."""
    seeds, root = tmp_path / "seeds.jsonl", tmp_path / name
    seeds.write_text("".join(json.dumps({"request": seed}) + "\n" for seed in SEEDS))
    overrides = {
        "llm.url": "http://teacher.invalid/v1",
        "mine.seeds": seeds,
        "evaluate.calls": 8,  # every tool positive and negative once, over the two test states
        "scenarios.per_environment": 1,
        "rollout.samples_per_scenario": 2,
        "select.rl_env_fraction": RL_FRACTION,
        "store.path": root / "store",
        "hub.root": root / "hub",
        "hub.release_root": root / "release",
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    # --profile none: the built-in defaults plus these overrides, whatever GPU the machine has.
    return main(["run", "--profile", "none", "--run-dir", str(root / "run"), *args, *options])


def run_outputs(root) -> dict[str, pl.DataFrame]:
    """Every stage table of the run folder and every store table."""
    store = Store(root / "store")
    tables = {path.name: pl.read_parquet(path) for path in sorted((root / "run").glob("*.parquet"))}
    names = ("environments", "scenarios", "trajectories", "selections")
    return tables | {f"store/{name}": store.read_frame(name) for name in names}


def assert_same(outputs: dict[str, pl.DataFrame], expected: dict[str, pl.DataFrame]) -> None:
    assert list(outputs) == list(expected)
    for name, frame in expected.items():
        assert outputs[name].equals(frame), name


def test_seeds_to_release_candidate_and_resumed_runs_change_nothing(tmp_path, model, restore_logging, capsys):
    from datasets import load_dataset

    root = tmp_path / "main"
    assert run(tmp_path, "main") == 0
    assert "release candidate 0.1.0" in capsys.readouterr().out

    # Every stage kept something, dropped what it should, and says what it cost.
    stats = load_stats(root / "run" / "stats.json")
    assert list(stats) == STAGE_NAMES
    for name, stage in stats.items():
        assert stage.kept > 0 and stage.to_json()["yield"] > 0, (name, stage.to_json())
    assert dict(stats["collect"].dropped) == {"media": 1}
    # No rollout replayed another's reply from the cache, so each trajectory's usage is the calls it paid for.
    usage = [Usage.model_validate(row) for row in pl.read_parquet(root / "run" / "rollout.parquet")["usage"]]
    assert all(item.calls > 0 and item.cached_calls == 0 for item in usage)
    assert sum(usage, Usage()) == stats["rollout"].usage
    assert dict(stats["mine"].dropped) == {"not_stateful": 1}
    assert [stats[name].kept for name in ("mine", "dedupe", "plan", "code", "evaluate")] == [2, 2, 2, 2, 2]
    assert stats["scenarios"].kept == 4  # one verified scenario per environment, in both modes
    assert stats["rollout"].kept == 8  # two samples of each
    assert dict(stats["select"].dropped) == {"not_solved": 2}  # the train environment's wrong-due-date samples
    for name in ("mine", "plan", "code", "evaluate", "scenarios", "rollout"):
        assert stats[name].usage.calls > 0 and stats[name].usage.prompt_tokens > 0, name
    assert stats["collect"].usage.calls == stats["dedupe"].usage.calls == stats["select"].usage.calls == 0
    assert sum(stage.usage.calls for stage in stats.values()) == len(model.requests)

    # The store: accepted environments with the dual-agent evidence, one in each split.
    store = Store(root / "store")
    envs = store.environments()
    assert len(envs) == 2 and {env.status for env in envs} == {"accepted"}
    assert {env.name for env in envs} == {"library_loans", "equipment_lending"}
    for env in envs:
        assert env.scores == {"dual_agent": 1.0, "tool_coverage": 1.0}
        assert env.evaluation.counts.judged == 8 and env.evaluation.counts.pass_ == 8
        assert {call.case for call in env.evaluation.calls} == {"positive", "negative"}
    rl_envs = {env.id for env in envs if is_rl_environment(env.id, RL_FRACTION)}
    assert len(rl_envs) == 1, "the fixture environments no longer split at RL_FRACTION; pick another fraction"

    # Verified scenarios in both modes: the gold sequence passes every check, the initial state does not.
    scenarios = store.scenarios()
    assert sorted((s.env_id, s.mode) for s in scenarios) == sorted(
        (env.id, mode) for env in envs for mode in ("conversational", "non_conversational")
    )
    for scenario in scenarios:
        evidence = scenario.verification
        # The two checks and the collateral guard (builder.envs.guard).
        assert evidence.verified and evidence.checks_on_final == (True, True, True)
        assert evidence.checks_on_initial == (False, False, True) and evidence.vacuous_checks == ()
        assert [call.ok for call in evidence.gold] == [True, True, True]
        assert [a.model_dump() for a in scenario.gold_actions] == GOLD
        assert scenario.checks[:-1] == tuple(CHECKS[item] for item in TASK["checklist"])
        assert scenario.checks[-1].startswith("# builder: collateral guard")
        assert (scenario.user is not None) == (scenario.mode == "conversational")

    # Trajectories graded by the checks: sample 0 solves, sample 1 gets the due date wrong (one check of two).
    trajectories = store.trajectories()
    assert len(trajectories) == 8
    for trajectory in trajectories:
        solved = trajectory.sample_index == 0
        assert (trajectory.solved, trajectory.reward) == ((True, 1.0) if solved else (False, 0.5))
        assert trajectory.checks_passed == ((True, True, True) if solved else (False, True, True))  # and the guard
        assert trajectory.collateral == () and trajectory.num_tool_calls == 3
        ending = "agent_done" if trajectory.mode == "non_conversational" else "user_stop"
        assert trajectory.end_reason == ending
    conversation = next(t for t in trajectories if t.mode == "conversational")
    assert [m.role for m in conversation.messages][:4] == ["system", "user", "assistant", "user"]

    # Select: SFT from the train environment's solved samples, RL from the rl environment's scenarios.
    selections = pl.read_parquet(root / "run" / "select.parquet")
    assert sorted(selections["kind"].to_list()) == ["rl", "rl", "sft", "sft"]
    assert set(selections.filter(pl.col("kind") == "rl")["env_id"]) == rl_envs
    assert set(selections.filter(pl.col("kind") == "sft")["env_id"]).isdisjoint(rl_envs)
    assert selections.filter(pl.col("kind") == "rl")["pass_rate"].to_list() == [0.5, 0.5]
    # What select chose is in the store, where releases are built from.
    stored = store.read_frame("selections").sort("id")
    assert stored.drop("provenance").equals(selections.drop("input_id", "provenance").sort("id"))

    # The release candidate, the run's own: every config and split loads with `datasets`, environments disjoint
    # across splits.
    assert not (root / "release").exists()
    (release,) = (root / "run" / "release").iterdir()
    assert release.name == "0.1.0"
    manifest = json.loads((release / "release.json").read_text())
    assert manifest["counts"] == {
        "environments/train": 1, "environments/rl": 1, "scenarios/train": 2, "scenarios/rl": 2, "sft/train": 2,
    }  # fmt: skip
    loaded = {
        config: load_dataset(str(release), config, cache_dir=str(tmp_path / "hf-cache")) for config in CONFIG_SPLITS
    }
    for config, splits in CONFIG_SPLITS.items():
        assert sorted(loaded[config]) == sorted(splits)
    assert set(loaded["environments"]["rl"]["env_id"]) == rl_envs
    assert set(loaded["scenarios"]["rl"]["env_id"]) == rl_envs
    assert set(loaded["scenarios"]["train"]["env_id"]).isdisjoint(rl_envs)
    sft = loaded["sft"]["train"]
    assert sft["reward"] == [1.0, 1.0] and set(sft["env_id"]).isdisjoint(rl_envs)
    assert {row["role"] for row in sft[0]["messages"]} == {"system", "user", "assistant", "tool"}
    # One tool schema: the published tools are what TRL derives from the environments' methods, and the SFT
    # prompt renders them as the GRPO prompt does.
    environments = [row for split in CONFIG_SPLITS["environments"] for row in loaded["environments"][split]]
    assert assert_one_tool_schema(environments, sft) == sum(row["num_tools"] for row in environments) > 0
    shards = sorted(str(path) for path in (release / "data" / "sft").glob("train-*.parquet"))
    assert load_dataset("parquet", data_files=shards, split="train", cache_dir=str(tmp_path / "hf-cache")).num_rows == 2

    # A rerun on the same folder resumes every stage: no model call, the same tables and the same release data.
    before, calls = run_outputs(root), len(model.requests)
    assert run(tmp_path, "main") == 0
    assert len(model.requests) == calls
    again = load_stats(root / "run" / "stats.json")
    assert {name: (s.usage.calls, s.usage.cached_calls) for name, s in again.items()} == {
        name: (s.usage.calls, s.usage.cached_calls) for name, s in stats.items()
    }
    assert_same(run_outputs(root), before)
    assert json.loads((release / "release.json").read_text())["data_sha256"] == manifest["data_sha256"]

    # A run stopped after scenarios and then resumed (in a folder of its own) ends exactly like the one-shot run.
    assert run(tmp_path, "split", "--until", "scenarios") == 0
    assert not (tmp_path / "split" / "run" / "release").exists()  # no release candidate from an unfinished run
    assert run(tmp_path, "split") == 0
    assert_same(run_outputs(tmp_path / "split"), before)
    resumed = json.loads((tmp_path / "split" / "run" / "release" / "0.1.0" / "release.json").read_text())
    assert resumed["data_sha256"] == manifest["data_sha256"]

    # The command the run printed publishes that candidate, with no other flag.
    assert f"publish --version 0.1.0 --run-dir {root / 'run'}" in capsys.readouterr().out
    assert main(["publish", "--version", "0.1.0", "--run-dir", str(root / "run")]) == 0
    assert "published v0.1.0" in capsys.readouterr().out
