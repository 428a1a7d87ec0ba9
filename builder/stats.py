"""Per-stage statistics: inputs, kept, dropped by reason, model usage, wall time.

Counts of kept and dropped come from the stage tables (the truth after any number of resumes); model usage and
wall time accumulate over every attempt, since a resumed run really did spend them. Usage follows the one ledger
rule of `usage.Usage`, so a cache hit of a resumed attempt adds no cost twice.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from builder.llm.base import CallRecord, ServerCall
from builder.reports import Report, StageReport, Unknown
from builder.usage import Usage

DERIVED = ("tokens_per_kept", "yield", "per_kept", "prefix_reuse")  # keys of `to_json` computed, not state
# stats.json before the one ledger: flat counters, where `llm_calls` also counted the failed requests.
_FLAT_USAGE = {
    "llm_calls": "calls",
    "llm_cache_hits": "cached_calls",
    "llm_failures": "failed_calls",
    "llm_regrowths": "regrowths",
    "prompt_tokens": "prompt_tokens",
    "completion_tokens": "completion_tokens",
}


@dataclass
class ServerStats:
    """What one model server did for a stage: attempts answered and failed, their tokens and summed time."""

    requests: int = 0
    failures: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    busy_s: float = 0.0
    prompt_chars: int = 0  # of the answered prompts, and of them the start the server had seen (`llm.prefix`)
    prefix_chars: int = 0
    # The server's own prefix cache over the stage, from its /metrics (vLLM's prefix_cache_queries / _hits, in
    # tokens); None when it reports none.
    cache_queries: int | None = None
    cache_hits: int | None = None

    def to_json(self, wall_s: float) -> dict:
        """The counters plus `mean_in_flight` (busy time over the stage's wall time, Little's law) and
        `completion_tok_s` (its completion tokens per second of the stage's wall time)."""
        return {
            **asdict(self),
            "prefix_reuse": prefix_reuse([self]),
            "server_prefix_hit_rate": round(self.cache_hits / self.cache_queries, 4)
            if self.cache_queries and self.cache_hits is not None
            else None,
            "busy_s": round(self.busy_s, 3),
            "mean_in_flight": round(self.busy_s / wall_s, 2) if wall_s else None,
            "completion_tok_s": round(self.completion_tokens / wall_s, 2) if wall_s else None,
        }


@dataclass
class StageStats:
    """Counters of one stage. Mutable on purpose: the runner and the model layer add to it while it runs."""

    stage: str
    inputs: int = 0
    resumed: int = 0
    kept: int = 0
    dropped: Counter[str] = field(default_factory=Counter)
    usage: Usage = Usage()
    llm_latency_s: float = 0.0  # wall time of the requests sent to the server (cache hits take none)
    wall_s: float = 0.0
    # CPU seconds of the driver process and its children (the sandbox's workers) while the stage ran; the Ray
    # actors' own are not in it (builder/cpu.py).
    cpu_s: float = 0.0
    report: Report = field(default_factory=StageReport)  # the stage's own report (its type: `builder.reports`)
    servers: dict[str, ServerStats] = field(default_factory=dict)  # per model server URL (`add_server_call`)
    executor: dict = field(default_factory=dict)  # --executor ray: per-actor throughput, where time went (last try)

    @property
    def dropped_total(self) -> int:
        return sum(self.dropped.values())

    def add_call(self, record: CallRecord) -> None:
        """Count one request the client reports; usable directly as its `on_call` observer."""
        self.usage += record.usage
        if not record.cached:
            self.llm_latency_s += record.latency_s

    def add_server_call(self, call: ServerCall) -> None:
        """Count one attempt on a model server; usable directly as a pool's `on_server_call` observer."""
        server = self.servers.setdefault(call.url, ServerStats())
        server.requests += call.ok
        server.failures += not call.ok
        server.prompt_tokens += call.prompt_tokens
        server.completion_tokens += call.completion_tokens
        server.busy_s += call.latency_s
        server.prompt_chars += call.prompt_chars
        server.prefix_chars += call.prefix_chars

    @property
    def prefix_reuse(self) -> float | None:
        """The share of the prompt characters the servers answered that repeat a prefix an earlier request to the
        same server sent: what vLLM's automatic prefix caching can reuse (None: nothing measured)."""
        return prefix_reuse(self.servers.values())

    @property
    def tokens_per_kept(self) -> float | None:
        """Model tokens (prompt + completion) spent per kept output: the cost of one accepted record."""
        return self.usage.tokens / self.kept if self.kept else None

    def to_json(self) -> dict:
        """The counters plus derived figures: `tokens_per_kept`, `yield` (kept / (kept + dropped)) and `per_kept`
        (model calls, tokens and wall seconds per kept record; None while nothing is kept)."""
        data = asdict(self)
        data["dropped"] = dict(sorted(self.dropped.items()))
        data["usage"] = self.usage.model_dump()
        data["report"] = self.report.to_json()
        data["servers"] = {url: server.to_json(self.wall_s) for url, server in sorted(self.servers.items())}
        data["tokens_per_kept"] = self.tokens_per_kept
        data["prefix_reuse"] = self.prefix_reuse
        decided = self.kept + self.dropped_total
        data["yield"] = round(self.kept / decided, 4) if decided else None
        data["per_kept"] = (
            {
                "calls": round(self.usage.calls / self.kept, 2),
                "prompt_tokens": round(self.usage.prompt_tokens / self.kept, 1),
                "completion_tokens": round(self.usage.completion_tokens / self.kept, 1),
                "wall_s": round(self.wall_s / self.kept, 3),
            }
            if self.kept
            else None
        )
        return data

    @classmethod
    def from_json(cls, data: dict) -> StageStats:
        """A stage's entry of stats.json, also as builders before the one ledger wrote it (flat counters)."""
        data = {key: value for key, value in data.items() if key not in DERIVED}
        flat = {_FLAT_USAGE[key]: data.pop(key) for key in list(data) if key in _FLAT_USAGE}
        if flat:
            flat["calls"] = flat.get("calls", 0) - flat.get("failed_calls", 0)
        data["usage"] = Usage.model_validate(data.get("usage", flat))
        data["report"] = Unknown.model_validate(data.get("report", {}))  # typed when its stage runs again
        data["dropped"] = Counter(data.get("dropped", {}))
        data["servers"] = {
            url: ServerStats(**{key: server[key] for key in ServerStats.__dataclass_fields__ if key in server})
            for url, server in data.get("servers", {}).items()
        }
        return cls(**data)


def prefix_reuse(servers: Iterable[ServerStats]) -> float | None:
    """The share of the servers' answered prompt characters that repeat a prefix an earlier request to the same
    server sent (`builder.llm.prefix`); None when nothing was measured."""
    servers = list(servers)
    chars = sum(server.prompt_chars for server in servers)
    return round(sum(server.prefix_chars for server in servers) / chars, 4) if chars else None


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
    header = (
        "stage", "in", "kept", "dropped", "llm calls", "cached", "failed", "retries", "tokens in/out",
        "prefix reuse", "wall s", "drop reasons",
    )  # fmt: skip
    rows = [header]
    for stats in stages.values():
        reasons = ", ".join(f"{reason}={count}" for reason, count in sorted(stats.dropped.items()))
        rows.append(
            (
                stats.stage,
                str(stats.inputs),
                str(stats.kept),
                str(stats.dropped_total),
                str(stats.usage.calls),
                str(stats.usage.cached_calls),
                str(stats.usage.failed_calls),
                str(stats.usage.retries),
                f"{stats.usage.prompt_tokens}/{stats.usage.completion_tokens}",
                f"{stats.prefix_reuse:.2f}" if stats.prefix_reuse is not None else "-",
                f"{stats.wall_s:.1f}",
                reasons or "-",
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)
