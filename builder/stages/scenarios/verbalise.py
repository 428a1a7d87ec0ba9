"""Verbalising a sampled chain: the model writes what the user says (the request, the user script) for a chain
whose gold actions and checks are already fixed and verified; the model's quality cannot touch them.

A reply is refused, and re-asked with the reasons (`builder.llm.reask`, through the stage's `repaired`), when
- it is no valid JSON object of the fields asked for (`request_invalid`);
- it names what a user cannot know (`request_leaks`): a value the chain creates (an id-like string of a call's
  result or the final state that the initial state does not hold: a new record's id, a generated code, a
  timestamp), or a tool's name. Values of the initial state are the user's world and may be named;
- in some mode, what the user says leaves a literal argument of the chain ungrounded (`task_underspecified`,
  the sufficiency rule of `sufficiency`): the assistant would have to guess it.

The request is sent as a plain chat request with the response format attached, not through `structured`, so
the loop sees every reply (invalid ones too) and the cost of each: the graph method's model usage is what these
requests cost (`Spent`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from builder.envs.signatures import tool_defaults
from builder.limits import DETAIL_CHARS
from builder.llm import ChatRequest, LLMRequestError, PromptTooLongError, Reply
from builder.llm.errors import LLMError
from builder.llm.parsing import parse_structured, response_format
from builder.llm.reask import Refusal
from builder.prompts import prompt
from builder.records import ChatMessage, Environment
from builder.run.stage import Rejected, StageContext
from builder.stages._llm import repaired, shrinking, system_user
from builder.stages.scenarios.chain import Chain
from builder.stages.scenarios.chain_facts import reported
from builder.stages.scenarios.derived_checks import CheckItem
from builder.stages.scenarios.requests import _sampling
from builder.stages.scenarios.sufficiency import unsupported_arguments
from builder.usage import Usage
from builder.views.budget import PromptBudget, prompt_budgets
from builder.views.code import environment_text, now_text
from builder.views.state import involved_state, state_text

PROMPT = "scenario_request"
_ISO_DAY = re.compile(r"\d{4}-\d\d-\d\d")
_ISO_MINUTE = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d")
_ISO_SECOND = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d")
_NAME_OF_A_FIELD = re.compile(r"[a-z]+(?:_[a-z]+)+")  # `time_slot`, `dose_log`: a key or a kind, not a created value
_ID_LIKE = re.compile(r"^(?=.*[\d_\-])[\w\-.:]{2,80}$")  # one token with a digit, `_` or `-`: an id, a code, a date
_FENCE = re.compile(r"```(?:json)?\s*\n(.*?)\n\s*```", re.DOTALL)


class UserRequest(BaseModel):
    """What the user says for a chain (string caps close every string of a constrained decoder)."""

    task: str = Field(description="The user's full request, first person.", max_length=1200)
    user_profile: str = Field(max_length=600)
    known_up_front: str = Field(max_length=600)
    reveal_when_asked: str = Field(max_length=600)
    ending: str = Field(max_length=300)
    difficulty: Literal["easy", "medium", "hard"]


@dataclass
class Spent:
    """Model usage of the graph method's requests (mutable: every reply adds to it), and why replies were refused."""

    usage: Usage = Usage()
    refused: list[str] = field(default_factory=list)


def user_texts(request: UserRequest, modes: Sequence[str]) -> dict[str, str]:
    """What the user says in each mode (the sufficiency gate's text): the task, or the user script."""
    said = {
        "non_conversational": request.task,
        "conversational": f"{request.known_up_front}\n{request.reveal_when_asked}",
    }
    return {mode: said[mode] for mode in modes}


def created_values(chain: Chain, now: str) -> list[str]:
    """Id-like strings the chain's results or final state hold and its initial state does not, sorted: values
    only the system sets, which no user knows before the calls (the scenario's own date-time excepted, and a value
    the user gives a call, with the day of a date-time: a date the user picks that a result repeats)."""
    before = _values(chain.initial_state)
    after = _values(chain.final_state) | {s for call in chain.calls for s in _values(call.result)}
    states_and_results = (chain.initial_state, chain.final_state, *(call.result for call in chain.calls))
    given = {
        value
        for call in chain.calls
        for parameter, argument in call.arguments.items()
        if not call.sources.get(parameter, "state").startswith("result ")
        for value in _values(argument)
    }
    given |= {value[:10] for value in given if _ISO_DAY.match(value)}
    given |= {value + ":00" for value in given if _ISO_MINUTE.fullmatch(value)}
    given |= {value[:16] for value in given if _ISO_SECOND.fullmatch(value)}  # the user's time as the system stores it
    known = before | given | {now, now[:10]} | set().union(*map(_field_names, states_and_results))
    return sorted(value for value in after - known if _ID_LIKE.match(value) and not _NAME_OF_A_FIELD.fullmatch(value))


