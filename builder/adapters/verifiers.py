"""A release's scenarios as a `verifiers` taskset (`pip install builder-envs[verifiers]`; verifiers' v1 API).

`BuilderTaskset` loads the scenarios of one split of a release (`path`: a release folder or a Hub dataset repo
id, `revision`, `split`, default `rl`) as tasks whose prompt is the rollouts' system prompt and task. Each
rollout's tools are its environment's: verifiers starts a task-scoped tool server (`SandboxToolset`, an MCP
server in its own process, `python -m builder.adapters.verifiers`) that plays the scenario in a builder sandbox
session and pushes the environment's state into the rollout's `EpisodeState` after every call. The reward is the
published reward (`builder.envs.checks.published_reward`) of that final state and of what the agent said.

Conversational scenarios are episodes too, as in the TRL path (`builder.envs.conversation`), when the taskset is
given a user model (`--env.taskset.task.tools.user-model`, `...user-base-url`, `...user-api-key-var`; left out
without one): the task's setup asks builder's simulated user for the opening message, which becomes the
prompt; the tool server adds a `reply_to_user` tool whose result is the user's answer, with builder's leak
guard; once the user has ended the conversation every tool call is refused. An episode whose user failed or
kept leaking raises `vf.TaskError` at scoring, so it carries no reward (rollouts void such episodes).

    import verifiers.v1 as vf
    hub_package(Path("pkg"), "my_envs", REPO, "v0.1.0")  # then `pip install ./pkg`
    env = vf.load_environment(vf.resolve_env_config({"taskset": {"id": "my_envs"}}))

`hub_package(folder, name, path, revision)` writes the package an Environments Hub upload is (a `pyproject.toml`
and a module exporting its taskset through `__all__`), pinned to one release.
"""

from __future__ import annotations

import asyncio
import inspect
import keyword
import logging
import os
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import verifiers.v1 as vf
from pydantic import Field

from builder.envs.answer import agent_answer, answer_check, tool_text
from builder.envs.checks import checks_from_scenario, published_reward
from builder.envs.conversation import REPLY_TOOL, Conversation, SimulatedUser, scenario_from_row
from builder.envs.lint import Contract
from builder.envs.schema import inspect_source
from builder.envs.trainer import (
    LiveEnvironment,
    agent_prompt,
    column,
    environment_code,
    environment_contract,
    scenario_world,
    tool_method,
)
from builder.records import ChatMessage
from builder.sandbox.runtime import Sandbox

__all__ = ["BuilderTaskset"]  # verifiers' loader takes the one Taskset a module exports

logger = logging.getLogger(__name__)


class ScenarioData(vf.TaskData):
    """One scenario with its environment's code: what the rollout and its tool server need."""

    scenario_id: str
    env_id: str
    code: str
    contract: Contract = "strict"
    initial_state: dict[str, Any]
    checks: list[str]
    answer_facts: list[str] = []
    """What the agent's answer must state (`builder.envs.answer`; empty: the task asks for nothing)."""
    family: str = "plain"
    mode: str = "non_conversational"
    now: str
    scenario: dict[str, Any] | None = None
    """A conversational scenario's published row, for the simulated user (None: non-conversational)."""


class EpisodeState(vf.State):
    final_state: dict[str, Any] | None = None
    """The environment's state after the last tool call (None: no call was made)."""
    user_end: str | None = None
    """Why the simulated user ended the conversation (`user_stop`, `user_leak`, `user_error`; None: it goes on)."""


class SandboxToolsetConfig(vf.ToolsetConfig):
    user_model: str | None = None
    """The model that plays the user of conversational scenarios (None: they are left out)."""
    user_base_url: str = "http://127.0.0.1:8000/v1"
    """Its OpenAI-compatible endpoint."""
    user_api_key_var: str | None = None
    """The environment variable holding its API key (None: a local server that needs none)."""

    def simulated_user(self) -> SimulatedUser:
        assert self.user_model is not None
        key = os.environ.get(self.user_api_key_var, "") if self.user_api_key_var else "local"
        return SimulatedUser.endpoint(self.user_base_url, self.user_model, api_key=key or "local")


def conversation(config: SandboxToolsetConfig, data: ScenarioData, tool_names: list[str]) -> Conversation:
    """The simulated user of a conversational task (builder's `UserSimulator`: its answers depend only on the
    conversation so far, so the task's setup and the tool server each hold one)."""
    assert data.scenario is not None
    return Conversation(config.simulated_user(), scenario_from_row(data.scenario), tool_names)


