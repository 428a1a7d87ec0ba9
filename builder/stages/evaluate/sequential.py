"""Sequential acceptance: stop judging once the keep / reject decision over `evaluate.calls` is settled.

After each round of batches the harness asks `settled` with the tallies so far. The decision is settled when

- it can no longer change: even if every remaining call of the N failed the score stays at or above keep_score
  (accept), or even if every remaining call passed it stays below (reject); or
- at `evaluate.stop_confidence` (one-sided), the Wilson score interval of the pass share is entirely on one side
  of keep_score: its lower bound at or above it (accept) or its upper bound below it (reject);

and only once at least `evaluate.min_calls` calls are judged, with at least the negative cases the schedule puts in
that many (so an early verdict never rests on positive cases alone). An early verdict agrees with the score over
the calls judged (the lower bound is below the pass share, the upper above), so the stage's rule "score >=
keep_score" is unchanged. How often it differs from the verdict over all N calls is measured in
tests/test_evaluate_sequential.py and stated in docs/synthesis.md.
"""

from __future__ import annotations

from collections.abc import Collection
from math import sqrt
from statistics import NormalDist
from typing import Literal

Decision = Literal["accept", "reject"]


def wilson(passes: int, judged: int, confidence: float) -> tuple[float, float]:
    """The one-sided Wilson score bounds (lower, upper) of the pass share at `confidence` each."""
    if judged == 0:
        return 0.0, 1.0
    z = NormalDist().inv_cdf(confidence)
    share = passes / judged
    centre = share + z * z / (2 * judged)
    spread = z * sqrt(share * (1 - share) / judged + z * z / (4 * judged * judged))
    scale = 1 + z * z / judged
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


def settled(
    passes: int, judged: int, negatives: int, *, total: int, keep_score: float, min_calls: int,
    min_negatives: int, confidence: float,
) -> Decision | None:  # fmt: skip
    """The decision the judged calls already settle, or None to judge on (see the module's docstring)."""
    if judged >= total:
        return None  # the full N: the stage's own rule decides
    if judged < min(min_calls, total) or negatives < min_negatives:
        return None
    if passes >= keep_score * total:
        return "accept"
    if passes + (total - judged) < keep_score * total:
        return "reject"
    lower, upper = wilson(passes, judged, confidence)
    if lower >= keep_score:
        return "accept"
    if upper < keep_score:
        return "reject"
    return None


def negatives_in(schedule_cases: Collection[str], min_calls: int, total: int) -> int:
    """The negative cases the schedule puts in `min_calls` of its `total` slots (its share, rounded down)."""
    negative = sum(case == "negative" for case in schedule_cases)
    return negative * min(min_calls, total) // total if total else 0
