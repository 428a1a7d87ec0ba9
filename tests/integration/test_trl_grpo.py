"""One real GRPO step with TRL on a release from `python -m builder run`, running the code its card shows against
a real local Hub.

As tests/integration/test_trl_sft.py does for SFT: the pipeline runs with the scripted teacher, the release is
published to the local Hub and served by olah, and the GRPO block of the published card runs in a fresh
interpreter with `HF_ENDPOINT` pointing at it. The swaps are those of tests/test_trainer_grpo.py (which runs the
same block in process, with the Hub reads answered from the release folder): `MODEL` names a 2-layer copy of the
embedded SmolLM2, the simulated user's endpoint is a stub server of this process, `GRPOConfig` gets CI budgets
and `trainer.train()` runs under the scripted `generate`. Then: both modes' rollouts ran their tool calls in the
sandbox and were graded, and the step took place.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builder.publish.server import LocalHub
from tests.fixtures.e2e_release import user_reply
from tests.integration.test_trl_sft import release  # noqa: F401 (fixture)
from tests.llm_stub import StubServer, completion
from tests.test_pipeline_e2e import model  # noqa: F401 (a fixture)
from tests.test_trainer_grpo import runnable_grpo_block, small_model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# Before the card's code: the CI budgets over its GRPOConfig (trl's attribute, which the card imports).
PRELUDE = """
import trl as _trl
from tests.test_trainer_grpo import budget_config as _budget_config
_trl.GRPOConfig = _budget_config({output_dir!r})
"""
# After it: the step under the scripted policy, then what every rollout's environment holds.
TRAIN = """
import json as _json
from unittest.mock import patch as _patch
from tests.test_trainer_grpo import scripted_generate as _scripted_generate
with _patch.object(trainer.model, "generate", side_effect=_scripted_generate(tokenizer)):
    trainer.train()
_episodes = [{"class": type(env).__name__,
              "reward": None if getattr(env._conversation, "void", False) else env._live.reward(),
              "end": getattr(env._conversation, "end_reason", None)} for env in trainer.environments]
print("REPORT " + _json.dumps({"steps": trainer.state.global_step, "modes": sorted(rl["mode"]),
                               "episodes": _episodes, "logs": trainer.state.log_history[0]}))
"""


def test_the_cards_grpo_code_takes_one_step_over_the_hub(release, tmp_path):  # noqa: F811
    folder, config = release
    card = (folder / "README.md").read_text()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "TRL_EXPERIMENTAL_SILENCE": "1",
           "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    work = tmp_path / "trainer"
    work.mkdir()
    model_dir = small_model(tmp_path / "model")
    with (
        StubServer(lambda body: (200, completion(user_reply(body["messages"])))) as user,
        LocalHub(config.hub.root) as hub,
    ):
        script = PRELUDE.format(output_dir=str(tmp_path / "out")) + runnable_grpo_block(card, model_dir, user.url)
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", script + TRAIN], env={**env, "HF_ENDPOINT": hub.url}, cwd=work,
            capture_output=True, text=True, timeout=800,
        )  # fmt: skip
        print(f"card GRPO code: {time.monotonic() - started:.1f} s")
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    assert report["steps"] == 1
    assert set(report["modes"]) == {"conversational", "non_conversational"}
    by_class: dict[str, list] = {}
    for episode in report["episodes"]:
        by_class.setdefault(episode["class"], []).append(episode)
    assert len(by_class) == 2  # one class per mode, each played by both rollouts of its group
    for episodes in by_class.values():
        assert sorted(e["reward"] for e in episodes) == [0.5, 1.0]  # the checks graded the sandboxed calls
    talks = next(episodes for name, episodes in by_class.items() if name.endswith("Conversational"))
    assert [e["end"] for e in talks] == ["user_stop", "user_stop"] and len(user.requests) == 2 * 3
    assert report["logs"]["tools/failure_frequency"] == 0.0 and report["logs"]["tools/call_frequency"] == 4.0
