"""The Ray executor against a real local Ray cluster: `ray start --head --num-cpus 2` on free ports, in its own
process group and temp folder, stopped (that group only) after the module.

The toy pipeline of tests/fixtures/ray_toy.py runs in-process (an actor killed mid-stage, an input that kills every
actor it lands on, an operator error in an actor) and as a script whose driver is killed; the whole pipeline runs
through `python -m builder run --executor ray` with the scripted teacher in every Ray worker
(tests/fixtures/ray_teacher.py), and must give the tables and store of the local executor.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from pathlib import Path

import polars as pl
import pytest

from builder.config import BuildConfig
from builder.errors import ConfigError, RunError
from builder.run.executor import run_stages
from builder.run.ray_executor import RayItems
from tests.fixtures.ray_toy import STAGES, no_resources, toy_config
from tests.test_pipeline_e2e import model, run, run_outputs  # noqa: F401 - model: a fixture

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]
TOY_ENV = {"TOY_ITEMS": "24", "TOY_DELAY": "0.2"}
TEACHER = "tests.fixtures.ray_teacher.install"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """The address of a local Ray cluster whose workers import this worktree's builder and tests."""
    temp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))  # short: Ray's socket paths must fit 107 bytes
    port = _free_port()
    # Token authentication on, with a token of its own that this process (and its drivers) are given: whatever
    # ~/.ray holds, the cluster and its drivers agree.
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": uuid.uuid4().hex}
    saved = {key: os.environ.get(key) for key in auth}
    os.environ.update(auth)
    _reload_ray_config()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    command = [
        str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", "--num-cpus", "2",
        "--node-ip-address", "127.0.0.1", "--port", str(port), "--ray-client-server-port", str(_free_port()),
        "--include-dashboard", "false", "--disable-usage-stats", "--temp-dir", str(temp),
    ]  # fmt: skip
    log = (temp / "start.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (temp / "start.log").read_text():
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"ray start failed:\n{(temp / 'start.log').read_text()[-3000:]}")
            time.sleep(0.5)
        yield address
    finally:
        _restore(saved)
        _reload_ray_config()
        for signum, wait_s in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(process.pid, signum)
                process.wait(wait_s)
                break
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture
def toy_env(monkeypatch):
    for key, value in TOY_ENV.items():
        monkeypatch.setenv(key, value)


@pytest.fixture(scope="module")
def local_tables(tmp_path_factory) -> dict[str, pl.DataFrame]:
    """The toy pipeline's tables under the local executor."""
    run_dir = tmp_path_factory.mktemp("local") / "run"
    saved = {key: os.environ.get(key) for key in TOY_ENV}
    os.environ.update(TOY_ENV)
    try:
        asyncio.run(run_stages(STAGES, BuildConfig(), run_dir))
    finally:
        _restore(saved)
    return tables(run_dir)


def _reload_ray_config() -> None:
    """Ray reads RAY_AUTH_MODE when it is imported (here: at collection); make this process see the change."""
    from ray._raylet import Config

    Config.initialize("")


def _restore(saved: dict[str, str | None]) -> None:
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def tables(run_dir: Path) -> dict[str, pl.DataFrame]:
    return {path.name: pl.read_parquet(path) for path in sorted(run_dir.glob("*.parquet"))}


def journaled(run_dir: Path, stage: str = "topics") -> Counter[str]:
    """How often each input appears in the stage's journal."""
    lines = (run_dir / f"{stage}.journal.jsonl").read_text().splitlines()
    return Counter(json.loads(line)["input"] for line in lines)


def assert_same(found: dict[str, pl.DataFrame], expected: dict[str, pl.DataFrame]) -> None:
    assert list(found) == list(expected)
    for name, frame in expected.items():
        assert found[name].equals(frame), name


