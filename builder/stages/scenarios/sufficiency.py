"""Is a task solvable from what the user says? Every literal argument of the gold sequence must come from the
user's words, from an earlier call's result, or from the tool schema; otherwise the gold only works because it
was written with the state in view, and an agent (told never to guess) cannot solve the task.

"Comes from", per argument value (lists and dicts element-wise, dict keys are free):
- None, booleans, empty strings and the parameter's default are free (the agent chooses them);
- a reference to an earlier call's result (`"$2.loan.loan_id"`, `references`) is grounded by construction: the
  verifier resolved it against that result before this gate runs;
- a value of an `enum` in the parameter's schema is free (the schema lists it);
- a string of `COMPOSITION_WORDS` words or more is text the agent composes (a message, a note): free;
- a shorter string must appear in the sources, case-insensitively and not inside a longer token ("b3" is in
  "book b3", not in "b33"); a string of several words may also have each of its words somewhere in the
  sources ("Palmer Ada"); an ISO date also matches the same day written out ("July 15, 2024", "15 July");
- as people say them: a value's words (`_` and `-` separate words) may be said in another form of the same word
  ("dermatologist" for `dermatology`, "dual monitors" for `dual_monitor`: a shared stem of at least five
  letters, or the same word with an `s`), and a short id may be said as its name and number ("route 12" for
  `R-12`, "room 5" for `RM-05`: the id's letters, in order, spell out the start of the word before the number);
- a date may also be named relative to the scenario's `now` ("today", "tomorrow", "on Wednesday", "next Friday",
  "in 3 days", "in two weeks"), as the task prompt allows;
- a number must appear in the sources as a number, whatever its formatting ("2" and 2.0, "$1,200" and 1200); a
  money amount the user writes with a currency sign or two decimals ("$30", "30.00") also stands for its cents.

The sources of a call are the user's text (the mode's text), the results of the gold calls before it (strings,
numbers, dict keys) and the description of the parameter. Pure functions over JSON data.
"""

from __future__ import annotations

import ast
import datetime
import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from builder.json_values import record_pairs
from builder.records import Action
from builder.sandbox.world import parse_now
from builder.stages.scenarios.references import parse

COMPOSITION_WORDS = 4  # strings with this many words or more are composed by the agent, not identifiers
MAX_PROBLEMS = 6
_WORD = re.compile(r"\w+")
# A number on its own, or before a hyphenated word ("a 4-star review", "a 3-night stay"); not a part of an id or a
# date ("acc-1", "2025-03-14").
_NUMBER = re.compile(
    r"(?<![\w.\-])(?P<currency>[$€£]\s?)?(?P<whole>[-+]?\d{1,3}(?:,\d{3})+|[-+]?\d+)(?P<decimals>\.\d+)?(?!\w|-\d|\.\d)"
)
_MONEY_AFTER = re.compile(r"\s*(dollars?|euros?|pounds?|usd|eur|gbp|bucks)\b")
_NUMBER_WORDS = {
    word: value
    for value, word in enumerate("zero one two three four five six seven eight nine ten eleven twelve".split())
}
_MONTHS = {
    name: index
    for index, names in enumerate(
        [("jan", "january"), ("feb", "february"), ("mar", "march"), ("apr", "april"), ("may",), ("jun", "june"),
         ("jul", "july"), ("aug", "august"), ("sep", "sept", "september"), ("oct", "october"),
         ("nov", "november"), ("dec", "december")],
        start=1,
    )
    for name in names
}  # fmt: skip
_MONTH = "(" + "|".join(sorted(_MONTHS, key=len, reverse=True)) + r")\.?"
_DAY = r"(\d{1,2})(?:st|nd|rd|th)?"
_MONTH_DAY = re.compile(rf"\b{_MONTH}\s+{_DAY}\b(?:,?\s+(\d{{4}}))?")
_DAY_MONTH = re.compile(rf"\b{_DAY}\s+(?:of\s+)?{_MONTH}\b(?:,?\s+(\d{{4}}))?")
_RELATIVE_DAYS = {
    "today": 0, "tonight": 0, "this morning": 0, "this afternoon": 0, "this evening": 0, "tomorrow": 1,
    "yesterday": -1, "day after tomorrow": 2,
}  # fmt: skip
_WEEKDAYS = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_WEEKDAY = re.compile(rf"\b(?:(this|next|last|on|coming)\s+)?({'|'.join(_WEEKDAYS)})\b")
_IN_DAYS = re.compile(r"\bin\s+(\d+|" + "|".join(_NUMBER_WORDS) + r")\s+(days?|weeks?)\b")
_ISO_DATE = re.compile(r"^(\d{4})-(\d{2})-(\d{2})(?:[Tt ][\d:.]+(?:[Zz]|[+-]\d{2}:?\d{2})?)?$")