def leaks(request: UserRequest, created: Sequence[str], tool_names: Sequence[str]) -> list[str]:
    """What the user's words name that a user cannot know: created values and tool names (case-insensitive,
    as whole tokens)."""
    text = " ".join(
        [request.task, request.user_profile, request.known_up_front, request.reveal_when_asked, request.ending]
    )
    problems = [
        f"it names {value!r}, which the user cannot know: the system creates it during the calls"
        for value in created
        if _names(text, value)
    ]
    problems += [
        f"it names the tool {name!r}; a user does not know the tools"
        for name in tool_names
        if "_" in name and _names(text, name)
    ]
    return problems


def parse_reply(text: str | None) -> UserRequest:
    """The reply's JSON object: the whole reply, or else its last fenced block (a capable model writes prose
    around it). Raises ValueError with a message for the model."""
    try:
        return parse_structured(text, UserRequest)
    except ValueError as error:
        blocks = _FENCE.findall(text or "")
        if not blocks:
            raise
        first = error
    try:
        return parse_structured(blocks[-1], UserRequest)
    except ValueError as error:
        raise ValueError(f"{error} (and the whole reply: {first})") from None


async def verbalise(
    env: Environment, ctx: StageContext, chain: Chain, items: Sequence[CheckItem], now: str, spent: Spent
) -> UserRequest:
    """The user's words for `chain` that pass the leak and sufficiency gates, asked for at most
    `scenarios.repair_attempts + llm.structured_retries + 1` times; the prompt built smaller while too long.

    Raises:
        Rejected: every reply was refused (its last reason: request_invalid, request_leaks,
            task_underspecified), or the request failed (llm_request, also after every retry; prompt_too_long).
        ServerUnreachable: no server ever answered this client; the run stops and can resume.
    """
    config = ctx.config.scenarios
    created = created_values(chain, now)
    names = [tool["function"]["name"] for tool in env.tools]
    defaults = tool_defaults(env.code)
    attempts = config.repair_attempts + ctx.config.llm.structured_retries + 1

    async def at(budget: PromptBudget) -> UserRequest:
        messages = system_user(prompt(PROMPT), request_text(env, chain, items, now, created, budget))
        first = ChatRequest(
            messages=tuple(messages), response_format=response_format(UserRequest), sampling=_sampling(ctx)
        )

        async def ask_once(conversation: list[ChatMessage], sample: int) -> UserRequest | Refusal:
            reply = await _chat(ctx, env, first.resampled(sample, conversation), spent)
            try:
                request = parse_reply(reply.content)
            except ValueError as error:
                feedback = f"Your reply was not valid: {error}. Answer with the JSON object."
                return _refused(spent, "request_invalid", str(error), reply.content, feedback)
            refused = refusal(request, created, names, chain, config.modes, env.tools, now, defaults)
            if refused is None:
                return request
            reason, problems = refused
            feedback = (
                "This reply was refused:\n- " + "\n- ".join(problems) + "\nA value the calls take that no earlier "
                "call returns must be stated by the user, exactly as the call uses it; a value the system creates "
                "must never be. Reply with the corrected JSON object."
            )
            return _refused(spent, reason, "; ".join(problems), request.model_dump_json(), feedback)

        return await repaired(ctx, env, messages, ask_once, attempts=attempts)

    return await shrinking(ctx, PROMPT, prompt_budgets(ctx.config.llm.max_state_chars), at)


def refusal(
    request: UserRequest, created: Sequence[str], tool_names: Sequence[str], chain: Chain, modes: Sequence[str],
    tools: Sequence[dict[str, Any]], now: str, defaults: Mapping[str, Mapping[str, Any]],
) -> tuple[str, list[str]] | None:  # fmt: skip
    """Why the user's words for `chain` fail the gates (`request_leaks` or `task_underspecified`, and the
    problems), or None when they pass: the one gate for the model's words and the template's."""
    problems = leaks(request, created, tool_names)
    if problems:
        return "request_leaks", problems
    results = [call.result for call in chain.calls]
    problems = [
        f"{_WHERE[mode]} does not give {problem}"
        for mode, text in user_texts(request, modes).items()
        for problem in unsupported_arguments(chain.actions, results, text, tools, now, defaults)
    ]
    return ("task_underspecified", problems) if problems else None


