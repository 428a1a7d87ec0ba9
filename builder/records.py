"""Every record the pipeline produces, as frozen pydantic models, in one place.

A record's `id` is a content hash of the fields that define it (`ID_FIELDS`), so the same work is never done
twice and every row can be traced: trajectory → scenario → environment → plan → topic → seed task. Free-form
JSON (states, tool arguments) is typed `JSON` here, tool schemas `ToolSchemas` and the stages' evidence by the
models of `builder.evidence`; all of these are stored as JSON strings in Parquet. Chat messages use the fixed
struct that TRL and other trainers read as is. Bump `SCHEMA_VERSION` when a stored column changes meaning or
shape.
"""

from __future__ import annotations

import hashlib
import json
from functools import cached_property
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, Field, computed_field, field_validator

from builder import __version__
from builder.evidence import Evaluation, Synthesis, ToolGraph, Verification
from builder.frozen import JSON, STORED_AS_JSON, Frozen
from builder.sandbox.world import DEFAULT_NOW, derive_seed, parse_now
from builder.usage import Usage

# 2: ChatMessage.reasoning_content, Scenario.now; 3: the selections table (was .selected); 4: `Usage` by the one
# ledger rule (cached_calls, failed_calls, regrowths; cache hits count no calls or tokens); 5: `Provenance.origin`
# (imported), Scenario.method and .wording (missing: "llm", "model"), Environment.graph; 6: `Usage.retries`;
# 7: Scenario.answer_facts and .family, Trajectory.answer_stated (missing: (), "plain", None)
SCHEMA_VERSION = 7
Family = Literal["plain", "missing_info", "infeasible", "policy_trap", "error_recovery", "long_context"]


def _decoded(value: Any) -> Any:
    """Tool schemas given as JSON text (as some older rows held them), decoded."""
    return json.loads(value) if isinstance(value, str) else value


# OpenAI function schemas, always decoded; stored as a JSON string column.
ToolSchemas = Annotated[tuple[dict[str, Any], ...], BeforeValidator(_decoded), STORED_AS_JSON]


class Sampling(Frozen):
    """Sampling parameters of a model call (None: the server's default)."""

    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None


class Origin(Frozen):
    """Where an imported record came from, outside builder (`python -m builder import`): enough to find it again."""

    source: Literal["envscaler", "classes"] = Field(description="The import format.")
    location: str = Field(description="The file, folder or Hugging Face dataset id read.")
    revision: str = Field(description="`sha256:<hex>` of the bytes read, or the Hub dataset's commit.")
    ref: str = Field(description="The record's own id in the source: `env_1_rl`, `env_1_rl-task_3`, `api.py:Api`.")
    split: Literal["train", "rl"] | None = Field(
        None, description="The split the source gave it (EnvScaler's `_sft`/`_rl` suffix); None: builder's own."
    )


class Provenance(Frozen):
    """Where a record came from: enough to reproduce it and to trace it to its parents."""

    builder_version: str = __version__
    config_hash: str
    model: str | None = None
    sampling: Sampling | None = None
    prompt_version: str | None = None
    parent_ids: tuple[str, ...] = ()
    origin: Origin | None = Field(None, description="Imported records: their source (None: made by builder).")


class Record(Frozen):
    """Base of every stored record: a content-hash id, a schema version and provenance."""

    KIND: ClassVar[str]
    ID_FIELDS: ClassVar[tuple[str, ...]]

    schema_version: int = SCHEMA_VERSION
    provenance: Provenance

    @computed_field  # type: ignore[prop-decorator]
    @cached_property
    def id(self) -> str:
        """`<kind>-<16 hex digits>`: sha256 of the canonical JSON of the defining fields."""
        content = {name: getattr(self, name) for name in self.ID_FIELDS}
        canonical = json.dumps(_plain(content), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        return f"{self.KIND}-{hashlib.sha256(canonical.encode()).hexdigest()[:16]}"

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Record:  # type: ignore[override]
        """A copy with `update` applied; its id is recomputed from the new content, never copied."""
        copy = super().model_copy(update=update, deep=deep)
        copy.__dict__.pop("id", None)
        return copy


def _plain(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump(mode="json")
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(item) for item in value]
    return value


# ---------------------------------------------------------------------------------------------- chat messages


class FunctionCall(Frozen):
    name: str
    arguments: str = Field(description="The arguments as JSON text, exactly as the model produced them.")


class ToolCall(Frozen):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Frozen):
    """One OpenAI-style chat message; a fixed struct, so every table has one schema.

    `reasoning_content` is an assistant message's reasoning (thinking) as the model produced it, under the name
    Qwen3's chat template and TRL read. It is stored in trajectories but never sent back to a server.
    """

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: tuple[ToolCall, ...] | None = None
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None


