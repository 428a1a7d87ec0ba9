"""The user side of a conversational scenario for trainers that drive the agent themselves (TRL, OpenEnv).

A trainer's rollout loop knows tool calls only, so the conversation is carried by them: the simulated user's
opening message is the episode's first user message, and the agent talks to the user through a
`reply_to_user(message)` tool whose result is the user's answer. The user is builder's `UserSimulator`, so the
leak guard and the ending are the rollouts': the user ends the conversation with its stop marker, and a user
that keeps leaking (or fails) voids the episode (`void`: no reward, as rollouts exclude `user_leak` and
`user_error` episodes from pass rates). Once the conversation has ended, every further tool call is refused:
the episode is over, as it is in `builder.rollout.episode` at `user_stop`.

The simulator is an async `ChatModel`; a private event loop on a daemon thread runs its calls, so a trainer's
synchronous tools can use it whether or not their thread already runs a loop.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Mapping, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar

from builder.config import RolloutConfig
from builder.llm import ChatModel, LLMClient, LLMError, OpenAIChatModel
from builder.records import ChatMessage, Sampling, Scenario
from builder.rollout.episode import USER_ERROR, USER_STOP
from builder.rollout.user_sim import UserSimulator
from builder.sandbox.world import DEFAULT_NOW

T = TypeVar("T")

REPLY_TOOL = "reply_to_user"
ENDED = "The user has ended the conversation. Answer with a short plain-text summary and no tool call."
REFUSED = "Error: the conversation has ended; the call was not run."
_DEFAULTS = RolloutConfig()


@dataclass(frozen=True)
class SimulatedUser:
    """Who plays the user of conversational episodes: a model and its sampling (the rollouts' defaults).

    `SimulatedUser.endpoint(base_url, model)` uses an OpenAI-compatible server (vLLM, …); any `ChatModel` works
    (tests use `builder.llm.ScriptedModel`).
    """

    model: ChatModel
    temperature: float = _DEFAULTS.user_temperature
    max_tokens: int = _DEFAULTS.max_reply_tokens
    retries: int = _DEFAULTS.user_retries
    seed: int = 0

    @classmethod
    def endpoint(cls, base_url: str, model: str, *, api_key: str = "local", **options: Any) -> SimulatedUser:
        """The simulator behind an OpenAI-compatible endpoint (`…/v1`), with builder's client retries."""
        return cls(LLMClient(OpenAIChatModel(base_url, model, api_key=api_key), model_id=model), **options)


class _Loop:
    """One event loop on a daemon thread, shared by every conversation of the process (the simulator's
    client keeps connections per loop)."""

    _lock = threading.Lock()
    _loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def run(cls, coroutine: Coroutine[Any, Any, T]) -> T:
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="builder-user-sim", daemon=True).start()
        future: Future[T] = asyncio.run_coroutine_threadsafe(coroutine, cls._loop)
        return future.result()


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


def scenario_from_row(row: Mapping[str, Any]) -> Scenario:
    """The `Scenario` record of a published `scenarios` row (JSON-text columns decoded)."""
    gold = [{"name": a["name"], "arguments": _json(a["arguments"])} for a in row.get("gold_actions") or ()]
    return Scenario.model_validate({
        "provenance": row.get("provenance") or {"config_hash": ""},
        "env_id": row["env_id"],
        "mode": row["mode"],
        "initial_state": _json(row.get("initial_state", row.get("initial_state_json"))),
        "now": row.get("now") or DEFAULT_NOW,
        "task": row["task"],
        "user": row.get("user"),
        "checklist": row.get("checklist") or (),
        "checks": _json(row["checks"]),
        "gold_actions": gold,
        "difficulty": row.get("difficulty") or "medium",
        "verification": _json(row.get("verification") or {}),
    })  # fmt: skip


class Conversation:
    """The simulated user of one conversational episode.

    `open()` gives the opening message (None when the simulator failed: the episode is void); `reply(message)`
    sends one agent message and returns what the agent's tool sees: the user's answer, or `ENDED` once the
    user stopped. `end_reason` is None while the conversation goes on, then `user_stop`, `user_leak` or
    `user_error`.
    """

    def __init__(
        self, user: SimulatedUser, scenario: Scenario, tool_names: Sequence[str], *, sample_index: int = 0
    ) -> None:
        sampling = Sampling(temperature=user.temperature, max_tokens=user.max_tokens, seed=user.seed + sample_index)
        self.simulator = UserSimulator(
            user.model, scenario, tool_names, sampling=sampling, retries=user.retries, sample_index=sample_index
        )
        self.messages: list[ChatMessage] = []  # the agent's view: user and assistant text turns
        self.end_reason: str | None = None
        self.detail = ""

    @property
    def ended(self) -> bool:
        return self.end_reason is not None

    @property
    def void(self) -> bool:
        """True when the user failed (leak, error): the episode says nothing about the agent."""
        return self.end_reason not in (None, USER_STOP)

    def open(self) -> str | None:
        """The user's first message, or None (and `end_reason` set) if the simulator gave none."""
        return self._turn()

    def reply(self, message: str) -> str:
        """Send the agent's `message` to the user; the user's answer, `ENDED`, or `REFUSED` after the end."""
        if self.ended:
            return REFUSED
        self.messages.append(ChatMessage(role="assistant", content=message))
        answer = self._turn()
        return ENDED if answer is None else answer

    def _turn(self) -> str | None:
        try:
            turn = _Loop.run(self.simulator.reply(tuple(self.messages)))
        except LLMError as error:  # the simulator's server is gone: the episode cannot go on
            self.end_reason, self.detail = USER_ERROR, str(error)[:500]
            return None
        if turn.stop or turn.failure or not turn.content:
            self.end_reason = USER_STOP if turn.stop else turn.failure or USER_ERROR
            self.detail = turn.detail
            return None
        self.messages.append(ChatMessage(role="user", content=turn.content))
        return turn.content
