"""The model roles of the evaluate stage: test-state writer, tester agent and checker agent.

Each builds its messages from a prompt file plus the facts of the round, asks the model with bounded re-asks
(`builder.llm.reask`: the latest reply's error fed back each time), and adds up what its replies cost
(`Reply.cost`, by the one ledger rule of `usage.Usage`), so every environment's evidence says what its verdict
cost. An unusable reply raises `InvalidReply` with the raw text; the stage decides what that means.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field

from builder.config import EvaluateConfig
from builder.limits import DETAIL_CHARS
from builder.llm import ChatRequest, Reply, StageModel
from builder.llm.parsing import parse_structured, response_format
from builder.llm.reask import NoUsableReply, Refusal, reask
from builder.prompts import prompt
from builder.records import ChatMessage, Environment, Sampling
from builder.usage import Usage
from builder.views.budget import PromptBudget
from builder.views.code import environment_source, environment_text
from builder.views.state import state_text

T = TypeVar("T", bound=BaseModel)
# Where a test-state writer's or a checker's request leaves the start they share (`evaluate_system`, the source).
STATE_PART = "## Part\n`test state`"
VERDICTS_PART = "## Part\n`verdicts`"
MAX_BATCH = 20  # the most calls one tester or checker request may carry (evaluate.calls_per_request's bound)
CaseType = Literal["positive", "negative"]

# Situations the test states are asked to set up, in turn, so that several states do not all look alike.
STATE_FOCUS = (
    "a typical, busy situation: several records in every collection, varied statuses, references that agree",
    "edge cases: an empty or nearly empty collection, boundary values (zero, limits reached), every status present",
    "a larger situation with more records and overlapping relationships, so lookups and rules have work to do",
)


class CallVerdict(BaseModel):
    """The checker's ruling on one tool call of a batch (analysis first, so the verdict follows from it)."""

    # Length caps are part of the schema, so a constrained decoder closes the strings (see stages/mine.py).
    call: int = Field(description="The number of the call judged, as the request numbers them.")
    analysis: str = Field(
        description="Brief: what the method should do with these arguments and what it did.", max_length=800
    )
    verdict: Literal["pass", "warning", "fail"]
    reason: str = Field(description="One sentence justifying the verdict.", max_length=400)


class CheckerVerdict(BaseModel):
    """The checker's ruling on a single call (the rule probes' confirmations, `probes.py`)."""

    analysis: str = Field(
        description="Brief: what the method should do with these arguments and what it did.", max_length=800
    )
    verdict: Literal["pass", "warning", "fail"]
    reason: str = Field(description="One sentence justifying the verdict.", max_length=400)


class CheckerVerdicts(BaseModel):
    """The checker's rulings on the calls of one batch, one per call."""

    verdicts: list[CallVerdict] = Field(max_length=MAX_BATCH)


class ProposedCall(BaseModel):
    """One call the tester proposes for a numbered slot of the batch."""

    call: int = Field(description="The number of the slot this call fills, as the request numbers them.")
    tool: str = Field(max_length=200)
    arguments: dict[str, Any] = Field(description="The tool's arguments, as its parameter schema requires.")


class TesterCalls(BaseModel):
    """The tester's calls for the slots of one batch, in the order they run."""

    calls: list[ProposedCall] = Field(max_length=MAX_BATCH)