async def test_ray_gives_the_local_tables_and_says_where_time_went(ray_cluster, toy_env, local_tables, tmp_path):
    config = toy_config(ray_cluster, actors=2)
    with RayItems(config, tmp_path / "run", no_resources) as items:
        stats = await run_stages(STAGES, config, tmp_path / "run", items=items)
    assert_same(tables(tmp_path / "run"), local_tables)
    assert set(journaled(tmp_path / "run").values()) == {1} and len(journaled(tmp_path / "run")) == 24
    topics = stats["topics"]
    assert (topics.inputs, topics.kept, dict(topics.dropped)) == (24, 18, {"too_round": 5, "exception:ValueError": 1})
    # Model calls made in the actors are counted on the driver, once each; counters of the report are summed, and
    # the stage's derived figure is derived from the sums (5 round numbers in 0..23), as under local.
    assert topics.usage.calls == 24 and topics.usage.prompt_tokens == 240
    assert topics.report.to_json() == {
        "prompt_shrunk": {},
        "toy": {"items": 24, "round": 5, "round_share": 0.2083},
        "share": None,
    }
    figures = topics.executor
    assert figures["kind"] == "ray" and figures["items"] == 24 and set(figures["actors"]) == {"actor-1", "actor-2"}
    assert sum(actor["items"] for actor in figures["actors"].values()) == 24
    for actor in figures["actors"].values():
        assert actor["items_per_s"] > 0 and actor["report"]["share"] == 0.5
        assert {"node", "active_s", "model_wait_s", "sandbox_s"} <= set(actor)
    assert figures["driver_s"] > 0 and figures["driver_s_per_item"] > 0
    assert json.loads((tmp_path / "run" / "stats.json").read_text())["stages"]["topics"]["executor"] == figures


async def test_an_actor_killed_mid_stage_is_replaced_and_nothing_is_lost_or_doubled(
    ray_cluster, toy_env, local_tables, tmp_path
):
    config = toy_config(ray_cluster, actors=2)
    journal = tmp_path / "run" / "topics.journal.jsonl"
    with RayItems(config, tmp_path / "run", no_resources) as items:

        async def kill_one_actor() -> None:
            while not journal.exists() or len(journal.read_text().splitlines()) < 4:
                await asyncio.sleep(0.02)
            ray.kill(items.actors["actor-1"])

        killer = asyncio.ensure_future(kill_one_actor())
        stats = await run_stages(STAGES, config, tmp_path / "run", items=items)
        await killer
    assert_same(tables(tmp_path / "run"), local_tables)
    assert set(journaled(tmp_path / "run").values()) == {1} and len(journaled(tmp_path / "run")) == 24
    actors = stats["topics"].executor["actors"]
    assert "actor-3" in actors and actors["actor-3"]["items"] > 0  # actor-1 may have died before it answered
    assert stats["topics"].kept == 18


