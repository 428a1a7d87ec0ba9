"""Shared fixtures. Tests never reach the network; each gets its own folders."""

from __future__ import annotations

import pytest

from builder.config import BuildConfig, config_hash
from builder.records import Provenance


@pytest.fixture
def config() -> BuildConfig:
    return BuildConfig()


@pytest.fixture
def provenance(config: BuildConfig) -> Provenance:
    return Provenance(config_hash=config_hash(config))
