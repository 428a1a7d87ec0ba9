import json
import os
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from builder.cli import main


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "builder", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize("command", [[], ["run"], ["stats"], ["config"]])
def test_help_on_everything(command, capsys):
    with pytest.raises(SystemExit) as exit_:
        main([*command, "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m builder" in out
    if command == ["run"]:
        for option in ("--config", "--set", "--run-dir", "--until", "--only"):
            assert option in out


def test_run_on_defaults_then_resume_and_stats(tmp_path):
    first = run_cli("run", "--until", "collect", cwd=tmp_path)  # the model stages run in the integration test
    assert first.returncode == 0, first.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert run_dir.name.startswith("run-")
    assert {"collect.parquet", "run.json", "stats.json", "config.json", "builder.log"} <= {
        p.name for p in run_dir.iterdir()
    }
    assert pl.read_parquet(run_dir / "collect.parquet").height >= 25  # mine.max_seeds = 32 by default, minus drops
    assert "collect" in first.stdout and "kept" in first.stdout

    again = run_cli("run", "--until", "collect", cwd=tmp_path)  # same config → same folder, resumed
    assert again.returncode == 0
    assert [p.name for p in (tmp_path / "runs").iterdir()] == [run_dir.name]

    table = run_cli("stats", str(run_dir), cwd=tmp_path)
    assert table.returncode == 0 and "collect" in table.stdout
    raw = run_cli("stats", str(run_dir), "--json", cwd=tmp_path)
    assert json.loads(raw.stdout)["stages"]["collect"]["kept"] >= 25


def test_usage_errors_exit_2(tmp_path):
    bad_key = run_cli("run", "--set", "llm.modle=x", cwd=tmp_path)
    assert bad_key.returncode == 2
    assert "llm.modle: unknown key" in bad_key.stderr
    assert "Traceback" not in bad_key.stderr
    assert run_cli("run", "--until", "nope", cwd=tmp_path).returncode == 2
    assert run_cli("frobnicate", cwd=tmp_path).returncode == 2
    missing = run_cli("run", "--config", "missing.toml", cwd=tmp_path)
    assert missing.returncode == 2 and "does not exist" in missing.stderr


def test_failures_exit_1(tmp_path):
    not_a_run = run_cli("stats", str(tmp_path), cwd=tmp_path)
    assert not_a_run.returncode == 1 and "no stats.json" in not_a_run.stderr
    run_dir = tmp_path / "r"
    assert run_cli("run", "--run-dir", str(run_dir), "--until", "collect", cwd=tmp_path).returncode == 0
    other = run_cli("run", "--run-dir", str(run_dir), "--set", "llm.temperature=0.2", cwd=tmp_path)
    assert other.returncode == 1 and "was made with config" in other.stderr


def test_bad_seed_file_is_a_clear_error(tmp_path):
    seeds = tmp_path / "seeds.jsonl"
    seeds.write_text('{"text": "book a room"}\n')
    result = run_cli("run", "--set", f"mine.seeds={seeds}", cwd=tmp_path)
    assert result.returncode == 2
    assert "mine.request_field = 'request'" in result.stderr and "text" in result.stderr
    fixed = run_cli(
        "run", "--set", f"mine.seeds={seeds}", "--set", "mine.request_field=text", "--until", "collect", cwd=tmp_path
    )
    assert fixed.returncode == 0, fixed.stderr


def test_config_prints_valid_toml_with_hash(tmp_path):
    result = run_cli("config", "--set", "mine.max_topics=9", cwd=tmp_path)
    assert result.returncode == 0
    assert "config hash" in result.stdout and "max_topics = 9" in result.stdout
    (tmp_path / "c.toml").write_text(result.stdout)
    assert run_cli("config", "--config", "c.toml", cwd=tmp_path).stdout == result.stdout


def test_closed_pipe_is_not_a_crash(monkeypatch, capsys):
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone, as after `| head` exits
    with os.fdopen(write_end, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert main(["config"]) == 0
        monkeypatch.undo()
    assert "Traceback" not in capsys.readouterr().err
