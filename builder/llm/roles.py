"""Which model plays which role, as `llm` configs derived from the build config: the RL agent
(`rollout.rl_agent_model`) and the user simulator (`rollout.user_model`); and the names the models of a run go
by (`served_model_id`, `role_models`), which provenance, trajectories, select's report and the dataset card use.
Opening their clients is `builder.llm.connect`'s."""

from __future__ import annotations

from builder.config import BuildConfig, LLMConfig
from builder.errors import ConfigError
from builder.llm.weights import EMBEDDED_MODEL, EMBEDDED_MODEL_CONTEXT


def served_model_id(config: LLMConfig) -> str:
    """The model's name in provenance, `Trajectory.model` and every cache key: the served name on `config.url`
    (or `config.urls`), else the model the managed server loads."""
    return config.served_model_name if config.url or config.urls else config.model


def role_models(config: BuildConfig) -> dict[str, str]:
    """Who plays each role of a run, by the names its records carry: `synthesis` (wrote the environments and
    scenarios, judged them at evaluate), `user` (the user simulator), `train_agent` and `rl_agent` (the agent in
    `train` and in `rl` environments)."""
    synthesis = served_model_id(config.llm)
    return {
        "synthesis": synthesis,
        "user": config.rollout.user_model or synthesis,
        "train_agent": synthesis,
        "rl_agent": config.rollout.rl_agent_model or synthesis,
    }


def user_model_config(config: BuildConfig) -> LLMConfig | None:
    """The `llm` config of the user simulator's model when it is not the agent's (`rollout.user_model`): the same
    servers (`llm.url` or `llm.urls`) under that served name; None when it is unset.

    Raises:
        ConfigError: `rollout.user_model` is set without `llm.url(s)` (the managed server serves one model).
    """
    name = config.rollout.user_model
    if name is None:
        return None
    if not (config.llm.url or config.llm.urls):
        raise ConfigError(
            "rollout.user_model needs llm.url or llm.urls: the managed vLLM server serves only the agent's model"
        )
    return config.llm.model_copy(update={"served_model_name": name})


def rl_agent_config(config: BuildConfig) -> LLMConfig | None:
    """The `llm` config of the RL agent (`rollout.rl_agent_model`), or None when none is set.

    Derived from `llm`: it keeps how a server is reached and paced (device, timeouts, retries, concurrency,
    cache, tool parser) and drops what belongs to the synthesis model (its chat template, reasoning parser and
    thinking mode, dtype, tensor parallelism, extra vLLM arguments), so the policy gets its own defaults: for
    the builtin SmolLM2 the packaged ChatML+tools template and, on CPU, the dtype `server_command` picks; it
    plays without a reasoning mode. The context is `rollout.rl_agent_max_model_len`, else `llm.max_model_len`
    capped at 8192 for the builtin model. With `rollout.rl_agent_url` (or `rollout.rl_agent_urls`, several
    servers paced and balanced as `llm.urls`) the model is used there under the name `rl_agent_model`; else a
    managed server loads it.
    """
    rollout = config.rollout
    if rollout.rl_agent_model is None:
        return None
    context = rollout.rl_agent_max_model_len
    if context is None:
        context = config.llm.max_model_len
        if rollout.rl_agent_model == EMBEDDED_MODEL:
            context = min(context, EMBEDDED_MODEL_CONTEXT)
    served = rollout.rl_agent_url or rollout.rl_agent_urls
    derived = {
        "model": rollout.rl_agent_model,
        "url": rollout.rl_agent_url,
        "urls": rollout.rl_agent_urls,
        "served_model_name": rollout.rl_agent_model if served else config.llm.served_model_name,
        "max_model_len": context,
        "chat_template": None,
        "reasoning_parser": None,
        "thinking": "off",
        "dtype": "auto",
        "tensor_parallel_size": 1,
        "extra_server_args": (),
    }
    return LLMConfig.model_validate({**config.llm.model_dump(), **derived})
