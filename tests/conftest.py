"""Shared fixtures. Tests never reach the network; each gets its own folders."""

from __future__ import annotations

import logging

import pytest

from builder.config import BuildConfig, config_hash
from builder.records import Provenance


@pytest.fixture
def config() -> BuildConfig:
    return BuildConfig()


@pytest.fixture
def provenance(config: BuildConfig) -> Provenance:
    return Provenance(config_hash=config_hash(config))


@pytest.fixture
def restore_logging():
    """`main` adds console and run-log handlers to the `builder` logger; take them off again."""
    log = logging.getLogger("builder")
    handlers, level = list(log.handlers), log.level
    yield
    for handler in [h for h in log.handlers if h not in handlers]:
        log.removeHandler(handler)
        handler.close()
    log.setLevel(level)
