"""Turning tokens into an estimate of GPU-hours. (Usage itself is counted by one rule, in `usage.Usage`: the
client's `totals`, a reply's `cost` and `CallRecord.usage` all follow it.)"""

from __future__ import annotations


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
