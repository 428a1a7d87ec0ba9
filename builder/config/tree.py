"""The whole configuration tree, and its hash over the keys that can change what a run produces."""

from __future__ import annotations

import hashlib
import json

from builder.config.infrastructure import ExecutorConfig, HubConfig, LLMConfig, RunConfig, SandboxConfig, StoreConfig
from builder.config.section import Section
from builder.config.stages import (
    CodeConfig,
    EvaluateConfig,
    MineConfig,
    PlanConfig,
    RolloutConfig,
    ScenariosConfig,
    SelectConfig,
)


class BuildConfig(Section):
    """The whole configuration. Sections mirror the pipeline stages plus the infrastructure they share."""

    run: RunConfig = RunConfig()
    llm: LLMConfig = LLMConfig()
    sandbox: SandboxConfig = SandboxConfig()
    mine: MineConfig = MineConfig()
    plan: PlanConfig = PlanConfig()
    code: CodeConfig = CodeConfig()
    evaluate: EvaluateConfig = EvaluateConfig()
    scenarios: ScenariosConfig = ScenariosConfig()
    rollout: RolloutConfig = RolloutConfig()
    select: SelectConfig = SelectConfig()
    store: StoreConfig = StoreConfig()
    hub: HubConfig = HubConfig()
    executor: ExecutorConfig = ExecutorConfig()


# Keys that change how a run executes but not what it produces: a resumed run may change them freely.
# Whole sections: where the store and the Hub live, how releases are published and where the stages execute never
# change a run's output.
OPERATIONAL_SECTIONS = frozenset({"store", "hub", "executor"})
OPERATIONAL_KEYS = frozenset(
    {
        "run.runs_root",
        "llm.url",
        "llm.urls",
        "llm.adaptive_concurrency",
        "llm.max_in_flight_per_server",
        "llm.device",
        "llm.tensor_parallel_size",
        "llm.server_start_timeout_s",
        "llm.max_concurrency",
        "llm.request_timeout_s",
        "llm.max_retries",
        "llm.retry_budget_s",
        "llm.cache",
        "llm.cpu_kvcache_space_gb",
        "llm.extra_server_args",
        "llm.server_tok_s",
        "rollout.rl_agent_url",
        "rollout.rl_agent_urls",
    }
)


def config_hash(config: BuildConfig) -> str:
    """A stable 16-hex-digit hash of everything in the config that can change the output."""
    data = config.model_dump(mode="json")
    for section in OPERATIONAL_SECTIONS:
        data.pop(section)
    for key in OPERATIONAL_KEYS:
        section, name = key.split(".")
        data[section].pop(name, None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]