def test_a_rerun_resumes_after_the_driver_is_killed(ray_cluster, local_tables, tmp_path):
    env = {
        **os.environ,
        **TOY_ENV,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "tests.fixtures.ray_toy", str(tmp_path / "run"), "ray", ray_cluster]
    journal = tmp_path / "run" / "topics.journal.jsonl"
    driver = subprocess.Popen(command, env=env, cwd=ROOT, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not journal.exists() or len(journal.read_text().splitlines()) < 4:
        assert driver.poll() is None and time.monotonic() < deadline, "the driver ended before it was killed"
        time.sleep(0.02)
    driver.kill()
    driver.wait()
    assert len(journaled(tmp_path / "run")) < 24
    finished = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert finished.returncode == 0, finished.stderr[-3000:]
    assert_same(tables(tmp_path / "run"), local_tables)
    assert set(journaled(tmp_path / "run").values()) == {1} and len(journaled(tmp_path / "run")) == 24
    stats = json.loads((tmp_path / "run" / "stats.json").read_text())["stages"]["topics"]
    assert stats["resumed"] >= 4 and stats["executor"]["items"] == 24 - stats["resumed"]


async def test_an_input_that_kills_every_actor_stops_the_run_naming_it(ray_cluster, toy_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_DIES", "3")
    config = toy_config(ray_cluster, actors=2, max_item_losses=2)
    with RayItems(config, tmp_path / "run", no_resources) as items, pytest.raises(RunError) as stopped:
        await run_stages(STAGES, config, tmp_path / "run", items=items)
    seeds = {row["request"]: row["id"] for line in (tmp_path / "run" / "seeds.journal.jsonl").read_text().splitlines()
             for row in json.loads(line)["kept"]}  # fmt: skip
    assert f"input {seeds['request 3 dies']} killed 2 Ray actors it ran on alone" in str(stopped.value)
    # The inputs that were in flight beside it were done again (alone) and journaled once; it never was.
    done = journaled(tmp_path / "run")
    assert seeds["request 3 dies"] not in done and set(done.values()) == {1}


async def test_an_operator_error_in_an_actor_is_raised_as_itself(ray_cluster, toy_env, monkeypatch, tmp_path):
    monkeypatch.setenv("TOY_MISCONFIGURED", "3")
    config = toy_config(ray_cluster, actors=1)
    with RayItems(config, tmp_path / "run", no_resources) as items, pytest.raises(RunError, match="store is locked"):
        await run_stages(STAGES, config, tmp_path / "run", items=items)


def test_counters_of_the_actors_reports_are_summed_and_derived_figures_left_out():
    from builder.reports import MethodFigures, ScenariosReport, merge_reports

    one = ScenariosReport(verified_slots=1, prompt_shrunk={"a": 1}, per_verified_slot={"calls": 3.0})
    one.methods["graph"] = MethodFigures(slots=2, verified=1, chains_dropped={"no_chain": 2}, yield_=0.5)
    two = ScenariosReport(verified_slots=2, prompt_shrunk={"a": 1, "b": 1})
    two.methods["graph"] = MethodFigures(slots=2, verified=2, chains_dropped={"call_failed": 1})
    merged = merge_reports(ScenariosReport, [one, two, ScenariosReport()])
    assert (merged.verified_slots, merged.prompt_shrunk, merged.per_verified_slot) == (3, {"a": 2, "b": 1}, None)
    graph = merged.methods["graph"]
    assert (graph.slots, graph.verified, graph.chains_dropped) == (4, 3, {"no_chain": 2, "call_failed": 1})
    assert graph.yield_ is None  # derived: the stage's `derive` fills it from the sums


def test_config_refuses_two_ways_to_count_actors():
    with pytest.raises(ValueError, match="executor.actors or executor.actors_per_node"):
        toy_config(actors=2, actors_per_node=1)


async def test_the_pipeline_on_ray_needs_model_servers_the_actors_reach(tmp_path):
    from builder.pipeline import run_pipeline

    with pytest.raises(ConfigError, match="set llm.url or llm.urls"):
        await run_pipeline(toy_config(), tmp_path / "run")
    config = toy_config().model_copy(update={"llm": toy_config().llm.model_copy(update={"url": "http://x/v1"})})
    rl = config.rollout.model_copy(update={"rl_agent_model": "some/policy"})
    with pytest.raises(ConfigError, match="rollout.rl_agent_url"):
        await run_pipeline(config.model_copy(update={"rollout": rl}), tmp_path / "run")


@pytest.mark.usefixtures("model", "restore_logging")
def test_the_whole_pipeline_on_ray_ends_as_it_does_locally(ray_cluster, tmp_path):
    assert run(tmp_path, "local") == 0
    ray_options = ["--executor", "ray", "--ray-address", ray_cluster, "--set", f"executor.worker_setup={TEACHER}"]
    assert run(tmp_path, "ray", *ray_options) == 0
    assert_same(run_outputs(tmp_path / "ray"), run_outputs(tmp_path / "local"))
    stats = json.loads((tmp_path / "ray" / "run" / "stats.json").read_text())["stages"]
    for name in ("mine", "plan", "code", "evaluate", "scenarios", "rollout"):
        assert stats[name]["executor"]["kind"] == "ray" and stats[name]["usage"]["calls"] > 0, name
    assert stats["evaluate"]["executor"]["items"] == 2
    assert sum(actor["sandbox_s"] for actor in stats["evaluate"]["executor"]["actors"].values()) > 0
    assert "executor" not in stats["dedupe"] or not stats["dedupe"]["executor"]  # batch stages run on the driver


def test_bench_scale_prints_its_figures(ray_cluster, tmp_path, capsys):
    from builder.cli import main

    argv = ["bench", "scale", "--json", "--profile", "none", "--items", "12", "--latency-ms", "5"]
    assert main([*argv, "--ray-address", ray_cluster, "--set", f"run.runs_root={tmp_path}"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["cpus"] == len(os.sched_getaffinity(0)) >= 2 and figures["target_ratio"] == 1.7
    for mode in ("per_core", "machine"):
        entry = figures[mode]
        assert {"local", "ray_1_actor", "ray_2_actors", "ratio_2_actors_vs_local", "ratio_2_vs_1_actor"} <= set(entry)
        assert set(entry["ray_2_actors"]["actors"]) == {"actor-1", "actor-2"}
        assert entry["ray_1_actor"]["driver_s_per_item"] > 0 and entry["local"]["items_per_s"] > 0
    # Pinned, each actor's process (with its sandbox) claimed a core of its own.
    claimed = sorted(path.name for path in (tmp_path / "bench-scale/per-core/ray_2_actors/cores").iterdir())
    assert claimed == ["core-0", "core-1"] or len(set(claimed)) == 2
