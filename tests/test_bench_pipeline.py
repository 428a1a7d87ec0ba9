"""`bench pipeline` runs the whole pipeline, collect to export, over a few scripted environments and prints the
figures the issue asks for (timing targets are checked in the docs, not here: the machines are shared)."""

import json

import pytest

from builder.bench_pipeline import GPUS, LATENCY_SCALE, render, seed_requests
from builder.bench_teacher import teacher
from builder.cli import main
from builder.errors import RunError
from builder.llm import ChatRequest
from builder.pipeline import STAGES
from builder.records import ChatMessage


def test_two_environments_collect_to_export(tmp_path, capsys, restore_logging):
    code = main(["bench", "pipeline", "--envs", "2", "--json", "--profile", "none",
                 "--set", f"run.runs_root={tmp_path}", "--set", "evaluate.calls=8"])  # fmt: skip
    assert code == 0
    figures = json.loads(capsys.readouterr().out)

    # Every environment accepted, one scenario per mode, two rollouts of each: the scripted model is complete.
    assert (figures["envs"], figures["accepted_envs"], figures["scenarios"], figures["trajectories"]) == (2, 2, 4, 8)
    assert figures["release_version"] == "0.1.0"
    assert list(figures["stage_s_per_env"]) == [stage.name for stage in STAGES] + ["export"]
    assert all(seconds >= 0 for seconds in figures["stage_s_per_env"].values())
    assert figures["stage_s_per_env"]["evaluate"] > 0 and figures["stage_s_per_env"]["export"] > 0
    # The model's time is modeled and slept scaled down; the rest of the wall time is builder's own.
    assert figures["latency_scale"] == LATENCY_SCALE
    assert figures["model_s_slept"] == pytest.approx(figures["model_s_modeled"] * LATENCY_SCALE, abs=0.06)
    assert 0 < figures["non_model_s_per_env"] * 2 <= figures["wall_s"]
    assert figures["peak_rss_mb"]["builder"] > 50 and figures["peak_rss_mb"]["largest_child"] > 0
    assert figures["store_bytes"] > 10_000 and figures["release_bytes"] > 10_000

    tokens, projection = figures["tokens_per_env"], figures["projection"]
    assert tokens["prompt"] > tokens["completion"] > 0 and 0 < tokens["prefix_reuse"] < 1
    assert projection["gpus"] == GPUS and projection["gpu_s_per_env"] > 0
    assert projection["envs_per_day"] == pytest.approx(GPUS * 86_400 / projection["gpu_s_per_env"], rel=0.01)
    assert projection["scenarios_per_day"] == pytest.approx(2 * projection["envs_per_day"], abs=1)
    assert "https://" in projection["throughput_source"]
    # At a capable model's recorded tokens (hundreds of thousands per environment) a GPU does far fewer.
    capable = figures["projection_capable_model"]
    assert capable["gpu_s_per_env"] > 5 * projection["gpu_s_per_env"]
    assert capable["envs_per_day"] < projection["envs_per_day"] and "teacher-4" in capable["tokens_source"]
    assert (tmp_path / "bench-pipeline-2" / "run" / "builder.log").stat().st_size > 0

    text = render(figures)
    assert "non-model seconds per environment" in text and "  evaluate " in text and "  export " in text
    assert "environments and" in text and "scenarios a day" in text and "at a capable model's tokens" in text


def test_envs_must_be_at_least_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "pipeline", "--envs", "0"])
    assert exit_.value.code == 2 and "needs at least 1" in capsys.readouterr().err


def test_seed_requests_are_distinct_and_name_their_desk():
    seeds = seed_requests(250)
    assert len(set(seeds)) == 250
    assert all(f"lending desk number {i}," in seed for i, seed in enumerate(seeds))


def test_an_unknown_request_is_an_error_not_a_made_up_reply():
    request = ChatRequest(
        messages=(ChatMessage(role="system", content="Summarise."), ChatMessage(role="user", content="x"))
    )
    with pytest.raises(RunError, match="no answer"):
        teacher(request)
    structured = request.model_copy(
        update={"response_format": {"type": "json_schema", "json_schema": {"name": "Unheard", "schema": {}}}}
    )
    with pytest.raises(RunError, match="Unheard"):
        teacher(structured)