# ------------------------------------------------------------------------------------------- pipeline records


class SeedTask(Record):
    """A user request from an existing task dataset: the raw material topics are mined from."""

    KIND = "seed"
    ID_FIELDS = ("source", "request")

    source: str = Field(description="Where the request came from: 'builtin', a file path or a Hub dataset id.")
    source_ref: str = Field(description="The request's position or id inside its source.")
    request: str
    domain: str | None = None


class Topic(Record):
    """An environment worth building, inferred from one or more seed tasks."""

    KIND = "topic"
    ID_FIELDS = ("name", "description", "domain")

    name: str
    description: str
    domain: str
    entities: tuple[str, ...] = ()
    example_requests: tuple[str, ...] = Field((), description="Seed requests this topic was inferred from.")
    judge_reason: str = ""
    modelability: float = Field(0.0, description="0-1: how easily it fits one Python class of plain data.")
    usefulness: float = Field(0.0, description="0-1: how useful an agent trained on it would be.")


# Types a planned attribute or parameter may have: each maps to one Python hint and one JSON schema.
PlanType = Literal["str", "int", "float", "bool", "list[str]", "list[int]", "list[float]", "list[dict]", "dict"]


class AttributePlan(Frozen):
    name: str
    type: PlanType
    description: str = ""


class EntityPlan(Frozen):
    """A kind of record in the state, stored as `self.<collection>: dict[key value, record dict]`."""

    name: str
    key: str = Field(description="The attribute that identifies an instance.")
    attributes: tuple[AttributePlan, ...]
    collection: str = Field("", description="The instance attribute holding the records, e.g. `members`.")


class ParameterPlan(Frozen):
    name: str
    type: PlanType
    description: str = ""
    required: bool = True


class OperationPlan(Frozen):
    name: str
    kind: Literal["query", "change"]
    description: str
    parameters: tuple[ParameterPlan, ...] = ()
    returns: str = ""
    enforces: tuple[int, ...] = Field((), description="1-based numbers of the rules this operation enforces.")
    reads: tuple[str, ...] = Field((), description="Entities it reads.")
    writes: tuple[str, ...] = Field((), description="Entities it writes (empty for queries).")


class EnvPlan(Record):
    """The design of one environment: its state, rules and tools, before any code exists."""

    KIND = "plan"
    ID_FIELDS = ("topic_id", "name", "domain", "class_name", "description", "entities", "rules", "operations")

    topic_id: str
    name: str = Field("", description="The topic's snake_case name, e.g. library_loans.")
    domain: str = ""
    class_name: str
    description: str
    entities: tuple[EntityPlan, ...]
    rules: tuple[str, ...] = ()
    operations: tuple[OperationPlan, ...]


class Environment(Record):
    """An environment class as code, its tool schemas and its evaluation verdict. Identified by its code."""

    KIND = "env"
    ID_FIELDS = ("code",)

    plan_id: str
    name: str = Field(description="snake_case name, e.g. library_loans.")
    class_name: str
    description: str
    domain: str
    code: str
    tools: ToolSchemas = Field(description="OpenAI function schemas of the tools, in method order.")
    state_schema: JSON = Field(description="JSON schema of the state attributes.")
    status: Literal["candidate", "accepted", "rejected"] = "candidate"
    reason: str | None = Field(None, description="Stable reason code when rejected.")
    scores: JSON = Field(default_factory=dict, description="Quality scores by name, e.g. dual_agent.")
    evaluation: Annotated[Evaluation | None, STORED_AS_JSON] = Field(
        None, description="Evidence behind the verdict (None: not evaluated yet)."
    )
    synthesis: Annotated[Synthesis | None, STORED_AS_JSON] = Field(
        None, description="How the code was written: requests, regenerated pieces, automatic fixes, repairs."
    )
    graph: Annotated[ToolGraph | None, STORED_AS_JSON] = Field(
        None, description="Tool dependency graph from evaluate's first test state (None: not accepted, or older)."
    )

    @field_validator("evaluation", "synthesis", "graph", mode="before")
    @classmethod
    def _empty_is_none(cls, value: Any) -> Any:
        return None if value == {} else value  # rows of older builders stored "no evidence" as {}

    @property
    def contract(self) -> Literal["strict", "import"]:
        """How strictly its code is linted (`envs.lint.Contract`): imported code (with an origin) for information."""
        return "import" if self.provenance.origin is not None else "strict"


class Action(Frozen):
    """One tool call of a gold solution."""

    name: str
    arguments: Annotated[dict[str, Any], STORED_AS_JSON]