class SandboxToolset(vf.Toolset[SandboxToolsetConfig, EpisodeState]):
    """The task's environment tools (bare names, the published schemas' signatures) over a sandbox session, and
    `reply_to_user` for a conversational task."""

    TOOL_PREFIX = None

    def __init__(self, config: SandboxToolsetConfig) -> None:
        super().__init__(config)
        self._live: LiveEnvironment | None = None
        self._conversation: Conversation | None = None

    async def setup_task(self, task: Any) -> None:
        data: ScenarioData = task  # a task-scoped server is handed the rollout's task data
        scenario = {"env_id": data.env_id, "now": data.now, "initial_state": data.initial_state, "checks": data.checks}
        # its own sandbox, in this server process
        self._live = LiveEnvironment({"code": data.code}, scenario, contract=data.contract)
        self._live.reset()
        self._exit_stack.callback(self._live.close)
        if data.scenario is not None:  # the task's setup made the opening the prompt: the user has spoken once
            names = [tool["function"]["name"] for tool in self._live.tools]
            self._conversation = conversation(self.config, data, names)
            self._conversation.messages.append(ChatMessage(role="user", content=data.prompt_text))

    def register(self, mcp: Any) -> None:
        assert self._live is not None, "verifiers sets the task up before registering tools"
        for tool in self._live.tools:
            function = tool["function"]
            mcp.add_tool(self._with_state(self._tool(function)), name=function["name"],
                         description=function.get("description") or function["name"])  # fmt: skip
        if self._conversation is not None:
            mcp.add_tool(self._with_state(self.reply_to_user), name=REPLY_TOOL)

    def reply_to_user(self, message: Annotated[str, Field(description="What to tell or ask the user.")]) -> str:
        """Send a message to the user and wait for the answer."""
        assert self._conversation is not None
        answer = self._conversation.reply(message)  # blocking: the simulator runs on its own loop thread
        self.state.user_end = self._conversation.end_reason
        return answer

    def _tool(self, function: dict[str, Any]) -> Callable[..., str]:
        method = tool_method(function)
        call = types.MethodType(method, self)

        def tool(**arguments: Any) -> str:
            assert self._live is not None
            content = call(**arguments)
            self.state.final_state = self._live.state()
            return content

        # The MCP server derives the input schema from the signature (the tool's own, without `self`); the
        # argument descriptions ride along as pydantic `Field`s.
        properties = function["parameters"].get("properties", {})
        parameters = [
            p.replace(annotation=Annotated[p.annotation, Field(description=properties[p.name].get("description"))])
            for p in list(inspect.signature(method).parameters.values())[1:]
        ]
        tool.__signature__ = inspect.Signature(parameters, return_annotation=str)  # type: ignore[attr-defined]
        tool.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": str}
        tool.__name__, tool.__doc__ = method.__name__, method.__doc__
        return tool


class ScenarioTaskConfig(vf.TaskConfig):
    tools: SandboxToolsetConfig = SandboxToolsetConfig()


class ScenarioTask(vf.Task[ScenarioData, EpisodeState, ScenarioTaskConfig]):
    @classmethod
    def toolsets(cls, config: ScenarioTaskConfig) -> list[vf.Toolset]:
        return [SandboxToolset(config.tools)]

    async def setup(self, trace: vf.Trace) -> None:
        """A conversational task's prompt is the simulated user's opening message (asked here, before the agent
        starts); a user that gives none voids the episode."""
        if self.data.scenario is None:
            return
        tool_names = list(inspect_source(self.data.code, self.data.contract).tool_names)
        talk = conversation(self.config.tools, self.data, tool_names)
        opening = await asyncio.to_thread(talk.open)
        if opening is None:
            raise vf.TaskError(f"the simulated user gave no opening message ({talk.end_reason}: {talk.detail})")
        trace.task.data = trace.task.data.model_copy(update={"prompt": opening})

    @vf.reward(weight=1.0)
    async def checks(self, trace: vf.Trace) -> float:
        """The published reward of the final state (the initial one if no tool ran)."""
        if trace.state.user_end not in (None, "user_stop"):
            raise vf.TaskError(f"the simulated user failed ({trace.state.user_end}): the episode is void")
        final = trace.state.final_state
        answer = agent_answer(message.model_dump() for message in trace.assistant_messages)
        seen = tool_text(message.model_dump() for message in trace.tool_messages)
        initial = self.data.initial_state
        return await asyncio.to_thread(grade, self.data, initial if final is None else final, answer, seen)


