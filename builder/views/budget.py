"""How much of an environment one prompt shows, by shrink level: a prompt too long for the model's context is
built again one level smaller (`builder.stages._llm.shrinking`). One scheme for every stage, sized by one
setting, `llm.max_state_chars`."""

from __future__ import annotations

from dataclasses import dataclass

MIN_STATE_CHARS = 200  # a prompt too long even with this little state is rejected (`prompt_too_long`)
# Per level; a level past the end of a row takes the row's last value.
_RECORDS = (None, 6, 2)  # records kept per collection of a shown state (None: all that fit)
_HEADER_CHARS = (4000, 2000, 800)  # the class header (docstring, __init__)
_METHODS = (4, 2, 0)  # method sources a check request is shown
_RESULT_CHARS = (400, 200, 80)  # a tool call's result quoted in a request


@dataclass(frozen=True)
class PromptBudget:
    """What a prompt at one shrink level may show."""

    level: int
    state_chars: int  # a state is cut to this many JSON characters, by whole records
    records: int | None  # records per collection of a shown state (None: all that fit in `state_chars`)
    header_chars: int
    methods: int
    result_chars: int


def prompt_budgets(max_state_chars: int) -> tuple[PromptBudget, ...]:
    """The levels a prompt is built at, largest first: `max_state_chars`, halved down to MIN_STATE_CHARS, with
    fewer records, a shorter class header, fewer method sources and shorter results at each level."""
    sizes = [max_state_chars]
    while sizes[-1] > MIN_STATE_CHARS:
        sizes.append(max(MIN_STATE_CHARS, sizes[-1] // 2))
    return tuple(
        PromptBudget(
            level=level,
            state_chars=chars,
            records=_at(_RECORDS, level),
            header_chars=_at(_HEADER_CHARS, level),
            methods=_at(_METHODS, level),
            result_chars=_at(_RESULT_CHARS, level),
        )
        for level, chars in enumerate(sizes)
    )


def _at(row: tuple, level: int):  # noqa: ANN202 - a value of the row's type
    return row[min(level, len(row) - 1)]
