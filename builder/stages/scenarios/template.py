"""The user's words for a sampled chain without a model: a plain first-person request written from the calls.

The chain already fixes what is done; what the user must say is the values the calls take that no earlier call
returns (the same marking the wording prompt shows: "the user must give it" vs "from call N"). The template
states each such value exactly as the call uses it, and names each state-changing call by its tool's name in
words (`freeze_account` -> "freeze account acc-1") with its docstring summary; each value is introduced by its
parameter's name in words (`account_id` -> "account"), so no identifier with an underscore appears. Values
from earlier results, which include every value the system creates, are never stated: the assistant finds them.

A read whose result the user wants to hear (`chain_facts.reported`: no later call takes it; the chain's answer
facts are its values) is asked for in its place among the changes: "tell me what you find when you list a doctor's
open slots: doctor D-11".

Conversational: `known_up_front` is the goal in general words (the changing tools' summaries), and
`reveal_when_asked` the values. The words go through the same leak and sufficiency gates as a model's.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from builder.records import Environment
from builder.stages.scenarios.chain import Chain, ChainCall
from builder.stages.scenarios.chain_facts import reported
from builder.stages.scenarios.emitted import Difficulty
from builder.stages.scenarios.verbalise import UserRequest

VERSION = "template@2"  # the template's version in provenance: bump when its wording changes


def template_request(env: Environment, chain: Chain, created: Sequence[str], difficulty: Difficulty) -> UserRequest:
    """The user's words for `chain` in `env`: the task and the user script; `created` are the values the system
    creates (`verbalise.created_values`), never stated."""
    summaries = {tool["function"]["name"]: _summary(tool["function"].get("description", "")) for tool in env.tools}
    changes = [call for call in chain.calls if call.changed]
    told = set(reported(chain.calls)) if chain.facts else set()
    steps = [
        _step(call, created) if call.changed else _report(call, created, summaries.get(call.name))
        for i, call in enumerate(chain.calls) if call.changed or i in told
    ]  # fmt: skip
    # Values a look-up takes from the user (a customer id, a search text) lead the assistant to the records.
    context = [
        value for i, call in enumerate(chain.calls) if not call.changed and i not in told
        for value in _given(call, created)
    ]  # fmt: skip
    about = f" It concerns {_join(list(dict.fromkeys(context)))}." if context else ""
    goals = [summaries.get(call.name) or _words(call.name) for call in changes]
    goal = _join(list(dict.fromkeys(goals)))
    return UserRequest(
        task=f"Hello. Please {'; then '.join(steps)}.{about} Thank you.",
        user_profile=f"A user of the {env.name} system who writes short, plain requests.",
        known_up_front=f"I would like to {goal}.",
        reveal_when_asked=f"The details: {'; then '.join(steps)}.{about}",
        ending="Stops once told every change is done" + (" and what was asked." if told else "."),
        difficulty=difficulty,
    )


def _step(call: ChainCall, created: Sequence[str]) -> str:
    """`freeze account: account acc-1`, `transfer: source acc-1, target acc-2, amount 3000`."""
    given = _given(call, created)
    name = _words(call.name)
    return f"{name}: {', '.join(given)}" if given else name


def _report(call: ChainCall, created: Sequence[str], summary: str | None) -> str:
    """`tell me what you find when you list a doctor's open slots: doctor D-11`."""
    given = _given(call, created)
    what = f"tell me what you find when you {_imperative(summary or _words(call.name))}"
    return f"{what}: {', '.join(given)}" if given else what


def _imperative(summary: str) -> str:
    """A docstring summary in the imperative: "lists a provider's slots" -> "list a provider's slots"."""
    verb, _, rest = summary.partition(" ")
    if verb.endswith(("ches", "shes", "sses", "xes")):
        verb = verb[:-2]
    elif verb.endswith("s") and not verb.endswith("ss") and len(verb) > 3:
        verb = verb[:-1]
    return f"{verb} {rest}".strip()


def _given(call: ChainCall, created: Sequence[str]) -> list[str]:
    """What the user says for a call: each argument after its parameter in words. Every value no earlier call
    returns (an enum value and a flag too: they say what the user wants, though the gate does not ask for them),
    and a value a result gives that the user's world already holds (which account the money moves from), so the
    request is unambiguous; a value the system creates never."""
    said = []
    for parameter, value in call.arguments.items():
        if call.sources.get(parameter, "state").startswith("result ") and _mentions(value, created):
            continue
        said.append(f"{_words(parameter)} {_value(value)}".strip())
    return said


def _mentions(value: Any, created: Sequence[str]) -> bool:
    text = json.dumps(value, ensure_ascii=False)
    return any(item in text for item in created)


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


def _words(identifier: str) -> str:
    """An identifier in words, without a trailing `id` (`account_id` -> "account", `freeze_account` ->
    "freeze account"); empty words are dropped, so no underscore is left."""
    words = [word for word in identifier.split("_") if word]
    if len(words) > 1 and words[-1].lower() == "id":
        words = words[:-1]
    return " ".join(words).lower()


def _summary(description: str) -> str:
    """A docstring's first sentence, lower-cased at its start and without its full stop: "move money between
    two accounts"."""
    first = description.strip().split("\n", 1)[0].strip().rstrip(".")
    return first[:1].lower() + first[1:]


def _join(parts: Sequence[str]) -> str:
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
