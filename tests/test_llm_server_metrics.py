"""The managed vLLM server's own prefix-cache counters (its /metrics), read at the end of each stage and put
beside builder's `prefix_reuse` in the stage's per-server stats."""

from __future__ import annotations

from llm_stub import StubServer, completion

from builder.config import LLMConfig
from builder.llm.pool import Endpoint, EndpointPool
from builder.llm.server import prefix_cache_counters, read_prefix_cache_counters
from builder.pipeline import LazyModel
from builder.stats import StageStats

# As vLLM 0.x's v1 engine exposes them (prometheus_client appends `_total` and adds `_created` samples), two engines.
METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-8B"} %s
vllm:prefix_cache_queries_total{engine="1",model_name="Qwen/Qwen3-8B"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="Qwen/Qwen3-8B"} 1.7e+09
# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} %s
vllm:prefix_cache_hits_total{engine="1",model_name="Qwen/Qwen3-8B"} 500.0
vllm:external_prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen3-8B"} 7.0
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-8B"} 3.0
"""


def test_the_prefix_cache_counters_are_summed_over_engines_and_others_ignored():
    assert prefix_cache_counters(METRICS % ("9000.0", "7500.0")) == (10000, 8000)
    assert prefix_cache_counters("vllm:num_requests_running 3.0\n") is None  # an older vLLM, or another server
    assert prefix_cache_counters("") is None
    assert prefix_cache_counters('vllm:prefix_cache_hits_total{engine="0"} nan-ish\n') is None


def test_a_stage_gets_the_managed_servers_counters_since_the_last_reading_and_a_server_without_them_nothing():
    with (
        StubServer(lambda body: (200, completion()), metrics=METRICS % ("1000.0", "600.0")) as vllm,
        StubServer(lambda body: (200, completion())) as other,
    ):
        endpoints = [
            Endpoint(url=vllm.url, backend=None, limit=None),
            Endpoint(url=other.url, backend=None, limit=None),
        ]  # type: ignore[arg-type]
        client = type("Client", (), {"backend": EndpointPool(endpoints)})()
        model = LazyModel(LLMConfig(), lambda on_call: client)  # type: ignore[arg-type,return-value]
        model._started()
        first, second = StageStats("evaluate"), StageStats("scenarios")
        model.for_stage(first).read_server_counters()
        vllm.metrics = METRICS % ("4000.0", "3500.0")
        model.for_stage(second).read_server_counters()
        vllm.kill()
        model.read_server_counters()  # unreachable: the stage keeps what it had
    assert (first.servers[vllm.url].cache_queries, first.servers[vllm.url].cache_hits) == (2000, 1100)
    assert (second.servers[vllm.url].cache_queries, second.servers[vllm.url].cache_hits) == (3000, 2900)
    assert second.to_json()["servers"][vllm.url]["server_prefix_hit_rate"] == round(2900 / 3000, 4)
    assert other.url not in first.servers  # no counters: nothing stored, no error
    assert read_prefix_cache_counters(other.url) is None


def test_a_server_the_run_did_not_start_is_not_asked():
    endpoints = [Endpoint(url="http://unreachable.invalid:1/v1", backend=None, limit=None)]  # type: ignore[arg-type]
    client = type("Client", (), {"backend": EndpointPool(endpoints)})()
    model = LazyModel(LLMConfig(url="http://unreachable.invalid:1/v1"), lambda on_call: client)  # type: ignore[arg-type,return-value]
    model._started()
    stats = StageStats("evaluate")
    model.for_stage(stats).read_server_counters()
    assert stats.servers == {}
