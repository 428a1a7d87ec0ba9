"""The answer check: when a task asks to be told something, the agent's answer must state the values the gold
solution's reads returned (a scenario's `answer_facts`).

The answer is everything the agent said in plain text during the episode (`agent_answer`): its assistant
messages' text and, in a conversational episode played through a tool, what it sent with `reply_to_user`. A fact
is stated when it appears in that text under these rules (`states`), so a trainer's reward does not depend on
how the agent formats a value:

- case, accents and punctuation do not matter: text is compared as a sequence of letter/digit words, and a
  fact's words must appear in order, next to each other ("dual_monitor" is stated by "dual monitor", "D-522" by
  "d 522" or "D-522"); digit words compare as numbers ("09" is "9");
- a number is stated by the same number in any notation ("1250", "1,250.00", "$1,250");
- a date (ISO `2025-03-14`) is stated in ISO form, as day and month names in either order ("March 14", "14th of
  Mar 2025"; a year given next to it must be the fact's) or numerically (3/14/2025, 14.03.2025); a date-time
  also needs its time when that is not midnight ("09:20", "9:20 am", "9 AM" for 09:00; seconds are ignored).

A fact the agent could only have guessed is not stated: each fact must also be in what the tools returned during
the episode (`seen`, `tool_text`), except a missing_info scenario's, which names the value the user left out and
is stated by that name, its head word (singular or plural) or a word that asks for that kind of value (`names`,
`ASKED_AS`: "which day" names "new end date", "how long" names "extra months"). An
infeasible scenario's answer (and a policy_trap scenario's non-conversational one) must decline instead
(`declines`: "cannot", "unable", "unfortunately", ...), after reading what makes the request impossible: its
facts must be in what the tools returned, though the answer need not repeat them ("it has already started" is a
good reason without the start date). So an answer that claims success while the state is unchanged, or a
refusal made without looking, earns nothing; nor does one that must decline or name a missing value but
claims success (`claims_success`). A whole number of 100 or more is also stated as a currency amount
of its hundredth ("$706.00" states 70600, the cents a tool returned). `answer_check(row)` reads these rules off a
scenario (its `answer_facts`, `family` and `mode`), the same way on every path.

The check is deterministic string matching on data, not code: it runs in the calling process.
"""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import date, datetime
from typing import Any

from builder.envs.conversation import REPLY_TOOL

MONTHS = (
    "january", "february", "march", "april", "may", "june", "july", "august", "september", "october", "november",
    "december",
)  # fmt: skip
_WORD = re.compile(r"[0-9a-z]+")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")
_PLAIN_NUMBER = re.compile(r"[-+]?(?:[$€£]\s*)?\d[\d,]*(?:\.\d+)?%?")
_ISO_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[T ](\d{2}):(\d{2})(?::(\d{2})(?:\.\d+)?)?)?$")


def fold(text: str) -> str:
    """Casefolded, accents removed (NFKD without combining marks)."""
    decomposed = unicodedata.normalize("NFKD", text)
    return "".join(char for char in decomposed if not unicodedata.combining(char)).casefold()


def words(text: str) -> list[str]:
    """The letter/digit words of `text`, folded; digit words without leading zeros."""
    return [word.lstrip("0") or "0" if word.isdigit() else word for word in _WORD.findall(fold(text))]


def states(answer: str, fact: str) -> bool:
    """Whether `answer` states `fact` (the rules in the module docstring)."""
    fact = fact.strip()
    if not fact:
        return True
    if (number := _as_number(fact)) is not None:
        return number in _numbers(answer) or (number.is_integer() and abs(number) >= 100
                                               and number / 100 in _money(answer))  # fmt: skip
    said = words(answer)
    if _contains(said, words(fact)):
        return True
    if (moment := _as_moment(fact)) is not None:
        return _states_moment(answer, said, *moment)
    return False


