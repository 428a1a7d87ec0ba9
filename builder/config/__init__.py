"""The one configuration tree: every knob of every stage, loaded from TOML with `--set key=value` overrides.

The built-in defaults plus the packaged profile for the machine (builder/profiles/: `cpu` with the embedded
SmolLM2-135M model, `gpu` with Qwen3-8B) give a complete run. Every field documents itself (`python -m builder config`
prints them); invalid values fail at load time with one error naming the key, the value and what is allowed.

`builder.config` is the one import path for all of it; the modules split it by concept: `section` (the base of
every section), `infrastructure` and `stages` (the sections), `tree` (`BuildConfig` and `config_hash`),
`loading` (profiles, files, overrides) and `printing` (`to_toml`).
"""

from builder.config.infrastructure import ExecutorConfig, HubConfig, LLMConfig, RunConfig, SandboxConfig, StoreConfig
from builder.config.loading import PROFILES, load_config, resolve_profile
from builder.config.printing import to_toml
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
from builder.config.tree import OPERATIONAL_KEYS, OPERATIONAL_SECTIONS, BuildConfig, config_hash

__all__ = [
    "OPERATIONAL_KEYS",
    "OPERATIONAL_SECTIONS",
    "PROFILES",
    "BuildConfig",
    "CodeConfig",
    "EvaluateConfig",
    "ExecutorConfig",
    "HubConfig",
    "LLMConfig",
    "MineConfig",
    "PlanConfig",
    "RolloutConfig",
    "RunConfig",
    "SandboxConfig",
    "ScenariosConfig",
    "Section",
    "SelectConfig",
    "StoreConfig",
    "config_hash",
    "load_config",
    "resolve_profile",
    "to_toml",
]
