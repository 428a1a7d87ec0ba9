"""Variety of task texts: near-duplicates, template repeats and copies of the seed request.

A task text is compared by its **shape**: the text with its *values* masked (ids and numbers, i.e. every word with
a digit such as `acc-1`, `P-4`, `$3,125.00`, `2022-12-31`, `9:00`; e-mail addresses; quoted text; runs of
capitalised words inside a sentence such as `Lucas Ferreira`, `Dr. Rebecca Liang`, `April`), and the set of those
values. The similarity of two tasks is the Jaccard index of the words and word pairs
(`builder.decontaminate.ngrams`, n = 1 and 2) of their masked texts without stop words (`my`, `the`, `please`,
...): the share of content they have in common, whatever the records they name. Word pairs keep the order
somewhat; single words forgive light rewording (`Move 300 cents from my checking account acc-1 to my savings
account acc-2` / `Please transfer 300 cents from checking account acc-1 into savings account acc-2`: 0.73). A
paraphrase with other verbs (`lend me Emma` / `I'd like to borrow Emma`) is out of reach of a word measure, and
so is telling it from another task on the same record (`lend me Emma` / `return Emma`): both score about 0.4-0.5,
under the default threshold of 0.6, so neither is dropped. Then:

- **near-duplicates**: similarity at or above the threshold *and* the same values (the Jaccard index of their
  value sets is at least one half, or neither has values): the same request about the same records, reworded or
  not. The later one is dropped, within a run and against earlier runs' tasks.
- **template repeats**: similarity at or above the threshold with *different* values: the same kind of request
  about other records (`Cancel booking B-3 for Ada` / `Cancel booking B-7 for Grace`). These are not duplicates
  (another record is another task), but the issue wants variety of kinds, so they are reported for a per-
  environment cap rather than dropped here.
- **copies of the seed**: a task copies a seed request when at least `threshold` of the seed's masked word
  3-grams, stop words kept (word for word), occur in the task, or when the seed names
  at least two values and the task repeats every one of them (`Check the status of an insurance claim filed on
  2022-12-31 with reference number ABC123` -> `... my home claim ABC123, filed on 2022-12-31, ...`).

Candidates come from an inverted index of word pairs (two texts at or above a threshold of one half share one);
only the 50 texts sharing the most pairs are scored exactly, so checking a text against thousands stays cheap.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from builder.decontaminate import ngrams

DEFAULT_THRESHOLD = 0.6  # near-duplicates and template repeats: Jaccard index of masked content words and pairs
DEFAULT_SEED_THRESHOLD = 0.5  # copies of the seed: share of the seed's masked word 3-grams found in the task
SEED_N = 3
_CANDIDATES = 50  # earlier texts scored exactly per check: those sharing the most word pairs
SAME_VALUES = 0.5  # two tasks name the same records when their value sets overlap at least this much (Jaccard)

_EMAIL = r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+"
_QUOTED = r"(?<!\w)\"[^\"]{1,120}\"|(?<!\w)'[^']{1,120}'(?!\w)|“[^”]{1,120}”"
_WITH_DIGIT = r"(?<![\w./:+$€£#-])[$€£#]?[\w./:+-]*\d[\w./:,+-]*(?<![.,:])"
_NAME = r"(?<=[a-z0-9,;:(] )(?!I')(?:(?:Dr|Mr|Mrs|Ms|Prof)\. )?[A-Z][\w'-]*[a-z][\w'-]*(?: [A-Z][\w'-]*[a-z][\w'-]*)*"
_VALUE = re.compile("|".join(f"(?:{p})" for p in (_EMAIL, _QUOTED, _WITH_DIGIT, _NAME)))
_MASK = " 0 "  # a masked value reads as the word "0": n-grams still see where a value stood
STOP_WORDS = frozenset(
    "a an the my me i im i'm we us our you your it its this that these those is are was be been am do does to from "
    "of for in on at by with into and or but so then also all any some please can could would will like want need "
    "hi hello hey thanks thank just here there".split()
)


@dataclass(frozen=True)
class TaskShape:
    """A task text as compared: its masked text, its values (casefolded), the content words and word pairs of the
    masked text (`grams`) and its word 3-grams (`seed_grams`, stop words kept)."""

    masked: str
    values: frozenset[str]
    grams: frozenset[tuple[str, ...]]
    seed_grams: frozenset[tuple[str, ...]]


@dataclass(frozen=True)
class Repeat:
    """Text `index` repeats an earlier text: `earlier` >= 0 is an index into the same texts, < 0 is
    `earlier_texts[-earlier - 1]` (a task of an earlier run)."""

    index: int
    earlier: int
    kind: Literal["near_duplicate", "template_repeat"]
    similarity: float


def shape(text: str) -> TaskShape:
    """`text` masked, with its values and n-grams (see the module docstring)."""
    values = frozenset(match.group(0).strip("\"'“”").casefold() for match in _VALUE.finditer(text))
    masked = " ".join(_VALUE.sub(_MASK, text).split())
    content = " ".join(w for w in re.findall(r"[a-z0-9']+", masked.casefold()) if w not in STOP_WORDS)
    return TaskShape(
        masked=masked,
        values=values,
        grams=frozenset(ngrams(content, 1) | ngrams(content, 2)),
        seed_grams=frozenset(ngrams(masked, SEED_N)),
    )


def similarity(a: TaskShape, b: TaskShape) -> float:
    """The Jaccard index of two shapes' n-grams (0 when either has none)."""
    if not a.grams or not b.grams:
        return 0.0
    shared = len(a.grams & b.grams)
    return shared / (len(a.grams) + len(b.grams) - shared)