DECLINE_CUES = (
    "cannot", "can't", "can not", "couldn't", "could not", "unable", "not able", "not possible", "isn't possible",
    "impossible", "not allowed", "isn't allowed", "not permitted", "won't be able", "unfortunately", "sorry",
    "i'm afraid", "no longer", "was not", "wasn't", "did not", "didn't", "is full", "fully booked", "not eligible",
    "isn't eligible", "ineligible", "already started", "too early", "too late",
)  # fmt: skip
# What claims the request was carried out: an answer that must decline or ask must not say it (a decline cue
# beside "you're booked" does not make a claim of success a refusal).
SUCCESS_CUES = (
    "all set", "all done", "successfully", "you're booked", "you are booked", "you're all booked", "i've booked",
    "i have booked", "has been updated", "have been updated", "i've updated", "i have updated", "has been changed",
    "have been changed", "i've changed", "i have changed", "i've cancelled", "i have cancelled", "done!",
)  # fmt: skip
_NEGATORS = frozenset({"nothing", "not", "no", "never", "haven't", "hasn't", "wasn't", "isn't", "couldn't", "can't",
                       "cannot", "won't", "didn't", "without"})  # fmt: skip


@dataclass(frozen=True)
class AnswerCheck:
    """What a scenario asks of the agent's answer: `facts` to state, each also `grounded` in what the tools
    returned during the episode, and whether it must decline (`declines`). Empty: it asks nothing."""

    facts: tuple[str, ...] = ()
    grounded: bool = True
    declines: bool = False
    named: bool = False  # the facts name what is missing (`names`), not values to state

    def __bool__(self) -> bool:
        return bool(self.facts) or self.declines

    def grade(self, answer: str, seen: str) -> tuple[bool | None, tuple[str, ...]]:
        """(passed, what is missing: unstated or unread facts, "a decline"); passed is None when it asks nothing."""
        if not self:
            return None, ()
        if self.declines:  # a decline must rest on what the agent read; it need not repeat the values
            missing = [f for f in self.facts if not states(seen, f)]
        else:
            said = names if self.named else states
            missing = [f for f in self.facts if not said(answer, f) or (self.grounded and not states(seen, f))]
        if self.declines and not declines(answer):
            missing.append("a decline (the request cannot be done)")
        if (self.declines or self.named) and claims_success(answer):
            missing.append("no claim of success (nothing was to be done)")
        return not missing, tuple(missing)


NOTHING_ASKED = AnswerCheck()  # a scenario that asks nothing of the answer


def answer_check(scenario: Mapping[str, Any] | Any) -> AnswerCheck:
    """The answer rules of a scenario (a `Scenario` or a published row): its `answer_facts`; grounded unless it is
    a missing_info scenario's non-conversational row (its fact names what the user left out); declining for an
    infeasible one and a policy_trap scenario's non-conversational row (it changes nothing and says why)."""
    row = scenario if isinstance(scenario, Mapping) else scenario.model_dump()
    facts = row.get("answer_facts") or ()
    facts = json.loads(facts) if isinstance(facts, str) else facts
    family, mode = row.get("family") or "plain", row.get("mode")
    one_shot = mode == "non_conversational"
    named = family == "missing_info" and one_shot
    declining = family == "infeasible" or (family == "policy_trap" and one_shot)  # no change without a yes
    return AnswerCheck(tuple(facts), grounded=not named, declines=declining, named=named)


def names(answer: str, missing: str) -> bool:
    """Whether the answer names a missing value: its whole name (`states`), the name's head word (its last word of
    three letters or more, singular or plural: "date" of "new end date"), a word asking for that kind of value
    (`ASKED_AS`: "which day", "how long"), or for a date, dates offered to choose from."""
    if states(answer, missing):
        return True
    head = next((word for word in reversed(words(missing)) if len(word) >= 3 and not word.isdigit()), None)
    if head is None:
        return False
    said = {_singular(word) for word in words(answer)}
    cues = next((kind for kind in ASKED_AS if _singular(head) in kind), {_singular(head)})
    if cues is ASKED_AS[0] and (said & _CALENDAR or _ISO_IN_TEXT.search(answer)):
        return True  # dates offered to choose from ("18 February or 4 March: which one?") ask for the date
    return bool(said & cues) or any(phrase in fold(answer) for phrase in cues if " " in phrase)