@dataclass
class Sources:
    """What the agent has seen: texts (casefolded), their words, and the numbers in them."""

    texts: list[str] = field(default_factory=list)
    words: set[str] = field(default_factory=set)
    numbers: list[float] = field(default_factory=list)
    dates: set[tuple[int, int, int | None]] = field(default_factory=set)

    def add_text(self, text: str, *, money: bool = True) -> None:
        folded = " ".join(text.casefold().split())
        if not folded:
            return
        self.texts.append(folded)
        self.words.update(_WORD.findall(folded))
        self.numbers.extend(_numbers(folded, money=money))
        self.dates.update(_written_dates(folded))

    def add_result(self, value: Any) -> None:
        """Every scalar of a tool result (dict keys included); numbers in its strings count, in its own units."""
        if isinstance(value, dict):
            for key, item in value.items():
                self.add_text(str(key), money=False)
                self.add_result(item)
        elif isinstance(value, list):
            for item in value:
                self.add_result(item)
        elif isinstance(value, bool) or value is None:
            return
        elif isinstance(value, int | float):
            self.numbers.append(float(value))
        else:
            self.add_text(str(value), money=False)

    def add_relative_dates(self, text: str, now: str) -> None:
        """The days a user names relative to `now` ("today", "tomorrow", "on Wednesday", "next Friday", "in 3
        days", "in two weeks"), as dates: the task prompt says dates count from `Now`, so they are the user's."""
        today = parse_now(now).date()
        folded = text.casefold()
        offsets = [offset for word, offset in _RELATIVE_DAYS.items() if re.search(rf"\b{word}\b", folded)]
        for match in _WEEKDAY.finditer(folded):
            ahead = (_WEEKDAYS.index(match[2]) - today.weekday()) % 7
            if match[1] == "last":
                offsets.append(ahead - 7 if ahead else -7)
            else:  # "on friday", "this friday", "next friday": the coming one, or the one after it
                offsets += [ahead, ahead + 7]
        for match in _IN_DAYS.finditer(folded):
            count = _NUMBER_WORDS.get(match[1]) if match[1] in _NUMBER_WORDS else int(match[1])
            offsets.append(count * (7 if match[2].startswith("week") else 1))
        for offset in offsets:
            day = today + datetime.timedelta(days=offset)
            self.dates.add((day.month, day.day, day.year))

    def copy(self) -> Sources:
        return Sources(list(self.texts), set(self.words), list(self.numbers), set(self.dates))


def _numbers(text: str, *, money: bool) -> list[float]:
    found = [float(value) for word, value in _NUMBER_WORDS.items() if re.search(rf"\b{word}\b", text)]
    for match in _NUMBER.finditer(text):
        value = float(match["whole"].replace(",", "") + (match["decimals"] or ""))
        found.append(value)
        decimals = match["decimals"] or ""
        if money and (match["currency"] or len(decimals) == 3 or _MONEY_AFTER.match(text, match.end())):
            found.append(round(value * 100))  # the same amount in cents, the unit environments keep money in
    return found


def _written_dates(text: str) -> set[tuple[int, int, int | None]]:
    dates = set()
    for match in _MONTH_DAY.finditer(text):
        dates.add((_MONTHS[match[1]], int(match[2]), int(match[3]) if match[3] else None))
    for match in _DAY_MONTH.finditer(text):
        dates.add((_MONTHS[match[2]], int(match[1]), int(match[3]) if match[3] else None))
    return dates


