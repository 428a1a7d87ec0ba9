"""Summing per-call records into usage totals, and turning tokens into an estimate of GPU-hours."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from builder.llm.base import CallRecord


@dataclass
class UsageTotals:
    """Running sums over `CallRecord`s. Tokens count only calls that reached the server (not cache hits)."""

    calls: int = 0
    cached_calls: int = 0
    failed_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    latency_s: float = 0.0

    def add(self, record: CallRecord) -> None:
        """Add one call; usable directly as the client's `on_call` observer."""
        self.calls += 1
        if record.cached:
            self.cached_calls += 1
            return
        if not record.ok:
            self.failed_calls += 1
        self.prompt_tokens += record.prompt_tokens
        self.completion_tokens += record.completion_tokens
        self.latency_s += record.latency_s

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def estimate_gpu_hours(tokens: int, tokens_per_second: float, *, num_gpus: int = 1) -> float:
    """GPU-hours needed to generate `tokens` at a measured aggregate server throughput.

    Args:
        tokens: Completion tokens generated (prefill is cheap next to decoding and is left out).
        tokens_per_second: The server's aggregate throughput under load, e.g. `server_tok_s` of `bench llm`.
        num_gpus: GPUs the server occupies (its tensor-parallel size).

    Raises:
        ValueError: the throughput is not positive or a count is negative.
    """
    if tokens_per_second <= 0:
        raise ValueError("tokens_per_second must be positive")
    if tokens < 0 or num_gpus < 1:
        raise ValueError("tokens must be >= 0 and num_gpus >= 1")
    return tokens / tokens_per_second / 3600.0 * num_gpus