# Month and weekday names that mark a date in an answer ("may" is left out: "you may ...").
_CALENDAR = frozenset(MONTHS) - {"may"} | {"monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday"}
_ISO_IN_TEXT = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# The words that ask for a value of one kind: the head word of a missing value's name in one of these sets is
# named by any of them ("which day" asks for "the new date", "how long" for "extra months").
ASKED_AS = (
    frozenset({"date", "day", "when", "deadline"}),
    frozenset({"time", "hour", "when"}),
    frozenset({"month", "week", "night", "duration", "length", "period", "how long"}),
    frozenset({"amount", "price", "payment", "sum", "cost", "fee", "how much"}),
    frozenset({"quantity", "number", "count", "unit", "how many"}),
    frozenset({"email", "mail", "address"}),
)


def _singular(word: str) -> str:
    return word[:-1] if word.endswith("s") and not word.endswith("ss") and len(word) > 3 else word  # not "address"


def declines(answer: str) -> bool:
    """Whether the answer says the request cannot be done (one of `DECLINE_CUES`)."""
    return next(_cues(answer, DECLINE_CUES), None) is not None  # a cue may open the answer: "" before it


def claims_success(answer: str) -> bool:
    """Whether the answer says the request was carried out (one of `SUCCESS_CUES`, not after a negation:
    "nothing has been changed" claims nothing)."""
    return any(
        not _NEGATORS.intersection(re.findall(r"[a-z']+", before)[-3:]) for before in _cues(answer, SUCCESS_CUES)
    )


def _cues(answer: str, cues: Iterable[str]) -> Iterator[str]:
    """For each place the answer (folded, curly apostrophes straightened) says one of `cues` as whole words, the
    text before it."""
    text = fold(answer).replace("\u2019", "'")
    for cue in cues:
        for match in re.finditer(rf"(?<![a-z]){re.escape(cue)}(?![a-z])", text):
            yield text[: match.start()]


def tool_text(messages: Iterable[Mapping[str, Any]]) -> str:
    """What the tools returned in an episode's OpenAI-format messages (the tool messages' content)."""
    return "\n".join(str(m.get("content") or "") for m in messages if m.get("role") == "tool")


def agent_answer(messages: Iterable[Mapping[str, Any]]) -> str:
    """What the agent said in an episode's OpenAI-format messages: every assistant message's text and every
    `reply_to_user` message, one per line."""
    said: list[str] = []
    for message in messages:
        if message.get("role") != "assistant":
            continue
        if isinstance(message.get("content"), str) and message["content"].strip():
            said.append(message["content"].strip())
        for call in message.get("tool_calls") or []:
            function = call.get("function", call) if isinstance(call, Mapping) else {}
            if function.get("name") == REPLY_TOOL:
                said.append(_reply_text(function.get("arguments")))
    return "\n".join(text for text in said if text)


def gold_answer(facts: Sequence[str], *, declining: bool = False) -> str:
    """An answer stating every fact (declining when it must), as the reward audit's gold agent says it."""
    opening = "Unfortunately I cannot do that." if declining else "Done."
    return f"{opening} " + "; ".join(facts) if facts or declining else ""


def natural_answer(facts: Sequence[str], *, declining: bool = False) -> str:
    """An answer stating every fact as a person would write it: dates and times in words, numbers with
    thousands separators, identifiers with spaces for underscores."""
    return gold_answer([natural(fact) for fact in facts], declining=declining).replace("Done.", "All set:", 1)


def natural(fact: str) -> str:
    """One fact as a person would write it (`natural_answer`)."""
    if (number := _as_number(fact)) is not None:
        return f"{number:,.2f}".rstrip("0").rstrip(".") if number != int(number) else f"{int(number):,}"
    if (moment := _as_moment(fact)) is not None:
        day, time = moment
        said = f"{MONTHS[day.month - 1].capitalize()} {day.day}, {day.year}"
        if time is not None:
            hour, minute = time
            said += f" at {hour % 12 or 12}:{minute:02d} {'AM' if hour < 12 else 'PM'}"
        return said
    return fact.replace("_", " ")