def _contains(texts: list[str], value: str) -> bool:
    """`value` occurs in one of `texts`, not as part of a longer word ("b3" is in "book b3." but not in "b33")."""
    left = r"(?<!\w)" if re.match(r"\w", value[0]) else ""
    right = r"(?!\w)" if re.match(r"\w", value[-1]) else ""
    pattern = re.compile(left + re.escape(value) + right)
    return any(pattern.search(text) for text in texts)


def _number_found(value: float, sources: Sources) -> bool:
    return any(math.isclose(value, seen, rel_tol=1e-9, abs_tol=1e-9) for seen in sources.numbers)


def _string_found(value: str, sources: Sources) -> bool:
    folded = " ".join(value.casefold().split())
    if _contains(sources.texts, folded):
        return True
    words = _WORD.findall(folded)
    if " " in folded and words and all(word in sources.words for word in words):
        return True
    iso = _ISO_DATE.match(folded)
    if iso:
        year, month, day = (int(part) for part in iso.groups())
        return (month, day, year) in sources.dates or (month, day, None) in sources.dates
    try:
        return _number_found(float(folded.replace(",", "")), sources)
    except ValueError:
        pass
    return _said_naturally(folded, sources)


_SPOKEN_ID = re.compile(r"^([a-z]{1,4})[-_ ]?0*(\d{1,6})$")
MIN_STEM = 5  # letters two forms of a word share at least ("dermatolog-y / -ist"); shorter words must be equal


def _said_naturally(folded: str, sources: Sources) -> bool:
    """`folded` said as people say it: every word in some form of it, or a short id as its name and number."""
    spoken = _SPOKEN_ID.match(folded)
    if spoken:
        letters, number = spoken.groups()
        name = letters[0] + "".join(rf"\w*{letter}" for letter in letters[1:])  # "rm": room, "r": route
        named = re.compile(rf"\b{name}\w*\.?\s+(?:no\.?\s*|number\s+|#\s*)?0*{number}\b")
        return any(named.search(text) for text in sources.texts)
    words = _WORD.findall(folded.replace("_", " ").replace("-", " "))
    return bool(words) and all(any(_same_word(word, seen) for seen in sources.words) for word in words)


def _same_word(word: str, other: str) -> bool:
    if word == other or word + "s" == other or other + "s" == word:
        return True
    shared = len(os.path.commonprefix([word, other]))
    return shared >= MIN_STEM and shared >= min(len(word), len(other)) - 3


def _enums(schema: Any) -> list[Any]:
    """Every enum value anywhere in a parameter's schema (unions and item schemas included)."""
    if isinstance(schema, dict):
        values = list(schema.get("enum") or ())
        return values + [value for key, sub in schema.items() if key != "enum" for value in _enums(sub)]
    if isinstance(schema, list):
        return [value for sub in schema for value in _enums(sub)]
    return []


def _unsupported(value: Any, path: str, schema: dict[str, Any], sources: Sources) -> list[tuple[str, Any]]:
    """The (path, value) pairs of `value` that come from nowhere the agent could know them."""
    if value is None or isinstance(value, bool) or value in _enums(schema) or value == schema.get("default", ...):
        return []
    if parse(value) is not None:  # resolved against an earlier result: the agent reads it there
        return []
    if isinstance(value, list):
        return [bad for i, item in enumerate(value) for bad in _unsupported(item, f"{path}[{i}]", schema, sources)]
    if isinstance(value, dict):
        return [bad for key, item in value.items() for bad in _unsupported(item, f"{path}.{key}", schema, sources)]
    if isinstance(value, int | float):
        return [] if _number_found(float(value), sources) else [(path, value)]
    text = str(value)
    if not text.strip() or len(_WORD.findall(text)) >= COMPOSITION_WORDS and len(text.split()) >= COMPOSITION_WORDS:
        return []
    return [] if _string_found(text, sources) else [(path, value)]


