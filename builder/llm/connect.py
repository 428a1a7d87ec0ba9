"""Building a ready client from an `llm` config: the managed server (or `llm.url`), cache and accounting.

The synthesis model uses the `llm` section as it is; the RL agent (`rollout.rl_agent_model`) gets an `llm`
config derived from it by `builder.llm.roles.rl_agent_config`, and its own server log.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

from builder.config import LLMConfig
from builder.llm.base import CallRecord, ChatModel, ServerCall
from builder.llm.cache import ResponseCache
from builder.llm.client import LLMClient
from builder.llm.errors import ServerError
from builder.llm.openai_backend import OpenAIChatModel
from builder.llm.pacing import InFlightLimit
from builder.llm.pool import Endpoint, EndpointPool
from builder.llm.roles import served_model_id
from builder.llm.server import VLLMServer, check_external_server, kv_cache_tokens
from builder.records import Sampling

CACHE_FILE = "llm_cache.sqlite"
SERVER_LOG = "llm_server.log"
RL_AGENT_SERVER_LOG = "rl_agent_server.log"


@contextmanager
def open_llm(
    config: LLMConfig,
    run_dir: Path,
    *,
    on_call: Callable[[CallRecord], None] | None = None,
    on_server_call: Callable[[ServerCall], None] | None = None,
    cache: bool | None = None,
    server_log: str = SERVER_LOG,
) -> Iterator[LLMClient]:
    """Yield an `LLMClient` for `config`, starting a managed vLLM server unless `config.url` (or `config.urls`)
    is set.

    Every case goes through `pool.EndpointPool` (the managed server and `config.url` are a pool of one), so
    each server's requests in flight are paced by its throughput and every attempt on a server is reported to
    `on_server_call`. The server log goes to `run_dir/<server_log>` and replies are cached in
    `run_dir/llm_cache.sqlite` (unless `cache`, or else `config.cache`, is false; the key includes the model
    id, so two models sharing the file never share replies). The server is stopped when the block ends,
    whether by return, error or Ctrl-C.

    With `config.url(s)`, a vLLM outside the supported range (its `/version`) is warned about; a server that
    does not report a vLLM version is only used through the OpenAI API (prompts are then measured by estimate).

    Raises:
        ServerError: the managed server cannot start (see `VLLMServer.start`).
    """
    run_dir = Path(run_dir)
    use_cache = config.cache if cache is None else cache
    with ExitStack() as stack:
        urls, context, seeds = stack.enter_context(model_servers(config, run_dir, server_log=server_log))
        response_cache = stack.enter_context(ResponseCache(run_dir / CACHE_FILE)) if use_cache else None
        pool = endpoint_pool(config, urls, seeds=seeds, on_server_call=on_server_call)
        yield client_for(
            over_pool(config, pool),
            pool,
            model_id=served_model_id(config),
            cache=response_cache,
            on_call=on_call,
            context_tokens=context,
        )


@contextmanager
def model_servers(
    config: LLMConfig, run_dir: Path, *, server_log: str = SERVER_LOG
) -> Iterator[tuple[tuple[str, ...], int, bool]]:
    """The servers `config` names, as `(urls, context tokens, seeds)` for `endpoint_pool`: `config.urls` (or
    `config.url`), else a managed vLLM server started for the block, its log in `run_dir/<server_log>`.

    Raises:
        ServerError: the managed server cannot start (see `VLLMServer.start`).
    """
    if config.urls or config.url:
        yield tuple(config.urls or (str(config.url),)), config.max_model_len, True
        return
    with VLLMServer(config, Path(run_dir) / server_log) as server:
        # vLLM on CPU crashes (EngineDeadError "CPU Generator does not use offset") when a seeded request's
        # prompt is prefilled in chunks, as long agent prompts are: its managed server gets no per-request seeds.
        yield (server.url,), server.max_model_len, server.device != "cpu"


def endpoint_pool(
    config: LLMConfig,
    urls: Sequence[str],
    *,
    seeds: bool = True,
    on_server_call: Callable[[ServerCall], None] | None = None,
) -> EndpointPool:
    """The pool over `urls`, serving `config.served_model_name`: one backend and one `server_limit` per server."""
    endpoints = []
    for url in urls:
        is_vllm = check_external_server(url) is not None
        backend = OpenAIChatModel(
            url, config.served_model_name, timeout_s=config.request_timeout_s, tokenize=is_vllm, seeds=seeds
        )
        endpoints.append(Endpoint(url=url, backend=backend, limit=server_limit(config, url)))
    return EndpointPool(endpoints, on_server_call=on_server_call)


def over_pool(config: LLMConfig, pool: EndpointPool) -> LLMConfig:
    """`config` for the client over `pool`. The pool paces each server; the client's bound only keeps the total
    within what they can take, and its timeout spans queueing for a free server and re-routes (each attempt
    has llm.request_timeout_s)."""
    whole = {
        "max_concurrency": pool.capacity,
        "request_timeout_s": config.request_timeout_s * (len(pool.endpoints) + 1),
    }
    return config.model_copy(update=whole)


def server_limit(config: LLMConfig, url: str) -> InFlightLimit:
    """The in-flight limit of the server at `url`: it starts at llm.max_concurrency and, with
    llm.adaptive_concurrency, moves by the throughput it answers with, up to llm.max_in_flight_per_server and
    what its KV cache holds if it reports that (vLLM's /metrics); fixed at llm.max_concurrency otherwise."""
    kv_tokens = kv_cache_tokens(url) if config.adaptive_concurrency else None
    return InFlightLimit(
        config.max_concurrency,
        high=config.max_in_flight_per_server,
        fixed=not config.adaptive_concurrency,
        kv_tokens=kv_tokens,
    )


def client_for(
    config: LLMConfig,
    backend: ChatModel,
    *,
    model_id: str,
    cache: ResponseCache | None = None,
    on_call: Callable[[CallRecord], None] | None = None,
    context_tokens: int | None = None,
) -> LLMClient:
    """An `LLMClient` around any backend with the limits, thinking switch and sampling defaults of `config`.

    `context_tokens` is the context the server really has (the managed server may serve less than
    llm.max_model_len, see `VLLMServer.max_model_len`); default llm.max_model_len.
    """
    return LLMClient(
        backend,
        model_id=model_id,
        cache=cache,
        on_call=on_call,
        default_sampling=Sampling(temperature=config.temperature, top_p=config.top_p, max_tokens=config.max_tokens),
        context_tokens=config.max_model_len if context_tokens is None else context_tokens,
        thinking=config.thinking == "on",
        reasoning_budget=config.reasoning_budget,
        max_budget_growths=config.max_budget_growths,
        max_concurrency=config.max_concurrency,
        request_timeout_s=config.request_timeout_s,
        max_retries=config.max_retries,
        retry_budget_s=config.retry_budget_s,
        structured_retries=config.structured_retries,
    )


def serve(config: LLMConfig, run_dir: Path, *, announce: Callable[[str], None] = print) -> int:
    """`python -m builder serve`: run the managed server in the foreground until Ctrl-C (or SIGTERM).

    Returns:
        0 after Ctrl-C; the server is stopped either way.

    Raises:
        ServerError: the server cannot start, or it exits on its own.
    """
    log = Path(run_dir) / SERVER_LOG
    try:
        with VLLMServer(config, log) as server:
            announce(f"serving {config.model} as {config.served_model_name!r} at {server.url} (log: {log})")
            announce("use it with --llm-url / llm.url; Ctrl-C stops it")
            while (code := server.process.poll() if server.process else 0) is None:
                time.sleep(1.0)
            raise ServerError(f"vLLM exited with code {code}.\n{server.log_tail()}")
    except KeyboardInterrupt:
        return 0
