"""The scenarios stage's figures per task family (`ctx.stats.report.families`, `builder.reports.FamilyFigures`, in
stats.json and the card): slots tried, verified, rejected by reason, and what each family's own requests cost
(`builder.usage.tally` around each slot), with the yield and the cost per verified slot derived."""

from __future__ import annotations

from collections.abc import Sequence

from builder.records import Rejection, Scenario
from builder.reports import FamilyFigures, ScenariosReport
from builder.run.stage import StageContext
from builder.usage import Usage

USAGE = ("calls", "prompt_tokens", "completion_tokens")


def report_families(ctx: StageContext, slots: Sequence[tuple[str, list[Scenario] | Rejection, Usage]]) -> None:
    """Count one environment's slots: (family, what the slot made, what its requests cost)."""
    families = ctx.stats.report.families
    for family, made, usage in slots:
        entry = families.setdefault(family, FamilyFigures())
        entry.slots += 1
        if isinstance(made, Rejection):
            entry.rejected[made.reason] = entry.rejected.get(made.reason, 0) + 1
        else:
            entry.verified += 1
        for name in USAGE:
            setattr(entry, name, getattr(entry, name) + getattr(usage, name))


def derive_families(report: ScenariosReport) -> None:
    """Each family's yield (verified / slots) and usage per verified slot."""
    for entry in report.families.values():
        verified = entry.verified
        entry.yield_ = round(verified / entry.slots, 4) if entry.slots else None
        entry.per_verified = {name: round(getattr(entry, name) / verified, 1) for name in USAGE} if verified else None