def _reply_text(arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return arguments
    return str(arguments.get("message", "")) if isinstance(arguments, Mapping) else ""


def _contains(said: Sequence[str], wanted: Sequence[str]) -> bool:
    if not wanted:
        return False
    width = len(wanted)
    return any(list(said[start : start + width]) == list(wanted) for start in range(len(said) - width + 1))


def is_number(fact: str) -> bool:
    """Whether the fact is a number (compared by value: "1250" is stated by "1,250.00")."""
    return _as_number(fact) is not None


def _as_number(fact: str) -> float | None:
    if not _PLAIN_NUMBER.fullmatch(fact.strip()):
        return None
    return _to_float(re.sub(r"[^\d.\-]", "", fact))


def _numbers(answer: str) -> set[float]:
    found = (_to_float(match.replace(",", "")) for match in _NUMBER.findall(answer))
    return {number for number in found if number is not None}


_MONEY = re.compile(r"[$€£]\s*(\d[\d,]*(?:\.\d+)?)|(\d[\d,]*(?:\.\d+)?)\s*(?:dollars|euros|pounds|usd|eur|gbp)\b", re.I)


def _money(answer: str) -> set[float]:
    """The currency amounts of an answer ("$706.00", "706 dollars"): a fact in cents (70600) is stated by them."""
    found = (_to_float(a or b) for a, b in _MONEY.findall(answer))
    return {number for number in found if number is not None}


def _to_float(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def _as_moment(fact: str) -> tuple[date, tuple[int, int] | None] | None:
    """The date of an ISO date or date-time fact, and its (hour, minute) when that is not midnight."""
    match = _ISO_DATE.match(fact.strip())
    if match is None:
        return None
    year, month, day, hour, minute = (int(part) if part else None for part in match.groups()[:5])
    try:
        when = datetime(year, month, day, hour or 0, minute or 0)  # type: ignore[arg-type]
    except ValueError:
        return None
    time = (when.hour, when.minute) if (when.hour, when.minute) != (0, 0) else None
    return when.date(), time


def _states_moment(answer: str, said: Sequence[str], day: date, time: tuple[int, int] | None) -> bool:
    return _states_date(answer, said, day) and (time is None or _states_time(said, *time))


def _states_date(answer: str, said: Sequence[str], day: date) -> bool:
    y, m, d = str(day.year), str(day.month), str(day.day)
    if any(_contains(said, order) for order in ([y, m, d], [m, d, y], [d, m, y])):
        return True
    names = {MONTHS[day.month - 1], MONTHS[day.month - 1][:3], MONTHS[day.month - 1][:4]}
    text = fold(answer)
    month = "|".join(sorted(names, key=len, reverse=True))
    patterns = (
        rf"\b(?:{month})\.?\s+0?{d}(?:st|nd|rd|th)?\b(?:,?\s+(\d{{4}}))?",
        rf"\b0?{d}(?:st|nd|rd|th)?\s+(?:of\s+)?(?:{month})\b\.?(?:,?\s+(\d{{4}}))?",
    )
    for pattern in patterns:
        for match in re.finditer(pattern, text):
            if match.group(1) in (None, y):
                return True
    return False


def _states_time(said: Sequence[str], hour: int, minute: int) -> bool:
    twelve, mm = str(hour % 12 or 12), str(minute)
    forms = [[str(hour), mm]]
    for suffix in (["am"], ["a", "m"]) if hour < 12 else (["pm"], ["p", "m"]):
        forms += [[twelve, mm, *suffix], [twelve, f"{minute:02d}{suffix[0]}", *suffix[1:]]]
        if minute == 0:
            forms += [[twelve, *suffix], [twelve + suffix[0], *suffix[1:]]]
    return any(_contains(said, form) for form in forms)
