"""The agent loop: one episode of a model with tools against a live environment, as a pure async function.

The loop owns no model, sandbox or scenario: the caller passes the agent (`ChatModel`), something that runs
tool calls (`ToolRunner`), an optional user simulator (`User`) and the limits. It returns the whole conversation
in the OpenAI message format and why it ended; grading is the caller's business (`builder.rollout.reward`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from builder.llm import ChatModel, ChatRequest, LLMRequestError
from builder.llm.parsing import check_tool_call
from builder.records import ChatMessage, Sampling, ToolCall
from builder.usage import Usage

# End reasons (stable codes, stored in `Trajectory.end_reason`).
AGENT_DONE = "agent_done"  # the agent answered without tool calls (non-conversational)
USER_STOP = "user_stop"  # the user simulator ended the conversation
MAX_TURNS = "max_turns"
MAX_TOOL_CALLS = "max_tool_calls"
MAX_TOKENS = "max_tokens"
USER_LEAK = "user_leak"  # the user simulator kept leaking hidden information; the episode is void
USER_ERROR = "user_error"  # the user simulator gave no usable reply or its server refused
LLM_ERROR = "llm_error"  # the agent's server refused a request (e.g. the context overflowed)
ENV_ERROR = "env_error"  # the environment could not be read at the end (infrastructure, not the agent)
END_REASONS = (
    AGENT_DONE, USER_STOP, MAX_TURNS, MAX_TOOL_CALLS, MAX_TOKENS, USER_LEAK, USER_ERROR, LLM_ERROR, ENV_ERROR,
)  # fmt: skip
# Episodes that ended for reasons outside the agent's control: not counted in pass rates, never selected.
INFRA_END_REASONS = frozenset({USER_LEAK, USER_ERROR, LLM_ERROR, ENV_ERROR})

LIMIT_MESSAGE = "Error: the tool-call limit of this episode is reached; the call was not run."


class ToolOutcome(Protocol):
    """What running one tool call gives back (`builder.envs.session.ToolResult` fits)."""

    ok: bool
    error_kind: str | None

    def content(self) -> str: ...


class ToolRunner(Protocol):
    """Runs a validated tool call against the live environment."""

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome: ...


@dataclass(frozen=True)
class UserTurn:
    """One user-simulator reply: the message, or a stop (`stop`), or a failure (`failure` is an end reason)."""

    content: str | None = None
    stop: bool = False
    failure: str | None = None
    detail: str = ""
    usage: Usage = Usage()


class User(Protocol):
    """The user side of a conversational episode (`builder.rollout.user_sim.UserSimulator`)."""

    async def reply(self, messages: Sequence[ChatMessage]) -> UserTurn:
        """The next user turn, given the conversation so far (the agent's view of it)."""
        ...


@dataclass(frozen=True)
class Limits:
    max_turns: int
    max_tool_calls: int
    max_tokens: int


@dataclass(frozen=True)
class Episode:
    """A finished episode: the conversation, why it ended and what it cost (the agent's and the user simulator's
    calls, by the ledger rule of `usage.Usage`)."""

    messages: tuple[ChatMessage, ...]
    end_reason: str
    agent_usage: Usage
    user_usage: Usage
    num_turns: int
    num_tool_calls: int
    tool_errors: int
    flags: tuple[str, ...]
    detail: str = ""


@dataclass
class _Tally:
    turns: int = 0
    calls: int = 0
    tool_errors: int = 0
    context_tokens: int = 0
    agent: Usage = Usage()
    user: Usage = Usage()

    def __post_init__(self) -> None:
        self.flags: list[str] = []

    def flag(self, code: str) -> None:
        if code not in self.flags:
            self.flags.append(code)


async def run_episode(
    agent: ChatModel,
    tools: Sequence[dict[str, Any]],
    runner: ToolRunner,
    *,
    system: str,
    opening: str | None,
    limits: Limits,
    sampling: Sampling,
    sample_index: int = 0,
    user: User | None = None,
) -> Episode:
    """Run one episode to its end and return it.

    Non-conversational (`user` is None): the conversation opens with `opening` (the task) and ends when the agent
    answers without tool calls (`agent_done`). Conversational: the user simulator writes the opening message (when
    `opening` is None) and every reply to a text-only agent turn, and ends the episode (`user_stop`). Every tool
    call is validated against `tools` first; a malformed or unknown call is answered with an error tool message
    (flags `malformed_call`, `unknown_tool`) and never reaches the environment. Limits end the episode with
    `max_turns`, `max_tool_calls` or `max_tokens`; an agent request refused or failed after every retry ends it
    with `llm_error`. Assistant
    messages keep the model's reasoning (`reasoning_content`, when it thought); it is never sent back.

    Raises:
        ServerUnreachable: no server ever answered the agent's client; the run stops and can resume.
    """
    tally = _Tally()
    messages = [ChatMessage(role="system", content=system)]
    if opening is None:
        if user is None:
            raise ValueError("a non-conversational episode needs the task as its opening message")
        turn = await user.reply(messages)
        tally.user += turn.usage
        if turn.failure or turn.stop or not turn.content:
            return _end(messages, turn.failure or USER_ERROR, tally, turn.detail or "no opening message")
        opening = turn.content
    messages.append(ChatMessage(role="user", content=opening))
    while True:
        if tally.turns >= limits.max_turns:
            return _end(messages, MAX_TURNS, tally)
        if tally.context_tokens >= limits.max_tokens:
            return _end(messages, MAX_TOKENS, tally)
        request = ChatRequest(
            messages=tuple(messages),
            tools=tuple(tools),
            tool_choice="auto",
            parallel_tool_calls=True,
            sampling=sampling,
            sample_index=sample_index,
        )
        try:
            reply = await agent.chat(request)
        except LLMRequestError as error:  # also after every retry: this episode failed, not the scenario
            tally.agent += error.cost
            return _end(messages, LLM_ERROR, tally, str(error)[:500])
        tally.turns += 1
        tally.agent += reply.cost
        tally.context_tokens = reply.usage.prompt_tokens + reply.usage.completion_tokens
        messages.append(reply.message())
        if reply.finish_reason == "length":
            tally.flag("truncated_reply")  # cut even after the client grew its budget: not a reply to learn from
        if not reply.tool_calls and not (reply.content or "").strip():
            tally.flag("empty_reply")
        if reply.tool_calls:
            if await _run_calls(reply.tool_calls, tools, runner, messages, tally, limits):
                return _end(messages, MAX_TOOL_CALLS, tally)
            continue
        if user is None:
            return _end(messages, AGENT_DONE, tally)
        turn = await user.reply(messages)
        tally.user += turn.usage
        if turn.failure:
            return _end(messages, turn.failure, tally, turn.detail)
        if turn.stop:
            return _end(messages, USER_STOP, tally)
        messages.append(ChatMessage(role="user", content=turn.content))


async def _run_calls(
    calls: Sequence[ToolCall],
    tools: Sequence[dict[str, Any]],
    runner: ToolRunner,
    messages: list[ChatMessage],
    tally: _Tally,
    limits: Limits,
) -> bool:
    """Answer every call of one (possibly parallel) reply with a tool message; True when the limit was hit.

    Calls past the limit still get a tool message (saying they were not run), so the conversation stays
    well-formed: every tool call id has its answer.
    """
    limit_hit = False
    for call in calls:
        if tally.calls >= limits.max_tool_calls:
            limit_hit = True
            messages.append(_tool_message(call, LIMIT_MESSAGE))
            continue
        tally.calls += 1
        parsed = check_tool_call(call, tools)
        if not parsed.ok:
            tally.tool_errors += 1
            tally.flag("unknown_tool" if parsed.error.startswith("unknown tool") else "malformed_call")
            messages.append(_tool_message(call, f"Error: {parsed.error}"))
            continue
        outcome = await runner.call(parsed.name, parsed.arguments or {})
        if not outcome.ok:
            tally.tool_errors += 1
            if outcome.error_kind in ("unknown_tool", "bad_arguments"):
                tally.flag("unknown_tool" if outcome.error_kind == "unknown_tool" else "malformed_call")
        messages.append(_tool_message(call, outcome.content()))
    return limit_hit


def _tool_message(call: ToolCall, content: str) -> ChatMessage:
    return ChatMessage(role="tool", content=content, tool_call_id=call.id, name=call.function.name)


def _end(messages: list[ChatMessage], reason: str, tally: _Tally, detail: str = "") -> Episode:
    return Episode(
        messages=tuple(messages),
        end_reason=reason,
        agent_usage=tally.agent,
        user_usage=tally.user,
        num_turns=tally.turns,
        num_tool_calls=tally.calls,
        tool_errors=tally.tool_errors,
        flags=tuple(tally.flags),
        detail=detail,
    )
