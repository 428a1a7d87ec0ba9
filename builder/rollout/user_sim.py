"""The user simulator of conversational scenarios: an LLM playing the scenario's `UserScript`, with a leak guard.

The simulator sees the conversation role-inverted (the agent's text turns are its `user` messages; tool traffic
is hidden from it, as from a real user) and ends the conversation by answering with the stop marker: its prompt
gives that as the only way to end, and a reply holding the marker ends the episode (the rest of that reply is
dropped, as the prompt tells it; a farewell around the marker is therefore harmless). Every reply
passes `leak_problem` first: a reply that recites the checklist, names tools or check code, or dumps the
ask-only details into the opening message is re-asked with the problem fed back, and after
`rollout.user_retries` re-asks the episode ends as `user_leak` (void: neither SFT nor pass rates use it).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from string import Template

from builder.llm import ChatModel, ChatRequest, LLMRequestError
from builder.llm.reask import NoUsableReply, Refusal, reask
from builder.prompts import prompt
from builder.records import ChatMessage, Sampling, Scenario
from builder.rollout.episode import USER_ERROR, USER_LEAK, UserTurn
from builder.sandbox.world import describe_now
from builder.usage import Usage

EMPTY_REPLY = "the reply was empty"

STOP = "###STOP###"
GREETING = "Hello! How can I help you today?"
_WORD = re.compile(r"[a-z0-9]+")
# A reply is a wholesale leak of a text when this share of that text's words (as a set) appears in it.
LEAK_CONTAINMENT = 0.8
# Texts shorter than this many distinct words are too generic to call a leak.
MIN_LEAK_WORDS = 4


def _words(text: str) -> set[str]:
    return set(_WORD.findall(text.casefold()))


def _contained(part: str, whole_words: set[str]) -> bool:
    words = _words(part)
    return len(words) >= MIN_LEAK_WORDS and len(words & whole_words) / len(words) >= LEAK_CONTAINMENT


def _values(text: str) -> set[str]:
    """The specific values of a text: tokens holding a digit (ids, amounts, dates) and capitalised words that do
    not start a sentence (names)."""
    values = {token.casefold() for token in re.findall(r"[\w-]*\d[\w-]*", text)}
    values |= {m.group(1).casefold() for m in re.finditer(r"(?<![.!?]\s)(?<!^)\b([A-Z][a-z]+)", text.strip())}
    return values


def leak_problem(text: str, scenario: Scenario, tool_names: Sequence[str], *, opening: bool) -> str | None:
    """Why a user-simulator reply leaks what a real user would not say, or None.

    Leaks: the checklist wholesale (at least two items, or the only one, near verbatim); check code
    (`initial_state`/`final_state`, `def check`); a tool's name (dictating calls); and, in the opening message,
    the ask-only details all at once.
    """
    lowered = text.casefold()
    if "def check" in lowered or "final_state" in lowered or "initial_state" in lowered:
        return "it quotes the hidden check code"
    for name in tool_names:
        if re.search(rf"(?<![a-z0-9_]){re.escape(name.casefold())}(?![a-z0-9_])", lowered) and (
            "_" in name or re.search(rf"{re.escape(name.casefold())}\s*\(", lowered)
        ):
            return f"it names the tool {name!r}; a user does not know the system's functions"
    words = _words(text)
    recited = sum(_contained(item, words) for item in scenario.checklist)
    if recited >= min(2, len(scenario.checklist)) and recited:
        return "it recites the hidden checklist"
    if opening and scenario.user is not None:
        details = _values(scenario.user.reveal_when_asked)
        if len(details) >= 2 and details <= _values(text) | words:
            return "the opening message gives every detail that should only come when asked"
    return None


class UserSimulator:
    """Plays the user of one conversational scenario (implements `builder.rollout.episode.User`).

    Args:
        model: the simulator's model (may be the agent's client).
        scenario: a conversational scenario (with `user`).
        tool_names: the environment's tools, for the leak guard.
        sampling: the simulator's sampling.
        retries: re-asks after an empty or leaking reply.
    """

    def __init__(
        self,
        model: ChatModel,
        scenario: Scenario,
        tool_names: Sequence[str],
        *,
        sampling: Sampling,
        retries: int = 1,
        sample_index: int = 0,
    ) -> None:
        if scenario.user is None:
            raise ValueError(f"scenario {scenario.id} has no user script")
        self.model = model
        self.scenario = scenario
        self.tool_names = tuple(tool_names)
        self.sampling = sampling
        self.retries = retries
        self.sample_index = sample_index
        script = scenario.user
        self.system = Template(prompt("user_sim")).safe_substitute(
            profile=script.profile,
            task=scenario.task,
            known_up_front=script.known_up_front,
            reveal_when_asked=script.reveal_when_asked,
            ending=script.ending,
            stop=STOP,
            now=describe_now(scenario.now),
        )

    def history(self, messages: Sequence[ChatMessage]) -> list[ChatMessage]:
        """The conversation as the simulator sees it: roles swapped, tool traffic and the system prompt left out."""
        # The canned greeting stands for the agent's first turn, so the simulator's history starts with a
        # "user" message, as chat templates expect.
        view = [ChatMessage(role="system", content=self.system), ChatMessage(role="user", content=GREETING)]
        for message in messages:
            if message.role == "assistant" and message.content and message.content.strip():
                view.append(ChatMessage(role="user", content=message.content))
            elif message.role == "user":
                view.append(ChatMessage(role="assistant", content=message.content))
        return view

    async def reply(self, messages: Sequence[ChatMessage]) -> UserTurn:
        """The next user turn: a message, a stop, or a failure (`user_leak`, `user_error`).

        An empty or leaking reply is asked again (`retries` times) through `builder.llm.reask`: the history, the
        refused reply and why, each attempt a fresh sample."""
        opening = not any(message.role == "user" for message in messages)
        view = self.history(messages)
        first = ChatRequest(messages=tuple(view), sampling=self.sampling, sample_index=self.sample_index)
        spent = [Usage()]

        async def ask_once(conversation: list[ChatMessage], sample: int) -> UserTurn | Refusal:
            answer = await self.model.chat(first.resampled(sample, conversation))
            spent[0] += answer.cost
            text = (answer.content or "").strip()
            if STOP in text:  # the prompt's one ending rule: the marker ends the conversation, nothing else does
                return UserTurn(stop=True)
            leak = leak_problem(text, self.scenario, self.tool_names, opening=opening) if text else None
            if text and leak is None:
                return UserTurn(content=text)
            problem = leak or EMPTY_REPLY
            feedback = (
                f"(Stay in character. Your last reply is not usable: {problem}. Write it again as the user would.)"
            )
            return Refusal(USER_LEAK if leak else USER_ERROR, problem, feedback, shown=text)

        try:
            turn = await reask(view, ask_once, attempts=self.retries + 1)
        except LLMRequestError as error:  # also after every retry: this episode's user failed
            return UserTurn(failure=USER_ERROR, detail=str(error)[:500], usage=spent[0] + error.cost)
        except NoUsableReply as failed:
            return UserTurn(failure=failed.refusal.reason, detail=failed.refusal.detail, usage=spent[0])
        return dataclasses.replace(turn, usage=spent[0])
