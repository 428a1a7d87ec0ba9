"""Every ```python block of a generated card runs as written against a real local Hub release.

Each release comes from `python -m builder run` with the scripted teacher (tests/fixtures/teacher.py), is
published with `python -m builder publish --run-dir` (the run's own config and stats, as a user would), served
by olah, and each block of its card runs in a fresh interpreter with `HF_ENDPOINT` pointing at the Hub, on its
own: a block that leans on another block's imports fails. The swaps are those of the trainer tests and nothing
else: `MODEL` names a 2-layer copy of the embedded SmolLM2 (the card names a Hub id this machine cannot
download), the SFT trainer takes one step, and the GRPO block runs with its CI budgets, the simulated user on a
stub server and a scripted `generate` (tests/integration/test_trl_grpo.py). Two releases:

- `strong_teacher`: no `rollout.rl_agent_model`, and the teacher solves every rollout (pass rate 1.0), so before
  the band stopped applying to the synthesis model's pass rates this release had no `rl` split and the card's
  GRPO and "Another trainer" code failed with `Unknown split "rl"`;
- `no_rl_environment`: `select.rl_env_fraction = 0`, so no environment is held out and the release cannot have
  an `rl` split: the card's RL code runs on the `train` split and says so.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.cli import main
from builder.llm import ChatRequest, ScriptedModel
from builder.publish.server import LocalHub
from tests.fixtures.e2e_release import user_reply
from tests.fixtures.teacher import teacher
from tests.integration.test_trl_grpo import PRELUDE, TRAIN
from tests.llm_stub import StubServer, completion
from tests.test_pipeline_e2e import run
from tests.test_trainer_grpo import runnable_grpo_block, small_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

ROOT = Path(__file__).parents[2]
OPTIONS = {"strong_teacher": (), "no_rl_environment": ("--set", "select.rl_env_fraction=0")}


def strong_teacher(request: ChatRequest):
    """The teacher, but its agent solves every sample (the fixture's sample 1 gets the due date wrong)."""
    if request.tools and request.tool_choice in ("auto", "required", "none", None):
        request = request.model_copy(update={"sample_index": 0})
    return teacher(request)


def published(root: Path, kind: str) -> Path:
    """Run the pipeline in `root` and publish its candidate with the run's own config; returns the run folder."""
    log = logging.getLogger("builder")
    handlers, level = list(log.handlers), log.level
    try:
        with pytest.MonkeyPatch.context() as patch:
            scripted = ScriptedModel(strong_teacher)
            patch.setattr("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: scripted)
            assert run(root, "main", *OPTIONS[kind]) == 0
        run_dir = root / "main" / "run"
        assert main(["publish", "--version", "0.1.0", "--run-dir", str(run_dir)]) == 0
    finally:  # `main` adds console and run-log handlers to the `builder` logger
        for handler in [h for h in log.handlers if h not in handlers]:
            log.removeHandler(handler)
            handler.close()
        log.setLevel(level)
    return run_dir


def runnable(block: str, model_dir: str, user_url: str, output_dir: Path) -> str:
    """The block with the trainer tests' swaps: the model, one SFT step, the GRPO step's budgets and policy."""
    if "GRPOTrainer(" in block:
        swapped = runnable_grpo_block(f"### GRPO\n```python\n{block}\n```", model_dir, user_url)  # it reads a card
        return PRELUDE.format(output_dir=str(output_dir)) + swapped + TRAIN
    if "SFTTrainer(" in block:
        line = next(line for line in block.splitlines() if line.startswith("MODEL = "))
        block = block.replace(line, f"MODEL = {json.dumps(model_dir)}")
        one_step = "trainer.args.max_steps = 1\ntrainer.train()\nprint('SFT STEPS', trainer.state.global_step)"
        return block.replace("trainer.train()", one_step)
    assert "MODEL" not in block and "train()" not in block, block
    return block


@pytest.mark.parametrize("kind", list(OPTIONS))
def test_every_block_of_the_card_runs_against_the_local_hub(kind, tmp_path):
    run_dir = published(tmp_path, kind)
    release = run_dir / "release" / "0.1.0"
    card = (release / "README.md").read_text()
    counts = json.loads((release / "release.json").read_text())["counts"]
    if kind == "strong_teacher":
        # Rollouts in the rl environment were all solved by the synthesis model: the rows are there, with their
        # measured pass rate, and the card says no band was applied.
        assert counts["scenarios/rl"] == 2 and counts["environments/rl"] == 1
        assert "**No pass-rate band was applied.**" in card
        assert "`pass_rate` of the `rl` rows: 1 in 2 rows." in card
        assert "This release holds **2 tasks, 4 rows** of `scenarios` (`train`: 1 task, 2 rows; `rl`: 1 task, " \
               "2 rows)" in card  # fmt: skip
    else:
        assert counts["scenarios/rl"] == counts["environments/rl"] == 0
        assert "> This release has no `rl` split: none of its 2 environments falls into the `rl` split" in card
    assert 'split="rl"' not in card if kind == "no_rl_environment" else 'split="rl"' in card
    # The run's reward audit, from its stats: one slot per environment (both modes share it).
    assert "| `nothing` | no call | 0 | 2 | 0 | 0 |" in card and "| `gold` | the gold actions | 1 | 2 | 0 | 0 |" in card
    assert "**No decontamination ran**" in card

    blocks = re.findall(r"```python\n(.*?)\n```", card, re.DOTALL)
    assert len(blocks) == 5  # load, pinned load, SFT, GRPO, another trainer
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1", "PYTHONPATH": str(ROOT)}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    model_dir = small_model(tmp_path / "model")
    config = json.loads((run_dir / "config.json").read_text())
    with (
        StubServer(lambda body: (200, completion(user_reply(body["messages"])))) as user,
        LocalHub(Path(config["hub"]["root"])) as hub,
    ):
        outputs = []
        for index, block in enumerate(blocks):
            work = tmp_path / f"block-{index}"
            work.mkdir()
            started = time.monotonic()
            result = subprocess.run(
                [sys.executable, "-c", runnable(block, model_dir, user.url, tmp_path / f"out-{index}")],
                env={**env, "HF_ENDPOINT": hub.url}, cwd=work, capture_output=True, text=True, timeout=800,
            )  # fmt: skip
            print(f"{kind} block {index}: {time.monotonic() - started:.1f} s")
            assert result.returncode == 0, (block, result.stderr[-4000:])
            outputs.append(result.stdout)
    assert "SFT STEPS 1" in outputs[2]
    report = json.loads(next(line for line in outputs[3].splitlines() if line.startswith("REPORT "))[7:])
    assert report["steps"] == 1 and set(report["modes"]) == {"conversational", "non_conversational"}
    assert re.search(r"^scenario-[0-9a-f]{16} at \S+ seed \d+$", outputs[4].strip(), re.MULTILINE)