class InvalidReply(Exception):  # noqa: N818 - a verdict about a reply, not a program error
    """The model gave no usable answer; `kind` is a stable code, `raw` the last raw reply text."""

    def __init__(self, kind: str, detail: str, raw: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind, self.detail, self.raw = kind, detail, raw


@dataclass
class Agents:
    """The model, the stage's config and the usage of one environment's evaluation (its replies' `cost`)."""

    llm: StageModel
    config: EvaluateConfig
    retries: int
    seed: int
    usage: Usage = Usage()
    affinity: str | None = None  # the environment's id: its requests go to one server of a pool (cache affinity)

    def sampling(self, role: Literal["state", "tester", "checker", "probe"], calls: int = 1) -> Sampling:
        """The role's sampling; a tester or checker request of a batch of `calls` gets the per-call budget each."""
        temperature = getattr(self.config, f"{role}_temperature")
        max_tokens = getattr(self.config, f"{role}_max_tokens") * calls
        return Sampling(temperature=temperature, max_tokens=max_tokens, seed=self.seed)

    async def ask_json(
        self,
        messages: Sequence[ChatMessage],
        output_type: type[T],
        role: Literal["state", "tester", "checker", "probe"],
        *,
        calls: int = 1,
        sample_index: int = 0,
        accept: Callable[[T], Awaitable[str | None]] | None = None,
        schema: dict[str, Any] | None = None,
    ) -> T:
        """Structured output validated by `output_type` and then by `accept` (an error message or None).

        `schema`: a tighter JSON schema the server constrains the reply to (None: `output_type`'s own), e.g. the
        tester's slots each with its tool's parameters; the reply is still validated by `output_type`.

        Up to `retries` re-asks (`reask`), each showing the prompt, the latest reply and its error, each a fresh
        sample of `sample_index`. Raises InvalidReply (`<role>_invalid`).
        """
        first = ChatRequest(
            messages=tuple(messages), response_format=_format(output_type, schema), sampling=self.sampling(role, calls),
            sample_index=sample_index, affinity=self.affinity,
        )  # fmt: skip

        async def ask_once(conversation: list[ChatMessage], sample: int) -> T | Refusal:
            reply = await self._chat(first.resampled(sample, conversation))
            raw = reply.content or ""
            try:
                value = parse_structured(raw, output_type)
                error = (await accept(value) if accept is not None else None) or ""
            except ValueError as invalid:
                error = str(invalid)
            if not error:
                return value
            feedback = f"That answer cannot be used: {error}. Answer again with only a JSON object that fixes this."
            return Refusal(f"{role}_invalid", error, feedback, shown=raw)

        return await self._reasked(messages, ask_once)

    async def _chat(self, request: ChatRequest) -> Reply:
        reply = await self.llm.chat(request)
        self.usage += reply.cost
        return reply

    async def _reasked(
        self, messages: Sequence[ChatMessage], ask_once: Callable[[list[ChatMessage], int], Awaitable[Any]]
    ) -> Any:
        """`reask` with `retries` re-asks; no usable reply is an InvalidReply with the last refusal's code."""
        try:
            return await reask(messages, ask_once, attempts=self.retries + 1)
        except NoUsableReply as failed:
            last = failed.refusal
            raise InvalidReply(last.reason, last.detail[:DETAIL_CHARS], last.raw_output or "") from None

    # ------------------------------------------------------------------------------------------ test states

    def state_messages(
        self, env: Environment, header: str, default_state: dict[str, Any], index: int, budget: PromptBudget,
        whole: bool,
    ) -> list[ChatMessage]:  # fmt: skip
        """The request of test state `index`; the shape example is cut to `budget` at record boundaries.

        With `whole` (the checker's requests start with the whole source, `facts.shows_whole_source`) and at full
        size, it starts as they do: the instructions of both, then the environment's source, which the writer
        reads for what each tool needs of the state; else with the rules and the state definition."""
        focus = STATE_FOCUS[index % len(STATE_FOCUS)]
        shared = shares_start(budget, whole)
        about = (
            f"{environment_source(env)}\n\n{STATE_PART}" if shared else
            f"Environment `{env.class_name}` ({env.domain}): {environment_text(env.description, env.code)}\n\n"
            f"State definition:\n```python\n{header}\n```"
        )  # fmt: skip
        user = (
            f"{about}\n\n"
            f"The state its constructor builds (shape example only; write new content):\n"
            f"{state_text(default_state, budget)}\n\n"
            f"Write test state {index + 1} of {self.config.test_states}. Focus: {focus}."
        )
        system = evaluate_system() if shared else prompt("evaluate_state")
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]

    # ----------------------------------------------------------------------------------------------- tester

    def tester_messages(self, env: Environment, tools: Sequence[dict[str, Any]], facts: str) -> list[ChatMessage]:
        """The tester's request: instructions, the environment and its tools' schemas (the stable prefix), then
        the facts of the round (state, recent calls, the numbered slots to fill)."""
        schemas = json.dumps([tool["function"] for tool in tools], ensure_ascii=False)
        user = (
            f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
            f"Tools (JSON schemas):\n{schemas}\n\n{facts}"
        )
        return [ChatMessage(role="system", content=prompt("evaluate_tester")), ChatMessage(role="user", content=user)]

    # ---------------------------------------------------------------------------------------------- checker

    def checker_messages(self, facts: str, shared: bool) -> list[ChatMessage]:
        """`shared`: the facts start with the whole source (`facts.shares_start`), as the test-state requests do."""
        system = evaluate_system() if shared else prompt("evaluate_checker")
        return [ChatMessage(role="system", content=system), ChatMessage(role="user", content=facts)]


def shares_start(budget: PromptBudget, whole: bool) -> bool:
    """Whether a checker or test-state request starts with the instructions of both and the whole source (the
    start they share): with `whole` (`shows_whole_source`), at full size."""
    return whole and budget.level == 0


def evaluate_system() -> str:
    """The instructions of the test-state writer and the checker in one system message, each under its part's
    name: their requests about one environment then share a start (this, then the environment's source) that a
    model server's prefix cache computes once, on the environment's first test-state request."""
    return (
        f"{prompt('evaluate_roles')}\n\n# The part `test state`\n\n{prompt('evaluate_state')}\n\n"
        f"# The part `verdicts`\n\n{prompt('evaluate_checker')}"
    )


def _format(output_type: type[BaseModel], schema: dict[str, Any] | None) -> dict[str, Any]:
    asked = response_format(output_type)
    if schema is not None:
        asked["json_schema"]["schema"] = schema
    return asked


def tester_schema(tools: Sequence[dict[str, Any]], slots: Sequence[tuple[str, CaseType]], named: bool) -> dict:
    """The JSON schema of a tester reply for these slots: each item a slot's number, a tool and arguments fit for
    that tool's parameters (with `named`, only the slot's tool), so a constrained decoder writes no parameter the
    tool lacks, as the forced tool call of a single-call request did."""
    parameters = {tool["function"]["name"]: tool["function"]["parameters"] for tool in tools}
    items = [
        {
            "type": "object",
            "properties": {
                "call": {"type": "integer", "enum": [number]},
                "tool": {"type": "string", "enum": [name]},
                "arguments": parameters[name],
            },
            "required": ["call", "tool", "arguments"],
            "additionalProperties": False,
        }
        for number, (scheduled, _case) in enumerate(slots, 1)
        for name in ([scheduled] if named else parameters)
        if name in parameters
    ]
    calls = {"type": "array", "items": {"anyOf": items}, "minItems": 1, "maxItems": len(slots)}
    return {"type": "object", "properties": {"calls": calls}, "required": ["calls"], "additionalProperties": False}


def slot_text(number: int, slot: tuple[str, CaseType]) -> str:
    """One numbered slot of a tester batch: the tool the harness scheduled and the case it asks for (what a case
    of either kind is, the tester's instructions say once, not every slot)."""
    tool, case = slot
    return f"{number}. `{tool}` with a {case.upper()} case"
