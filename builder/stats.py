"""Per-stage statistics: inputs, kept, dropped by reason, model calls and tokens, wall time.

Counts of kept and dropped come from the stage tables (the truth after any number of resumes); model usage and
wall time accumulate over every attempt, since a resumed run really did spend them.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

DERIVED = ("tokens_per_kept", "yield", "per_kept")  # keys of `to_json` computed from the counters, not state


@dataclass
class StageStats:
    """Counters of one stage. Mutable on purpose: the runner and the model layer add to it while it runs."""

    stage: str
    inputs: int = 0
    resumed: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    llm_calls: int = 0
    llm_cache_hits: int = 0
    llm_failures: int = 0
    llm_latency_s: float = 0.0
    llm_regrowths: int = 0  # calls that asked again with a grown budget after a reply was cut (see LLMClient)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    wall_s: float = 0.0
    report: dict = field(default_factory=dict)  # a stage's own summary (e.g. select's rates and decontamination)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def add_llm_call(
        self,
        prompt_tokens: int,
        completion_tokens: int,
        *,
        cached: bool = False,
        ok: bool = True,
        latency_s: float = 0,
        regrowth: bool = False,
    ) -> None:
        """Count one model call; cached calls cost no tokens, so they are counted apart. `regrowth`: the call
        repeated a cut request with a larger completion budget."""
        if cached:
            self.llm_cache_hits += 1
            return
        self.llm_calls += 1
        self.llm_failures += not ok
        self.llm_regrowths += regrowth
        self.llm_latency_s += latency_s
        self.prompt_tokens += prompt_tokens
        self.completion_tokens += completion_tokens

    @property
    def tokens_per_kept(self) -> float | None:
        """Model tokens (prompt + completion) spent per kept output: the cost of one accepted record."""
        return (self.prompt_tokens + self.completion_tokens) / self.kept if self.kept else None

    def to_json(self) -> dict:
        """The counters plus derived figures: `tokens_per_kept`, `yield` (kept / (kept + dropped)) and `per_kept`
        (model calls, tokens and wall seconds per kept record; None while nothing is kept)."""
        data = asdict(self)
        data["dropped"] = dict(sorted(self.dropped.items()))
        data["tokens_per_kept"] = self.tokens_per_kept
        decided = self.kept + self.dropped_total
        data["yield"] = round(self.kept / decided, 4) if decided else None
        data["per_kept"] = (
            {
                "llm_calls": round(self.llm_calls / self.kept, 2),
                "prompt_tokens": round(self.prompt_tokens / self.kept, 1),
                "completion_tokens": round(self.completion_tokens / self.kept, 1),
                "wall_s": round(self.wall_s / self.kept, 3),
            }
            if self.kept
            else None
        )
        return data

    @classmethod
    def from_json(cls, data: dict) -> StageStats:
        data = {key: value for key, value in data.items() if key not in DERIVED}
        data["dropped"] = Counter(data.get("dropped", {}))
        return cls(**data)


def load_stats(path: Path) -> dict[str, StageStats]:
    if not path.exists():
        return {}
    data = json.loads(path.read_text())
    return {name: StageStats.from_json(item) for name, item in data.get("stages", {}).items()}


def save_stats(path: Path, stages: dict[str, StageStats], extra: dict | None = None) -> None:
    """Write stats.json atomically: `{"stages": {name: {...}}, ...extra}`."""
    data = {"stages": {name: stats.to_json() for name, stats in stages.items()}, **(extra or {})}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)


def render_table(stages: dict[str, StageStats]) -> str:
    """A plain-text table, one row per stage, for the end of a run and `builder stats`."""
    header = ("stage", "in", "kept", "dropped", "llm calls", "cache hits", "tokens in/out", "wall s", "drop reasons")
    rows = [header]
    for stats in stages.values():
        reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(stats.dropped.items()))
        rows.append(
            (
                stats.stage,
                str(stats.inputs),
                str(stats.kept),
                str(stats.dropped_total),
                str(stats.llm_calls),
                str(stats.llm_cache_hits),
                f"{stats.prompt_tokens}/{stats.completion_tokens}",
                f"{stats.wall_s:.1f}",
                reasons or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
