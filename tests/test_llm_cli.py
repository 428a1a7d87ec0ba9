"""CLI wiring of the model layer: `bench llm --json` against a stub server, `--llm-url`, `serve --help`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from llm_stub import StubServer, completion

from builder.cli import main


def test_bench_llm_json_against_external_url(tmp_path: Path, capsys, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    with StubServer(lambda body: (200, completion("1", completion_tokens=body["max_tokens"]))) as stub:
        code = main(["bench", "llm", "--json", "--llm-url", stub.url, "--requests", "4"])
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"server_tok_s", "client_tok_s", "ratio", "overhead_p50_ms", "overhead_p99_ms"}
    assert data["server_tok_s"] > 0 and data["ratio"] > 0


def test_serve_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--help"])
    assert exit_.value.code == 0
    assert "--llm-url" in capsys.readouterr().out


def test_serve_wrong_model_path_is_a_clear_error(tmp_path: Path, capsys) -> None:
    code = main(["serve", "--set", f"llm.model={tmp_path / 'missing'}", "--run-dir", str(tmp_path)])
    assert code == 1
    assert "missing does not exist" in capsys.readouterr().err
