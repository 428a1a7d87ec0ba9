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
from builder.views.code import environment_text
from builder.views.state import state_text

T = TypeVar("T", bound=BaseModel)
CaseType = Literal["positive", "negative"]

# Situations the test states are asked to set up, in turn, so that several states do not all look alike.
STATE_FOCUS = (
    "a typical, busy situation: several records in every collection, varied statuses, references that agree",
    "edge cases: an empty or nearly empty collection, boundary values (zero, limits reached), every status present",
    "a larger situation with more records and overlapping relationships, so lookups and rules have work to do",
)


class CheckerVerdict(BaseModel):
    """The checker's ruling on one tool call (analysis first, so the verdict follows from it)."""

    # Length caps are part of the schema, so a constrained decoder closes the strings (see stages/mine.py).
    analysis: str = Field(
        description="Brief: what the method should do with these arguments and what it did.", max_length=800
    )
    verdict: Literal["pass", "warning", "fail"]
    reason: str = Field(description="One sentence justifying the verdict.", max_length=400)


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

    def sampling(self, role: Literal["state", "tester", "checker", "probe"]) -> Sampling:
        temperature = getattr(self.config, f"{role}_temperature")
        return Sampling(temperature=temperature, max_tokens=getattr(self.config, f"{role}_max_tokens"), seed=self.seed)

    async def ask_json(
        self,
        messages: Sequence[ChatMessage],
        output_type: type[T],
        role: Literal["state", "checker", "probe"],
        *,
        sample_index: int = 0,
        accept: Callable[[T], Awaitable[str | None]] | None = None,
    ) -> T:
        """Structured output validated by `output_type` and then by `accept` (an error message or None).

        Up to `retries` re-asks (`reask`), each showing the prompt, the latest reply and its error, each a fresh
        sample of `sample_index`. Raises InvalidReply (`<role>_invalid`).
        """
        first = ChatRequest(
            messages=tuple(messages), response_format=response_format(output_type), sampling=self.sampling(role),
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
        self, env: Environment, header: str, default_state: dict[str, Any], index: int, budget: PromptBudget
    ) -> list[ChatMessage]:
        """The request of test state `index`; the shape example is cut to `budget` at record boundaries."""
        focus = STATE_FOCUS[index % len(STATE_FOCUS)]
        user = (
            f"Environment `{env.class_name}` ({env.domain}): {environment_text(env.description, env.code)}\n\n"
            f"State definition:\n```python\n{header}\n```\n\n"
            f"The state its constructor builds (shape example only; write new content):\n"
            f"{state_text(default_state, budget)}\n\n"
            f"Write test state {index + 1} of {self.config.test_states}. Focus: {focus}."
        )
        return [ChatMessage(role="system", content=prompt("evaluate_state")), ChatMessage(role="user", content=user)]

    # ----------------------------------------------------------------------------------------------- tester

    async def propose(
        self, env: Environment, tools: Sequence[dict[str, Any]], slot: tuple[str, CaseType], facts: str
    ) -> tuple[str, dict[str, Any], str]:
        """The tester's call for this round as (tool name, arguments, raw reply), forced to call a tool.

        Raises InvalidReply (`no_tool_call`, `bad_arguments`) after the bounded retries; an unknown tool name
        is returned as is, since only the session knows it is unknown (and it is the tester's error, counted by
        the caller).
        """
        tool, case = slot
        goal = _CASE_GOALS[case]
        task = f"Your task this round: call `{tool}` with a {case.upper()} case: {goal}"
        asked = [
            ChatMessage(role="system", content=prompt("evaluate_tester")),
            ChatMessage(
                role="user",
                content=f"Environment `{env.class_name}`: {environment_text(env.description, env.code)}\n\n"
                f"{facts}\n\n{task}",
            ),
        ]
        choice = tool if self.config.tester_tool_choice == "named" else "required"
        first = ChatRequest(
            messages=tuple(asked), tools=tuple(tools), tool_choice=choice, parallel_tool_calls=False,
            sampling=self.sampling("tester"), affinity=self.affinity,
        )  # fmt: skip

        async def ask_once(conversation: list[ChatMessage], sample: int) -> tuple[str, dict[str, Any], str] | Refusal:
            reply = await self._chat(first.resampled(sample, conversation))
            raw = _raw_text(reply)
            kind, detail = "no_tool_call", "the reply called no tool"
            if reply.tool_calls:
                call = reply.tool_calls[0].function
                try:
                    arguments = json.loads(call.arguments) if call.arguments.strip() else {}
                except json.JSONDecodeError as error:
                    kind, detail = "bad_arguments", f"the arguments are not valid JSON ({error})"
                else:
                    if isinstance(arguments, dict):
                        return call.name, arguments, raw
                    kind, detail = "bad_arguments", "the arguments must be a JSON object"
            # The call is not shown back: a tool call without its result would break the chat template.
            return Refusal(kind, detail, f"Your last reply was unusable: {detail}. {task}", raw=raw)

        return await self._reasked(asked, ask_once)

    # ---------------------------------------------------------------------------------------------- checker

    def checker_messages(self, facts: str) -> list[ChatMessage]:
        return [ChatMessage(role="system", content=prompt("evaluate_checker")), ChatMessage(role="user", content=facts)]


_CASE_GOALS: dict[CaseType, str] = {
    "positive": "valid arguments the tool should accept, using ids and values that exist in the current state "
    "and respecting the rules.",
    "negative": "arguments the tool should refuse: an id that does not exist, an out-of-range or empty value, or "
    "a request that breaks one of the rules. Keep the parameter names and types valid.",
}


def _raw_text(reply: Reply) -> str:
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in reply.tool_calls]
    return json.dumps({"content": reply.content, "tool_calls": calls}, ensure_ascii=False)
