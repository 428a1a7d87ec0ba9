"""The environment-disjoint `train` / `rl` split: one pure function of the environment id, shared by every user.

rollout picks the agent model by it (`rl` environments are played by `rollout.rl_agent_model`), select builds
the SFT set from `train` and the RL set from `rl`, and export publishes the two splits; all three call this, so
they always agree. `rl_band` says whether select's pass-rate band cuts the RL set (only a policy's pass rates),
for select's report and the dataset card.
"""

from __future__ import annotations

import hashlib
from typing import Any

from builder.config import BuildConfig
from builder.llm.roles import role_models


def is_rl_environment(env_id: str, rl_fraction: float, declared: str | None = None) -> bool:
    """Whether an environment belongs to the held-out `rl` split rather than `train`.

    Pure and deterministic: the first 8 bytes of sha256(env_id), read as a fraction of 2**64, are compared with
    `rl_fraction` (`select.rl_env_fraction`). An environment therefore keeps its split across runs and releases,
    as long as the fraction is unchanged, and raising the fraction only moves environments from train to rl.
    `declared` is the split an imported environment's source gave it (`Origin.split`: EnvScaler's `_rl`
    suffix), which wins, so a release keeps the source's held-out environments held out.
    """
    if declared is not None:
        return declared == "rl"
    digest = hashlib.sha256(env_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < rl_fraction


def declared_split(provenance: Any) -> str | None:
    """The split a record's source declared (`Provenance.origin.split`), from a record's provenance or its row."""
    origin = provenance.get("origin") if isinstance(provenance, dict) else getattr(provenance, "origin", None)
    if origin is None:
        return None
    return origin.get("split") if isinstance(origin, dict) else origin.split


def rl_band(config: BuildConfig) -> dict[str, Any]:
    """Whether the RL pass-rate band cuts the `rl` split, and whose pass rates it cuts (the report's `rl_band`;
    select names the models its rl trajectories carry, this the one the config gives that role)."""
    low, high = config.select.rl_pass_band
    played_by = role_models(config)["rl_agent"]
    if config.rollout.rl_agent_model is None:
        return {
            "applied": False, "band": [low, high], "measured_with": played_by,
            "reason": "rollout.rl_agent_model is not set, so the synthesis model played the rl environments; its "
            "pass rates say nothing about a policy's, so every measured rl scenario is kept with its pass rate",
        }  # fmt: skip
    return {"applied": True, "band": [low, high], "measured_with": played_by, "reason": ""}
