"""Errors of the model layer. All derive from `BuilderError`, so the CLI prints them without a traceback."""

from __future__ import annotations

from builder.errors import BuilderError


class LLMError(BuilderError):
    """Base of every model-layer error: a stage that catches this can write a rejection record."""


class TransientLLMError(LLMError):
    """A failure worth retrying: connection refused or reset, timeout, or an HTTP 5xx from the server."""


class LLMRequestError(LLMError):
    """A request failed for good: an HTTP 4xx (the request itself is wrong), or retries ran out.

    Attributes:
        status_code: The HTTP status, or None when no response arrived (retries exhausted on connection
            errors).
        retryable: Whether the last failure was of a retryable kind.
    """

    def __init__(self, message: str, *, status_code: int | None = None, retryable: bool = False) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable


class StructuredOutputError(LLMError):
    """The model never produced output that validates against the requested pydantic model.

    Attributes:
        raw_text: The model's last raw reply (reasoning removed), for the rejection record.
        errors: One readable validation message per attempt, oldest first.
        attempts: How many replies were tried.
    """

    def __init__(self, message: str, *, raw_text: str, errors: list[str], attempts: int) -> None:
        super().__init__(message)
        self.raw_text = raw_text
        self.errors = errors
        self.attempts = attempts


class ServerError(LLMError):
    """The managed vLLM server cannot be started: vLLM missing, wrong model, start-up crash or timeout."""
