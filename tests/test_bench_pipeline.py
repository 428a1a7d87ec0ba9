"""`bench pipeline` runs the whole pipeline, collect to export, over a few scripted environments and prints the
figures the issue asks for (timing targets are checked in the docs, not here: the machines are shared)."""

import json

import pytest

from builder.bench_pipeline import GPUS, LATENCY_SCALE, compare, render, render_sizes, seed_requests
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
    assert figures["peak_rss_mb_per_env"] == pytest.approx(figures["peak_rss_mb"]["builder"] / 2, abs=0.05)
    # CPU seconds of builder and its sandbox workers, per stage: evaluate's sandbox work shows, and the stages'
    # CPU adds up to no more than the whole run's.
    cpu = figures["stage_cpu_s_per_env"]
    assert list(cpu) == list(figures["stage_s_per_env"]) and all(seconds >= 0 for seconds in cpu.values())
    assert cpu["evaluate"] > 0.05 and cpu["export"] > 0
    assert sum(cpu.values()) <= figures["cpu_s_per_env"] + 0.01
    assert figures["cpu_s"] == pytest.approx(figures["cpu_s_per_env"] * 2, abs=0.01)
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
    assert capable["envs_per_day"] < projection["envs_per_day"] and "teacher-13" in capable["tokens_source"]
    assert (tmp_path / "bench-pipeline-2" / "run" / "builder.log").stat().st_size > 0

    text = render(figures)
    assert "non-model seconds per environment" in text and "  evaluate " in text and "  export " in text
    assert "CPU (builder and its sandbox workers)" in text and "MB per environment" in text
    assert "environments and" in text and "scenarios a day" in text and "at a capable model's tokens" in text


@pytest.mark.parametrize(
    ("envs", "message"),
    [("0", "needs at least 1"), ("10,0", "needs at least 1"), ("ten", "whole numbers"), ("10,,20", "whole numbers")],
)
def test_envs_must_be_whole_numbers_of_at_least_one(capsys, envs, message):
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "pipeline", "--envs", envs])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_two_sizes_each_in_its_own_process_compared_with_the_first(tmp_path, capsys, restore_logging):
    code = main(["bench", "pipeline", "--envs", "1,2", "--json", "--profile", "none", "--latency-scale", "0.0005",
                 "--set", f"run.runs_root={tmp_path}", "--set", "evaluate.calls=8"])  # fmt: skip
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    small, big = result["sizes"]
    # Each size ran with this invocation's options (its own folder, the latency scale, the --set).
    assert (small["envs"], small["accepted_envs"], big["envs"], big["accepted_envs"]) == (1, 1, 2, 2)
    assert small["latency_scale"] == big["latency_scale"] == 0.0005
    assert (tmp_path / "bench-pipeline-1" / "run" / "stats.json").exists()
    assert (tmp_path / "bench-pipeline-2" / "run" / "stats.json").exists()
    (row,) = result["compared"]
    assert (row["envs"], row["baseline_envs"]) == (2, 1)
    assert row["cpu_s_per_env_ratio"] == pytest.approx(big["cpu_s_per_env"] / small["cpu_s_per_env"], abs=0.001)
    assert list(row["stage_cpu_ratio"]) == list(big["stage_cpu_s_per_env"])


def _figures(envs: int, cpu: float, wall: float, peak_mb: float, evaluate: float, select: float) -> dict:
    return {"envs": envs, "cpu_s_per_env": cpu, "non_model_s_per_env": wall, "peak_rss_mb": {"builder": peak_mb},
            "stage_cpu_s_per_env": {"evaluate": evaluate, "select": select}}  # fmt: skip


def test_compare_gives_each_size_its_cost_per_environment_against_the_first():
    base = _figures(100, cpu=1.0, wall=1.2, peak_mb=900, evaluate=0.8, select=0.0)
    rows = compare([base, _figures(1000, 1.15, 1.5, 2250, 0.9, 0.001), _figures(100, 1.0, 1.2, 900, 0.8, 0.0)])
    assert rows[0] == {
        "envs": 1000, "baseline_envs": 100, "cpu_s_per_env_ratio": 1.15, "non_model_s_per_env_ratio": 1.25,
        "stage_cpu_ratio": {"evaluate": 1.125, "select": None},  # no ratio to a stage that took nothing
        "peak_mb_per_extra_env": 1.5,
    }  # fmt: skip
    assert rows[1]["peak_mb_per_extra_env"] is None  # the same size again adds no environment
    text = render_sizes([], rows[:1])
    assert "1000 against 100 environments" in text and "CPU 1.15x" in text and "1.50 MB per extra environment" in text
    assert "select -" in text


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
