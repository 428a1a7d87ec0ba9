"""Errors of the model layer. A failed request is an `ItemError` (its input is rejected, the run goes on); a
server that cannot be started or reached from the start is an `OperatorError` (the run stops)."""

from __future__ import annotations

from builder.errors import ItemError, OperatorError
from builder.usage import Usage


class LLMError(ItemError):
    """Base of every model-layer error: a stage that catches this can write a rejection record.

    `cost` is what the failed call took by the ledger rule of `usage.Usage`, set by `LLMClient.chat`: the
    failed request, plus any answered before it (a cut reply whose grown re-ask failed); nothing if nothing was
    sent. A caller that goes on after the error (an episode ending `llm_error`) adds it to its usage.
    """

    cost: Usage = Usage()
    reason = "llm_error"


class TransientLLMError(LLMError):
    """A failure worth retrying: connection refused or reset, timeout, HTTP 429 or 5xx, or a body that is not
    a chat completion (a gateway's error page, a reply cut off in transit).

    Attributes:
        status_code: The HTTP status, or None when no usable response arrived.
        retry_after_s: How long the server asked to wait (its `Retry-After` header), or None.
    """

    def __init__(self, message: str, *, status_code: int | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retry_after_s = retry_after_s


class LLMRequestError(LLMError):
    """A request failed for good: an HTTP 4xx other than 429 (the request itself is wrong), or retries ran out.

    Attributes:
        status_code: The HTTP status (of the last try, when retries ran out), or None when no response arrived
            (connection errors, timeouts).
        retryable: Whether the last failure was of a retryable kind.
        attempts: How many times the request was sent (set by the client's retry loop).
    """

    reason = "llm_request"

    def __init__(
        self, message: str, *, status_code: int | None = None, retryable: bool = False, attempts: int = 1
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.retryable = retryable
        self.attempts = attempts


class PromptTooLongError(LLMRequestError):
    """The prompt alone leaves no room for a useful reply in the model's context; nothing was sent.

    A stage that can say the same in fewer tokens (fewer state records, only the methods involved) catches it,
    shrinks its prompt and asks again; otherwise it becomes a `prompt_too_long` rejection.

    Attributes:
        prompt_tokens: The prompt's measured (or conservatively estimated) size.
        context_tokens: The model's context (llm.max_model_len).
        min_completion: The smallest completion budget the request would accept.
    """

    reason = "prompt_too_long"

    def __init__(self, message: str, *, prompt_tokens: int, context_tokens: int, min_completion: int) -> None:
        super().__init__(message, status_code=None, retryable=False, attempts=0)
        self.prompt_tokens = prompt_tokens
        self.context_tokens = context_tokens
        self.min_completion = min_completion


class StructuredOutputError(LLMError):
    """The model never produced output that validates against the requested pydantic model.

    Attributes:
        raw_text: The model's last raw reply (reasoning removed), for the rejection record.
        errors: One readable validation message per attempt, oldest first.
        attempts: How many replies were tried.
    """

    reason = "invalid_output"

    def __init__(self, message: str, *, raw_text: str, errors: list[str], attempts: int) -> None:
        super().__init__(message)
        self.raw_text = raw_text
        self.errors = errors
        self.attempts = attempts


class ServerError(LLMError, OperatorError):
    """The managed vLLM server cannot be started: vLLM missing, wrong model, start-up crash or timeout."""


class ServerUnreachable(LLMError, OperatorError):
    """No model server answered any request of this client: every try of its first requests found no server
    (connection refused, no route, timeout). Not one input's failure: the run stops, a rerun resumes."""
