"""Exceptions that reach the user. Each carries a message that says what went wrong and what to do about it.

Two kinds, which the executor tells apart: an `ItemError` says one input failed (a model request that failed for
good, a sandbox session that broke, code that breaks the contract): the executor records a rejection with the
error's `reason` and goes on with the other inputs. An `OperatorError` says the run cannot go on as set up (a
bad config, an unusable run folder or store, a model server unreachable from the start): the executor stops the
run, and a rerun resumes once it is fixed. Any other exception in a stage is a bug: its input is rejected as
`exception:<Type>` with the traceback in the log.
"""

from __future__ import annotations

from typing import ClassVar


class BuilderError(Exception):
    """Base of every error builder raises on purpose; the CLI prints its message without a traceback."""


class OperatorError(BuilderError):
    """The run cannot go on as set up: the executor stops it (a rerun resumes once the cause is fixed)."""


class ItemError(BuilderError):
    """One input failed: the executor rejects it with `reason` (a stable code) and goes on."""

    reason: ClassVar[str] = "item_failed"


class ConfigError(OperatorError):
    """The configuration or a command-line override is invalid."""


class StoreError(OperatorError):
    """The Parquet store cannot be read or written safely (damaged file, lock held, newer schema)."""


class RunError(OperatorError):
    """A run folder cannot be used as asked (made with another config, unknown stage)."""