class UserScript(Frozen):
    """What a user simulator needs to play the user of a conversational scenario."""

    profile: str
    known_up_front: str
    reveal_when_asked: str
    ending: str


def scenario_seed(env_id: str, now: str) -> int:
    """The sandbox seed of every session of a scenario (verification, gold replay, rollouts, training).

    One seed per scenario, not per episode: an agent that creates the record the gold creates draws the same
    `uuid4()` id, so its change lands on the same state path as the gold's (see `builder.rollout.reward`).
    """
    return derive_seed(env_id, now)


class Scenario(Record):
    """An initial state, a task and the rule-based checks that grade the final state."""

    KIND = "scenario"
    ID_FIELDS = ("env_id", "initial_state", "now", "task", "mode")

    env_id: str
    mode: Literal["non_conversational", "conversational"]
    method: Literal["llm", "graph"] = Field("llm", description="How it was made (docs/scenarios.md §8); not in the id.")
    wording: Literal["model", "template"] = Field("model", description="Who worded the task: the model or a template.")
    family: Family = Field("plain", description="The kind of task (docs/scenarios.md §9). Not part of the id.")
    initial_state: JSON
    now: str = Field(
        DEFAULT_NOW,
        description="The scenario's current date-time (ISO 8601, naive local time): what the sandbox's clock reads "
        "and what the agent and the simulated user are told today is.",
    )
    task: str
    user: UserScript | None = None
    checklist: tuple[str, ...]
    checks: tuple[str, ...] = Field(description="One `check(initial_state, final_state) -> bool` per item.")
    answer_facts: tuple[str, ...] = Field((), description="Values the agent's answer must state (`envs.answer`).")
    gold_actions: tuple[Action, ...]
    difficulty: Literal["easy", "medium", "hard"]
    verification: Annotated[Verification, STORED_AS_JSON] = Field(
        description="Evidence that the checks and gold agree."
    )

    @field_validator("now")
    @classmethod
    def _iso_now(cls, value: str) -> str:
        parse_now(value)
        return value

    @property
    def seed(self) -> int:
        """The sandbox seed of this scenario's sessions (`scenario_seed`)."""
        return scenario_seed(self.env_id, self.now)


class Trajectory(Record):
    """An agent's conversation with one scenario's environment, graded by the scenario's checks."""

    KIND = "traj"
    ID_FIELDS = ("scenario_id", "model", "sampling", "sample_index")

    scenario_id: str
    env_id: str
    mode: Literal["non_conversational", "conversational"]
    model: str
    sampling: Sampling
    sample_index: int
    messages: tuple[ChatMessage, ...]
    tools: ToolSchemas
    reward: float
    solved: bool
    checks_passed: tuple[bool, ...]
    answer_stated: bool | None = Field(None, description="The answer stated the answer_facts (None: none).")
    end_reason: str = Field(
        description="Why the episode ended: agent_done, user_stop, max_turns, max_tool_calls, max_tokens, "
        "user_leak, user_error, llm_error, env_error."
    )
    usage: Usage = Usage()
    num_turns: int = Field(0, description="Assistant messages.")
    num_tool_calls: int = 0
    tool_errors: int = Field(0, description="Tool calls answered with an error (malformed, unknown tool, failed).")
    check_fraction: float = Field(0.0, description="Share of checks passed, before the collateral-damage guard.")
    collateral: tuple[str, ...] = Field(
        (), description="State paths the agent wrote that the gold solution does not touch."
    )
    flags: tuple[str, ...] = Field(
        (), description="Stable codes of what went wrong on the way: malformed_call, unknown_tool, collateral, ..."
    )


class Selection(Record):
    """A trajectory chosen for SFT or a scenario chosen for RL by the select stage, with its split."""

    KIND = "sel"
    ID_FIELDS = ("kind", "subject_id")

    kind: Literal["sft", "rl"]
    split: Literal["train", "rl"]
    subject_id: str = Field(description="The trajectory id (sft) or the scenario id (rl).")
    scenario_id: str
    env_id: str
    pass_rate: float = Field(description="Share of the scenario's graded rollouts that solved it.")
    num_rollouts: int


class Rejection(Record):
    """An input a stage dropped, with a stable reason code and the raw model output behind the decision."""

    KIND = "reject"
    ID_FIELDS = ("stage", "subject_id")

    stage: str
    subject_id: str = Field(description="Id of the input record that was rejected.")
    reason: str = Field(description="Stable short code, aggregated in stats and the dataset card.")
    detail: str = ""
    raw_output: str | None = None


RECORD_TYPES: tuple[type[Record], ...] = (
    SeedTask,
    Topic,
    EnvPlan,
    Environment,
    Scenario,
    Trajectory,
    Selection,
    Rejection,
)