def unsupported_arguments(
    actions: Sequence[Action],
    results: Sequence[Any],
    text: str,
    tools: Sequence[dict[str, Any]],
    now: str | None = None,
    defaults: Mapping[str, Mapping[str, Any]] | None = None,
) -> list[str]:
    """One message per gold argument value that neither `text`, an earlier result nor the tool schema gives.

    Args:
        actions: the gold calls as written (references to earlier results are free: the caller resolved them).
        results: each call's JSON result, index for index (calls that were not run: None).
        text: what the user says (the task, or the user script of a conversation).
        tools: the environment's OpenAI tool schemas.
        now: the scenario's date-time, from which days the user names relatively ("tomorrow") are counted.
        defaults: `{tool: {parameter: default}}` (`builder.envs.schema.tool_defaults`): the schemas do not show
            defaults, and passing one is what leaving the argument out does.
    """
    parameters = {
        tool["function"]["name"]: tool["function"].get("parameters", {}).get("properties", {}) for tool in tools
    }
    sources, problems = Sources(), []
    sources.add_text(text)
    if now is not None:
        sources.add_relative_dates(text, now)
    for index, action in enumerate(actions):
        schemas = parameters.get(action.name, {})
        given = (defaults or {}).get(action.name, {})
        for name, value in action.arguments.items():
            if name in given and value == given[name]:
                continue
            schema = schemas.get(name) if isinstance(schemas.get(name), dict) else {}
            seen = sources
            if schema.get("description"):  # "kind: 'checking' or 'savings'": the schema names the vocabulary
                seen = sources.copy()
                seen.add_text(schema["description"], money=False)
            for path, bad in _unsupported(value, name, schema, seen):
                problems.append(f"call {index + 1} {action.name}: {path} = {bad!r}")
        if index < len(results):
            sources.add_result(results[index])
    return problems[:MAX_PROBLEMS]


def problem_value(problem: str) -> Any:
    """The argument value a message of `unsupported_arguments` names (as its `repr` wrote it)."""
    written = problem.rsplit(" = ", 1)[-1]
    try:
        return ast.literal_eval(written)
    except (SyntaxError, ValueError):
        return written


SEARCH_PARAMETERS = frozenset({"query", "q", "search", "keyword", "keywords", "term", "text"})


def looked_up_by(value: Any, state: Mapping[str, Any], text: str, tools: Sequence[dict[str, Any]]) -> str | None:
    """A detail the user gives by which a tool can find `value`, or None: a distinctive field (a name or title of
    several words, an e-mail) of a record of `state` that holds `value` (as its key or in a field), said in
    `text`, where some tool takes that field (a parameter of its name) or a search text. A solution that uses such
    a value without looking it up is wrong, not the task (teacher-16: a task naming "the Hanalei Bay Restorative
    Yoga retreat" was rewritten to quote its id R-1 because the solution skipped the search)."""
    wanted = str(value)
    parameters = {name for tool in tools for name in tool["function"].get("parameters", {}).get("properties", {})}
    searchable = bool(parameters & SEARCH_PARAMETERS)
    said = [" ".join(text.casefold().split())]
    for collection in state.values():
        for key, record in record_pairs(collection) or ():
            if not isinstance(record, dict) or not _holds(key, record, wanted):
                continue
            for field_name, detail in record.items():
                if not isinstance(detail, str) or detail == wanted or not _distinctive(detail):
                    continue
                if (searchable or field_name in parameters) and _contains(said, " ".join(detail.casefold().split())):
                    return detail
    return None


def _holds(key: Any, record: Mapping[str, Any], wanted: str) -> bool:
    fields = (field for field in record.values() if isinstance(field, str | int) and not isinstance(field, bool))
    return str(key) == wanted or any(str(field) == wanted for field in fields)


def _distinctive(detail: str) -> bool:
    """A value that names one record: an e-mail, or a name or title of two words or more (not a status)."""
    return "@" in detail or (len(detail.split()) >= 2 and len(detail) >= 8)