def grade(data: ScenarioData, final_state: dict[str, Any], answer: str = "", seen: str = "") -> float:
    """The published reward (`builder.envs.checks.published_reward`) in a fresh sandbox at the scenario's
    date-time and seed, `answer` being what the agent said (`builder.envs.answer.agent_answer`) and `seen` what
    the tools returned."""
    now, seed = scenario_world({"env_id": data.env_id, "now": data.now})
    with Sandbox() as sandbox:
        verdict = published_reward(sandbox, checks_from_scenario(data.checks), data.initial_state, final_state,
                                   now=now, seed=seed, check=answer_check(data.model_dump()), answer=answer,
                                   seen=seen)  # fmt: skip
    return verdict.reward


class BuilderTasksetConfig(vf.TasksetConfig):
    path: str = ""
    """A release folder (`hub.release_root/<version>`) or a Hub dataset repo id."""
    revision: str | None = None
    """The release tag to load from the Hub (pin it: a branch moves)."""
    split: str = "rl"
    task: ScenarioTaskConfig = ScenarioTaskConfig()


class BuilderTaskset(vf.Taskset[ScenarioTask, BuilderTasksetConfig]):
    def load(self) -> Iterator[ScenarioTask]:
        from datasets import load_dataset

        config = self.config
        envs = load_dataset(config.path, "environments", split=config.split, revision=config.revision)
        scenarios = load_dataset(config.path, "scenarios", split=config.split, revision=config.revision)
        by_id = {row["env_id"]: row for row in envs}
        talks = config.task.tools.user_model is not None
        left_out = 0
        for row in scenarios:
            conversational = row["mode"] == "conversational"
            if conversational and not talks:
                left_out += 1
                continue
            environment = by_id[row["env_id"]]
            state = column(row, "initial_state")
            prompt_name = "rollout_conversation_tool" if conversational else "rollout_task"
            yield ScenarioTask(ScenarioData(
                id=row["scenario_id"], name=row["scenario_id"],
                prompt="" if conversational else row["task"],  # the user's opening, asked at setup
                system_prompt=agent_prompt(prompt_name, row, environment), scenario_id=row["scenario_id"],
                env_id=row["env_id"], code=environment_code(environment), contract=environment_contract(environment),
                initial_state=state,
                checks=list(column(row, "checks")), answer_facts=list(row.get("answer_facts") or []),
                family=row.get("family") or "plain", mode=row["mode"],
                now=scenario_world(row)[0],
                scenario=dict(row) if conversational else None,
            ), config.task)  # fmt: skip
        if left_out:
            logger.warning("%d conversational scenario(s) left out: no user model (task.tools.user_model)", left_out)


PYPROJECT = """[project]
name = "{name}"
version = "{version}"
description = "The scenarios of {path} at {revision} as a verifiers taskset (generated by builder)."
requires-python = ">=3.11"
dependencies = ["builder-envs[verifiers]"]

[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"
"""

MODULE = '''"""{name}: the scenarios of {path} at {revision} as a verifiers taskset (generated by builder)."""

import verifiers.v1 as vf
from pydantic import Field

from builder.adapters.verifiers import BuilderTaskset, BuilderTasksetConfig, ScenarioTask


class ReleaseConfig(BuilderTasksetConfig):
    path: str = {path!r}
    revision: str | None = {revision!r}


class ReleaseTaskset(BuilderTaskset, vf.Taskset[ScenarioTask, ReleaseConfig]):
    """The release's `rl` scenarios (override with --env.taskset.split / path / revision)."""


__all__ = ["ReleaseTaskset"]
'''


def hub_package(folder: Path, name: str, path: str, revision: str | None, version: str = "0.1.0") -> Path:
    """Write the Environments Hub package of one release into `folder` (`pyproject.toml`, `<name>/__init__.py`);
    returns the module folder. `name` must be a Python identifier (the taskset id verifiers imports)."""
    if not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"package name {name!r} is not a Python identifier")
    module = folder / name
    module.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(PYPROJECT.format(name=name, version=version, path=path, revision=revision))
    (module / "__init__.py").write_text(MODULE.format(name=name, path=path, revision=revision))
    return module


if __name__ == "__main__":  # verifiers starts a task's tool server as `python -m <module of the toolset>`
    SandboxToolset.run()
