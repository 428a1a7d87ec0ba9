from pathlib import Path

import pytest
from pydantic import ValidationError

from builder.config import BuildConfig, config_hash, load_config, to_toml
from builder.errors import ConfigError


def test_defaults_load_without_a_file():
    config = load_config()
    assert config == BuildConfig()
    assert config.llm.max_concurrency >= 1


def test_toml_file_and_overrides(tmp_path: Path):
    path = tmp_path / "builder.toml"
    path.write_text('[rollout]\nsamples_per_scenario = 3\n[llm]\nmodel = "Qwen/Qwen3-8B"\n')
    config = load_config(path, ["rollout.samples_per_scenario=5", "select.rl_pass_band=[0.2, 0.8]"])
    assert config.rollout.samples_per_scenario == 5  # the override wins over the file
    assert config.llm.model == "Qwen/Qwen3-8B"
    assert config.select.rl_pass_band == (0.2, 0.8)


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("llm.model=Qwen/Qwen3-8B", "Qwen/Qwen3-8B"),  # not TOML: taken as a plain string
        ('llm.model="a b"', "a b"),
        ("llm.url=http://127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"),
    ],
)
def test_override_strings_need_no_quotes(override: str, expected: str):
    config = load_config(None, [override])
    key = override.split("=")[0].split(".")[1]
    assert getattr(config.llm, key) == expected


def test_invalid_value_names_key_value_and_rule():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["rollout.samples_per_scenario=0"])
    message = str(error.value)
    assert "rollout.samples_per_scenario" in message
    assert "0" in message
    assert "greater than or equal to 1" in message


def test_wrong_type_is_reported():
    with pytest.raises(ConfigError, match=r"llm.max_concurrency = 'many'"):
        load_config(None, ["llm.max_concurrency=many"])


def test_literal_lists_allowed_values():
    with pytest.raises(ConfigError, match=r"hub.backend = 'ftp'.*'git' or 'hf'"):
        load_config(None, ["hub.backend=ftp"])


def test_unknown_key_lists_allowed_keys():
    with pytest.raises(ConfigError, match=r"llm.modle: unknown key; allowed here: model, served_model_name"):
        load_config(None, ["llm.modle=x"])


def test_unknown_section():
    with pytest.raises(ConfigError, match=r"unknown section 'lmm'; sections are: run, llm"):
        load_config(None, ["lmm.model=x"])


@pytest.mark.parametrize("override", ["llm", "llm.model", "=x", "a.b.c=1", ".x=1"])
def test_malformed_override(override: str):
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config(None, [override])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="min_operations must not exceed max_operations"):
        load_config(None, ["plan.min_operations=9", "plan.max_operations=3"])
    with pytest.raises(ConfigError, match="rl_pass_band"):
        load_config(None, ["select.rl_pass_band=[0.9, 0.1]"])


def test_missing_and_broken_files(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    broken = tmp_path / "broken.toml"
    broken.write_text("[llm\nmodel = 1")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(broken)


def test_section_that_is_not_a_table(tmp_path: Path):
    path = tmp_path / "c.toml"
    path.write_text('llm = "x"\n')
    with pytest.raises(ConfigError, match="llm"):
        load_config(path)


def test_hash_is_stable_and_ignores_operational_keys():
    base = config_hash(load_config())
    assert base == config_hash(load_config())
    assert len(base) == 16
    assert config_hash(load_config(None, ["llm.url=http://x/v1", "llm.max_concurrency=64"])) == base
    assert config_hash(load_config(None, ["llm.temperature=0.1"])) != base
    assert config_hash(load_config(None, ["hub.repo=me/other", "store.path=elsewhere"])) == base


def test_config_is_frozen():
    config = load_config()
    with pytest.raises(ValidationError):
        config.llm.model = "x"  # type: ignore[misc]


def test_to_toml_round_trips(tmp_path: Path):
    config = load_config(None, ["llm.url=http://h/v1", "select.rl_pass_band=[0.1, 0.9]", "mine.max_topics=7"])
    path = tmp_path / "out.toml"
    path.write_text(to_toml(config))
    assert load_config(path) == config


def test_none_unsets_optional_keys_only():
    assert load_config(None, ["mine.max_seeds=none"]).mine.max_seeds is None
    assert load_config(None, ["llm.served_model_name=none"]).llm.served_model_name == "none"  # a string key


def test_profiles_layer_under_the_config_file_and_overrides(tmp_path):
    assert load_config().evaluate.calls == 100  # the paper's N is the built-in default
    cpu = load_config(profile="cpu")
    assert cpu.evaluate.calls == 12 and cpu.llm.model == "builtin:SmolLM2-135M-Instruct"
    gpu = load_config(profile="gpu")
    assert (gpu.evaluate.calls, gpu.llm.model, gpu.llm.reasoning_parser) == (100, "Qwen/Qwen3-8B", "qwen3")
    path = tmp_path / "mine.toml"
    path.write_text("[llm]\nmax_concurrency = 8\n[evaluate]\nkeep_score = 0.9\n")
    layered = load_config(path, ["evaluate.test_states=3"], profile="gpu")
    assert layered.llm.model == "Qwen/Qwen3-8B" and layered.llm.max_concurrency == 8  # the file replaces one key
    assert (layered.evaluate.calls, layered.evaluate.keep_score, layered.evaluate.test_states) == (100, 0.9, 3)
    with pytest.raises(ConfigError, match="unknown profile 'tpu'"):
        load_config(profile="tpu")


def test_auto_profile_is_the_one_for_what_nvidia_smi_lists(tmp_path, monkeypatch):
    cpu, gpu = load_config(profile="cpu"), load_config(profile="gpu")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    assert load_config(profile="auto") == cpu  # no nvidia-smi at all
    smi = bin_dir / "nvidia-smi"
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-5e3b)"\n')
    smi.chmod(0o755)
    assert load_config(profile="auto") == gpu
    smi.write_text('#!/bin/sh\necho "No devices were found"\nexit 6\n')  # a driver, but no GPU
    assert load_config(profile="auto") == cpu


def test_printed_config_reloads_to_the_same_hash_with_any_profile(tmp_path, capsys):
    from builder.cli import main

    assert main(["config", "--profile", "cpu"]) == 0
    path = tmp_path / "printed.toml"
    path.write_text(capsys.readouterr().out)
    assert config_hash(load_config(path, profile="none")) == config_hash(load_config(profile="cpu"))
    assert config_hash(load_config(path, profile="cpu")) == config_hash(load_config(profile="cpu"))