def same_values(a: TaskShape, b: TaskShape) -> bool:
    """Whether two tasks name the same records: their value sets overlap by at least `SAME_VALUES` (Jaccard), or
    neither names any."""
    if not a.values and not b.values:
        return True
    return len(a.values & b.values) / len(a.values | b.values) >= SAME_VALUES


class TaskIndex:
    """Task shapes seen so far, indexed by n-gram. `check` finds what a new text repeats; `add` keeps it."""

    def __init__(self, *, threshold: float = DEFAULT_THRESHOLD) -> None:
        self.threshold = threshold
        self.shapes: list[TaskShape] = []
        self.labels: list[int] = []
        self._postings: dict[tuple[str, ...], list[int]] = defaultdict(list)

    def add(self, text: str | TaskShape, label: int) -> None:
        position = len(self.shapes)
        self.shapes.append(item := text if isinstance(text, TaskShape) else shape(text))
        self.labels.append(label)
        for gram in _keys(item):
            self._postings[gram].append(position)

    def check(self, text: str | TaskShape, index: int = 0) -> Repeat | None:
        """What `text` repeats: the most similar near-duplicate at or above the threshold, else the most similar
        template repeat, else None. `index` is reported as the Repeat's index."""
        item = text if isinstance(text, TaskShape) else shape(text)
        pairs: Counter[int] = Counter()
        for gram in _keys(item):
            pairs.update(self._postings.get(gram, ()))
        best: dict[str, tuple[float, int]] = {}
        for position, _ in pairs.most_common(_CANDIDATES):
            other = self.shapes[position]
            if min(len(item.grams), len(other.grams)) < self.threshold * max(len(item.grams), len(other.grams)):
                continue  # the Jaccard index cannot reach the threshold
            shared = len(item.grams & other.grams)
            score = shared / (len(item.grams) + len(other.grams) - shared)
            if score < self.threshold:
                continue
            kind = "near_duplicate" if same_values(item, other) else "template_repeat"
            if kind not in best or score > best[kind][0]:
                best[kind] = (score, position)
        for kind in ("near_duplicate", "template_repeat"):
            if kind in best:
                score, position = best[kind]
                return Repeat(index=index, earlier=self.labels[position], kind=kind, similarity=round(score, 3))  # type: ignore[arg-type]
        return None


def _keys(item: TaskShape) -> list[tuple[str, ...]]:
    """The n-grams a shape is indexed under: its word pairs, or its words when it has one word only (a shape with
    pairs cannot reach a one-word shape's threshold)."""
    pairs = [gram for gram in item.grams if len(gram) == 2]
    return pairs or list(item.grams)


def repeats(texts: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD, earlier: Iterable[str] = ()) -> list[Repeat]:
    """Every text of `texts` that repeats an earlier one of `texts` or one of `earlier` (earlier runs' tasks),
    in order. A near-duplicate is not indexed (it is to be dropped); a template repeat is (it is kept)."""
    index = TaskIndex(threshold=threshold)
    for position, text in enumerate(earlier):
        index.add(text, -position - 1)
    found = []
    for position, text in enumerate(texts):
        item = shape(text)
        repeat = index.check(item, position)
        if repeat is not None:
            found.append(repeat)
        if repeat is None or repeat.kind == "template_repeat":
            index.add(item, position)
    return found


def near_duplicates(
    texts: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD, earlier: Iterable[str] = ()
) -> list[int]:
    """The indices of the texts to drop: each near-duplicates an earlier text (the first of a group is kept)."""
    return [r.index for r in repeats(texts, threshold=threshold, earlier=earlier) if r.kind == "near_duplicate"]


def template_repeats(texts: Sequence[str], *, threshold: float = DEFAULT_THRESHOLD) -> list[int]:
    """The indices of the texts that repeat an earlier text's wording about other records (same kind of task)."""
    return [r.index for r in repeats(texts, threshold=threshold) if r.kind == "template_repeat"]


def copies_seed(task: str, seed_texts: Iterable[str], *, threshold: float = DEFAULT_SEED_THRESHOLD) -> bool:
    """Whether `task` copies one of the seed requests (see the module docstring)."""
    mine = shape(task)
    words = set(re.findall(r"[a-z0-9]+", task.casefold()))
    for seed in seed_texts:
        theirs = shape(seed)
        if theirs.seed_grams and mine.seed_grams:
            shared = len(theirs.seed_grams & mine.seed_grams)
            if shared / len(theirs.seed_grams) >= threshold:
                return True
        if len(theirs.values) >= 2 and all(_mentions(task.casefold(), words, value) for value in theirs.values):
            return True
    return False


def _mentions(text: str, words: set[str], value: str) -> bool:
    """Whether `text` (casefolded) holds `value`: as words for a value with several, else as a word."""
    parts = re.findall(r"[a-z0-9]+", value)
    if len(parts) == 1:
        return parts[0] in words
    return re.search(r"(?<![a-z0-9])" + r"[^a-z0-9]+".join(map(re.escape, parts)) + r"(?![a-z0-9])", text) is not None
