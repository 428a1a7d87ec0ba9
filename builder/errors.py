"""Exceptions that reach the user. Each carries a message that says what went wrong and what to do about it."""


class BuilderError(Exception):
    """Base of every error builder raises on purpose; the CLI prints its message without a traceback."""


class ConfigError(BuilderError):
    """The configuration or a command-line override is invalid."""


class StoreError(BuilderError):
    """The Parquet store cannot be read or written safely (damaged file, lock held, newer schema)."""


class RunError(BuilderError):
    """A run folder cannot be used as asked (made with another config, unknown stage)."""