_WHERE = {"non_conversational": "the task", "conversational": "the user script (known_up_front, reveal_when_asked)"}


def request_text(
    env: Environment, chain: Chain, items: Sequence[CheckItem], now: str, created: Sequence[str], budget: PromptBudget
) -> str:
    """The verbalisation request: the environment, `Now`, the records involved, the calls (each argument with
    where it comes from), the changes and the values the system creates."""
    involved = involved_state(chain.initial_state, list(chain.actions))
    lines = []
    told = set(reported(chain.calls)) if chain.facts else set()
    for number, call in enumerate(chain.calls, 1):
        lines.append(f"{number}. {call.name}({json.dumps(call.arguments, ensure_ascii=False)})")
        for parameter, value in call.arguments.items():
            origin = call.sources.get(parameter, "state")
            where = f"from call {origin.split()[1]}" if origin.startswith("result ") else "the user must give it"
            if origin == "schema" or isinstance(value, bool):
                where = "a choice the tool lists: the user's wish implies it, no need to name the value"
            lines.append(f"   - {parameter} = {json.dumps(value, ensure_ascii=False)}: {where}")
        result = json.dumps(call.result, ensure_ascii=False)
        limit = budget.result_chars
        lines.append(f"   result: {result if len(result) <= limit else result[:limit] + ' …'}")
        if number - 1 in told and (facts := [f for f in chain.facts if f in result]):
            lines.append(f"   the user asks to be told this result; the answer will state {', '.join(facts)} "
                         "(the user never says these values)")  # fmt: skip
    changes = "\n".join(f"- {item.describe()}" for item in items if item.kind != "untouched")
    return (
        f"# Environment {env.name} ({env.domain})\n{environment_text(env.description, env.code)}\n\n"
        f"## Now\n{now_text(now)}\n\n"
        f"## Records the calls involve (before the calls; other records exist)\n{state_text(involved, budget)}\n\n"
        f"## The calls, in order\n" + "\n".join(lines) + "\n\n"
        f"## What changes (nothing else may)\n{changes}\n\n"
        f"## Values the user cannot know (the system creates them)\n{', '.join(created) or '(none)'}\n\n"
        "Write what the user says."
    )


async def _chat(ctx: StageContext, env: Environment, request: ChatRequest, spent: Spent) -> Reply:
    """One reply, its cost added to `spent`; a refused or too long request becomes a rejection (as `ask`)."""
    try:
        reply = await ctx.llm.chat(request)
    except PromptTooLongError as error:
        spent.usage += error.cost
        raise Rejected(ctx.reject(env, "prompt_too_long", str(error)[:DETAIL_CHARS])) from error
    except LLMRequestError as error:  # also after every retry (the status is in the message)
        spent.usage += error.cost
        raise Rejected(ctx.reject(env, "llm_request", str(error)[:DETAIL_CHARS])) from None
    except LLMError as error:
        spent.usage += error.cost
        raise
    spent.usage += reply.cost
    return reply


def _refused(spent: Spent, reason: str, detail: str, shown: str | None, feedback: str) -> Refusal:
    spent.refused.append(reason)
    return Refusal(reason, detail[:DETAIL_CHARS], feedback, shown=shown or "", raw=(shown or "")[:20000])


def _field_names(value: Any) -> set[str]:
    """The keys of a JSON value's objects that are fields, not record keys (a key whose value is an object, which
    `_values` counts as a value): a result naming a field (`"updated": ["time_slot"]`) names no value."""
    if isinstance(value, dict):
        fields = {key for key, item in value.items() if not isinstance(item, dict)}
        return fields.union(*map(_field_names, value.values()))
    if isinstance(value, list):
        return set().union(*map(_field_names, value))
    return set()


def _values(value: Any) -> set[str]:
    """The strings of a JSON value and the keys of its records (a key whose value is an object): its values, not
    its field names."""
    if isinstance(value, dict):
        keys = {key for key, item in value.items() if isinstance(key, str) and isinstance(item, dict)}
        return keys.union(*map(_values, value.values()))
    if isinstance(value, list):
        return set().union(*map(_values, value))
    return {value} if isinstance(value, str) else set()


def _names(text: str, value: str) -> bool:
    return re.search(rf"(?<![\w\-]){re.escape(value)}(?![\w\-])", text, re.IGNORECASE) is not None
