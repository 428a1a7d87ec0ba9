"""The dataset card tells the truth: tasks and rows, who wrote, judged and played, the reward, the policy behind the
RL band, decontamination and the reward audit; and its code loads only splits the release has (each block runs
on its own here against the release folder; tests/integration/test_card_snippets.py runs them over a local Hub).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import datasets
import huggingface_hub
import polars as pl
import pytest

from builder.config import load_config
from builder.envs.answer import AnswerCheck
from builder.envs.checks import checks_from_scenario, published_reward, run_checks
from builder.envs.guard import allowed_paths, guard_source
from builder.envs.trainer import scenario_world
from builder.publish.facts import task_count
from builder.publish.publish import export_release
from builder.reports import FamilyFigures, RolloutReport, ScenariosReport, SelectReport, SplitFigures
from builder.sandbox.runtime import Sandbox
from builder.stages.scenarios.family_stats import derive_families
from builder.stats import StageStats, save_stats
from tests.fixtures.scenarios import BANK_CHECKS, BANK_STATE

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from release_store import fill_store  # noqa: E402

REPO, TAG = "local/builder-envs", "v0.1.0"
AUDIT = {
    "nothing": {"pass": 3}, "gold": {"pass": 3}, "collateral": {"pass": 2, "n/a": 1}, "order": {"n/a": 3},
    "spelling": {"pass": 1, "n/a": 2},
}  # fmt: skip


def release(tmp_path: Path, *sets: str, stats: dict[str, StageStats] | None = None) -> tuple[Path, str]:
    """The release folder of the fixture store under `sets` (rl_env_fraction 0.3 unless set) and its card."""
    fill_store(tmp_path / "store")
    config = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'store'))}", "select.rl_env_fraction=0.3",
                                *sets])  # fmt: skip
    stats_path = None
    if stats is not None:
        stats_path = tmp_path / "stats.json"
        save_stats(stats_path, stats)
    out = tmp_path / "release" / "0.1.0"
    export_release(config, "0.1.0", out, stats_path=stats_path)
    return out, (out / "README.md").read_text()


def section(card: str, heading: str) -> str:
    """The text under `heading` up to the next heading of any level."""
    start = card.index(f"\n{heading}\n") + len(heading) + 2
    following = re.search(r"\n#{2,4} ", card[start:])
    return (card[start : start + following.start()] if following else card[start:]).strip()


def blocks(card: str) -> list[str]:
    return re.findall(r"```python\n(.*?)\n```", card, re.DOTALL)


def run_stats(**reports) -> dict[str, StageStats]:
    return {stage: StageStats(stage=stage, inputs=1, kept=1, report=report) for stage, report in reports.items()}


def test_tasks_are_counted_once_across_their_modes():
    verification = [json.dumps({"scenario_group": group}) if group else None for group in ("g1", "g1", "g2", None)]
    frame = pl.DataFrame({"scenario_id": ["s1", "s2", "s3", "s4"], "env_id": ["e1", "e1", "e1", "e2"],
                          "verification": verification})  # fmt: skip
    assert task_count(frame) == 3  # s1 and s2 are one task in two modes; s4 has no group: a task of its own
    # A group is a slot of one environment: the same group in another environment is another task.
    assert task_count(frame.with_columns(pl.Series("env_id", ["e1", "e2", "e1", "e2"]))) == 4


def test_the_card_counts_tasks_and_rows(tmp_path):
    _, card = release(tmp_path)
    expected = "This release holds **6 tasks, 6 rows** of `scenarios` (`train`: 4 tasks, 4 rows; `rl`: 2 tasks, 2 rows)"
    assert expected in card


def test_roles_name_the_synthesis_model_wherever_no_other_is_set(tmp_path):
    _, card = release(tmp_path, "llm.url=http://gpu-node:8000/v1", "llm.served_model_name=Qwen/Qwen3-8B")
    roles = section(card, "### Who wrote, judged and played")
    assert "| wrote the environments and scenarios (plans, code, states, tasks, checks, gold actions) | " \
           "`Qwen/Qwen3-8B` | the synthesis model, `llm.served_model_name` at `llm.url` |" in roles  # fmt: skip
    assert "| judged the environments (evaluate's tester and checker agents) | `Qwen/Qwen3-8B` |" in roles
    assert "| played the user (conversational scenarios) | `Qwen/Qwen3-8B` | the synthesis model |" in roles
    assert "| played the agent in `train` environments (the `sft` trajectories) | `Qwen/Qwen3-8B` |" in roles
    assert "| played the agent in `rl` environments (their `pass_rate`) | `Qwen/Qwen3-8B` | the synthesis " \
           "model: no `rollout.rl_agent_model` |" in roles  # fmt: skip


def test_roles_name_the_user_model_and_the_policy_with_their_rollouts(tmp_path):
    by_model = {"Qwen/Qwen3-8B": {"train": SplitFigures(scenarios=2, rollouts=4, graded=4, solved=4, pass_rate=1.0)},
                "builtin:SmolLM2-135M-Instruct": {"rl": SplitFigures(scenarios=2, rollouts=4, graded=4, solved=1,
                                                                     pass_rate=0.25)}}  # fmt: skip
    _, card = release(
        tmp_path, "llm.url=http://gpu-node:8000/v1", "llm.served_model_name=Qwen/Qwen3-8B",
        "rollout.user_model=user-sim", "rollout.rl_agent_model=builtin:SmolLM2-135M-Instruct",
        stats=run_stats(rollout=RolloutReport(by_model=by_model)),
    )  # fmt: skip
    roles = section(card, "### Who wrote, judged and played")
    assert "| played the user (conversational scenarios) | `user-sim` | `rollout.user_model` |" in roles
    assert "| played the agent in `train` environments (the `sft` trajectories) | `Qwen/Qwen3-8B` |" in roles
    assert "| played the agent in `rl` environments (their `pass_rate`) | `builtin:SmolLM2-135M-Instruct` | " \
           "`rollout.rl_agent_model` |" in roles  # fmt: skip
    assert "| `builtin:SmolLM2-135M-Instruct` | `rl` | 2 | 4 | 4 | 1 | 0.25 |" in roles
    assert "| `Qwen/Qwen3-8B` | `train` | 2 | 4 | 4 | 4 | 1 |" in roles


def test_the_band_is_the_policys_or_the_card_says_none_was_applied(tmp_path):
    _, card = release(tmp_path / "policy", "rollout.rl_agent_model=small-policy", "select.rl_pass_band=[0.1, 0.9]")
    band = section(card, "### The `rl` split and its pass-rate band")
    assert "measured with `small-policy` (`rollout.rl_agent_model`) playing the agent in 2 rollouts each" in band
    assert "strictly inside `select.rl_pass_band` = (0.1, 0.9)" in band and "No pass-rate band" not in band
    assert "`pass_rate` of the `rl` rows: 0.5 in 2 rows." in band

    _, card = release(tmp_path / "teacher")
    band = section(card, "### The `rl` split and its pass-rate band")
    assert band.startswith("**No pass-rate band was applied.** `rollout.rl_agent_model` was not set")
    assert "played by the synthesis model `builtin:SmolLM2-135M-Instruct`" in band
    assert "Measure your policy's pass rates" in band


def test_the_band_as_select_recorded_it_wins_over_the_config(tmp_path):
    recorded = {"applied": True, "band": [0.0, 1.0], "measured_with": "the-run-policy", "reason": ""}
    _, card = release(tmp_path, stats=run_stats(select=SelectReport(rl_band=recorded)))
    assert "measured with `the-run-policy`" in section(card, "### The `rl` split and its pass-rate band")


def test_decontamination_is_reported_plainly_either_way(tmp_path):
    _, card = release(tmp_path / "none")
    assert section(card, "### Decontamination").startswith("**No decontamination ran**: `select.benchmarks` was empty")
    report = {"benchmarks": ["bfcl.jsonl"], "ngram": 8, "threshold": 0.5, "checked": True, "benchmark_texts": 40,
              "environments_checked": 3, "scenarios_checked": 6, "environments_dropped": {},
              "scenarios_dropped": {"scenario-1": "overlaps 0.90 with bfcl.jsonl#3"}}  # fmt: skip
    _, card = release(tmp_path / "checked", stats=run_stats(select=SelectReport(decontamination=report)))
    text = section(card, "### Decontamination")
    assert "with 40 benchmark texts from `bfcl.jsonl` (word 8-grams" in text
    assert "3 environments and 6 scenarios checked, 0 environments and 1 scenarios dropped" in text


def test_the_reward_and_the_audit_are_in_the_card(tmp_path):
    _, card = release(tmp_path / "without")
    assert section(card, "### Reward audit") == (
        "No reward-audit figures for this release: the run's stats were not given to the export."
    )
    _, card = release(tmp_path / "with", stats=run_stats(scenarios=ScenariosReport(audit=AUDIT)))
    audit = section(card, "### Reward audit")
    assert "| `nothing` | no call | 0 | 3 | 0 | 0 |" in audit
    assert "| `collateral` | the gold plus a write to a record the task does not touch | < 1 | 2 | 0 | 1 |" in audit
    assert "| `order` | the gold with two independent calls swapped | 1 | 0 | 0 | 3 |" in audit
    reward = section(card, "## The reward")
    assert "**reward** = 1.0 when solved; **0.0** when the guard fails, when a check that already held" in reward
    assert "So an agent that makes no call scores 0 (except on a `missing_info`" in reward
    grpo = section(card, "### GRPO")
    assert "share of the scenario's checks" not in grpo and "the reward is the published reward" in grpo


def test_the_card_has_a_row_per_task_family_with_how_it_was_made(tmp_path):
    made = {"plain": FamilyFigures(slots=4, verified=3, calls=40, prompt_tokens=90000),
            "infeasible": FamilyFigures(slots=2, verified=1, calls=12, prompt_tokens=20000,
                                        rejected={"not_refused": 1})}  # fmt: skip
    report = ScenariosReport(families=made)
    derive_families(report)
    _, card = release(tmp_path, stats=run_stats(scenarios=report))
    families = section(card, "### Task families")
    # The fixture store's scenarios are all plain (made before families): the made figures come from stats.
    assert re.search(r"\| `plain` \| a fully specified multi-step request \| \d+ tasks?, \d+ rows? \| [\d.–]+ \| 4 \| "
                     r"0\.75 \| 13\.3 \| 30000\.0 \|", families), families
    infeasible = "| `infeasible` | the rules forbid the request: change nothing and say why | 0 tasks, 0 rows | – | 2 "
    assert infeasible + "| 0.5 | 12.0 | 20000.0 |" in families


# --------------------------------------------------------------------------------------- the card's code


def from_folder(folder: Path, monkeypatch) -> list[tuple[str, str | None]]:
    """`load_dataset`, `snapshot_download` and `hf_hub_download` of this repo and tag, answered from the release
    folder; returns the (config, split) reads. A split the release lacks fails as it does on the Hub."""
    load, reads = datasets.load_dataset, []

    def load_dataset(path, name, *, split=None, revision=None):
        if path != str(folder):
            assert (path, revision) == (REPO, TAG)
        reads.append((name, split))
        return load(str(folder), name, split=split, cache_dir=str(folder.parent / "hf-cache"))

    def snapshot_download(repo_id, *, repo_type, revision):
        assert (repo_id, repo_type, revision) == (REPO, "dataset", TAG)
        return str(folder)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return reads


def test_every_data_block_runs_on_its_own_and_the_rl_examples_load_the_rl_split(tmp_path, monkeypatch):
    folder, card = release(tmp_path)
    reads = from_folder(folder, monkeypatch)
    code = blocks(card)
    assert len(code) == 5  # load, pinned load, SFT, GRPO, another trainer
    for block in code:
        if "trainer.train()" not in block:
            exec(compile(block, "card", "exec"), {})  # each on its own: its imports are its own
    assert reads == [("environments", None), ("scenarios", None), ("sft", None), ("sft", "train"),
                     ("scenarios", "rl"), ("environments", "rl")]  # fmt: skip
    assert 'split="rl"' in section(card, "### GRPO") and "> [!NOTE]" not in card


@pytest.mark.parametrize(("fraction", "missing"), [(0, "rl"), (1, "train")])
def test_no_block_loads_a_split_the_release_lacks(tmp_path, monkeypatch, fraction, missing):
    folder, card = release(tmp_path, f"select.rl_env_fraction={fraction}")
    reads = from_folder(folder, monkeypatch)
    for block in blocks(card):
        assert f'split="{missing}"' not in block and (missing != "train" or '"sft"' not in block), block
        if "trainer.train()" not in block:
            exec(compile(block, "card", "exec"), {})
    present = {(c, s) for c, s in reads if s is not None}
    if missing == "rl":  # the RL examples run on the train split, and the card says why
        assert ("scenarios", "train") in present and ("environments", "train") in present
        assert "> [!NOTE]\n> This release has no `rl` split: none of its 3 environments falls into the `rl` " \
               "split at `select.rl_env_fraction` = 0.0" in card  # fmt: skip
        assert "This release has no `rl` scenarios: none of its 3 environments" in card
    else:  # no train environment: no sft rows, no SFT example, and the pinned load takes a split there is
        assert "This release has no `sft` rows" in section(card, "### SFT")
        assert reads[0] == ("environments", None) and ("sft", None) not in reads
        assert "# sft: no rows in this release" in blocks(card)[0]
        assert ("environments", "rl") in present and ("scenarios", "rl") in present


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox() as runtime:
        yield runtime


def test_another_trainers_seed_and_reward_are_builders(tmp_path, monkeypatch, sandbox):
    folder, card = release(tmp_path)
    from_folder(folder, monkeypatch)
    scope: dict = {}
    exec(compile(blocks(section(card, "### Another trainer"))[0], "card", "exec"), scope)
    assert (scope["now"], scope["seed"]) == scenario_world(scope["row"])

    # Its `reward` over the checks' verdicts is the published reward, on the bank scenario with a check that
    # already holds (acc-1 is not frozen) and the collateral guard.
    already = "def check(initial_state, final_state):\n    return not final_state['accounts']['acc-1']['frozen']\n"
    gold = json.loads(json.dumps(BANK_STATE))
    gold["accounts"]["acc-1"]["balance"] -= 300
    gold["accounts"]["acc-2"]["balance"] += 300
    half = json.loads(json.dumps(BANK_STATE))
    half["accounts"]["acc-2"]["balance"] += 300
    collateral = json.loads(json.dumps(gold))
    collateral["accounts"]["acc-3"]["frozen"] = True
    undone = json.loads(json.dumps(half))
    undone["accounts"]["acc-1"]["frozen"] = True
    finals = {"nothing": BANK_STATE, "gold": gold, "half": half, "collateral": collateral, "undone": undone}
    for guarded in (True, False):
        sources = [*BANK_CHECKS, already] + ([guard_source(allowed_paths(BANK_STATE, gold))] if guarded else [])
        checks = checks_from_scenario(sources)
        scope["guard"] = [guarded and i == len(sources) - 1 for i in range(len(sources))]
        before = [r.passed for r in run_checks(sandbox, checks, BANK_STATE, BANK_STATE).checks]
        got, expected = {}, {}
        for name, final in finals.items():
            verdicts = [r.passed for r in run_checks(sandbox, checks, BANK_STATE, final).checks]
            got[name] = scope["reward"](verdicts, before)
            expected[name] = published_reward(sandbox, checks, BANK_STATE, final).reward
        assert got == expected, guarded
        assert got["nothing"] == 0.0 and got["gold"] == 1.0 and got["half"] == 0.5 and got["undone"] == 0.0
        assert got["collateral"] == (0.0 if guarded else 1.0)

    # With answer facts, the answer check counts beside the checks: as builder grades an answer.
    scope["facts"] = ["acc-2", "300"]
    sources = [*BANK_CHECKS, already, guard_source(allowed_paths(BANK_STATE, gold))]
    checks = checks_from_scenario(sources)
    scope["guard"] = [i == len(sources) - 1 for i in range(len(sources))]
    before = [r.passed for r in run_checks(sandbox, checks, BANK_STATE, BANK_STATE).checks]
    for final in (BANK_STATE, gold, half):
        verdicts = [r.passed for r in run_checks(sandbox, checks, BANK_STATE, final).checks]
        for answer in ("", "Moved 300.00 to ACC 2.", "Moved it."):
            expected = published_reward(sandbox, checks, BANK_STATE, final, check=AnswerCheck(tuple(scope["facts"])),
                                        answer=answer, seen="acc-2: 300")  # fmt: skip
            assert scope["reward"](verdicts, before, expected.answered) == expected.reward
