"""A release's scenarios as a `verifiers` taskset (`pip install builder[verifiers]`; verifiers' v1 API).

`BuilderTaskset` loads the non-conversational scenarios of one split of a release (`path`: a release folder or
a Hub dataset repo id, `revision`, `split`, default `rl`) as tasks whose prompt is the rollouts' system prompt
and task. Each rollout's tools are its environment's: verifiers starts a task-scoped tool server
(`SandboxToolset`, an MCP server in its own process, `python -m builder.adapters.verifiers`) that plays the
scenario in a builder sandbox session and pushes the environment's state into the rollout's `EpisodeState`
after every call. The reward is the share of the scenario's checks that pass on that final state.

    import verifiers.v1 as vf
from pydantic import Field
    env = vf.load_environment(vf.EnvConfig(taskset={"id": "builder.adapters.verifiers", "path": REPO,
                                                     "revision": "v0.1.0"}))

`hub_package(folder, name, path, revision)` writes the package an Environments Hub upload is (a `pyproject.toml`
and a module exporting its taskset through `__all__`), pinned to one release. Conversational scenarios are
left out: verifiers drives users with its own `UserSimEnv`, which this adapter does not wire to builder's
simulator yet.
"""

from __future__ import annotations

import asyncio
import inspect
import keyword
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import verifiers.v1 as vf
from pydantic import Field

from builder.envs.checks import checks_from_scenario, run_checks
from builder.envs.trainer import LiveEnvironment, agent_prompt, column, environment_code, scenario_world, tool_method
from builder.sandbox.runtime import Sandbox

__all__ = ["BuilderTaskset"]  # verifiers' loader takes the one Taskset a module exports


class ScenarioData(vf.TaskData):
    """One scenario with its environment's code: what the rollout and its tool server need."""

    scenario_id: str
    env_id: str
    code: str
    initial_state: dict[str, Any]
    checks: list[str]
    now: str


class EpisodeState(vf.State):
    final_state: dict[str, Any] | None = None
    """The environment's state after the last tool call (None: no call was made)."""


class SandboxToolset(vf.Toolset[vf.ToolsetConfig, EpisodeState]):
    """The task's environment tools (bare names, the published schemas' signatures) over a sandbox session."""

    TOOL_PREFIX = None

    def __init__(self, config: vf.ToolsetConfig) -> None:
        super().__init__(config)
        self._live: LiveEnvironment | None = None

    async def setup_task(self, task: Any) -> None:
        data: ScenarioData = task  # a task-scoped server is handed the rollout's task data
        scenario = {"env_id": data.env_id, "now": data.now, "initial_state": data.initial_state, "checks": data.checks}
        self._live = LiveEnvironment({"code": data.code}, scenario)  # its own sandbox, in this server process
        self._live.reset()
        self._exit_stack.callback(self._live.close)

    def register(self, mcp: Any) -> None:
        assert self._live is not None, "verifiers sets the task up before registering tools"
        for tool in self._live.tools:
            function = tool["function"]
            mcp.add_tool(self._with_state(self._tool(function)), name=function["name"],
                         description=function.get("description") or function["name"])  # fmt: skip

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
    tools: vf.ToolsetConfig = vf.ToolsetConfig()


class ScenarioTask(vf.Task[ScenarioData, EpisodeState, ScenarioTaskConfig]):
    @classmethod
    def toolsets(cls, config: ScenarioTaskConfig) -> list[vf.Toolset]:
        return [SandboxToolset(config.tools)]

    @vf.reward(weight=1.0)
    async def checks(self, trace: vf.Trace) -> float:
        """Share of the scenario's checks passed on the final state (the initial one if no tool ran)."""
        final = trace.state.final_state
        return await asyncio.to_thread(grade, self.data, self.data.initial_state if final is None else final)


def grade(data: ScenarioData, final_state: dict[str, Any]) -> float:
    """Run the scenario's checks in a fresh sandbox at the scenario's date-time and seed."""
    now, seed = scenario_world({"env_id": data.env_id, "now": data.now})
    with Sandbox() as sandbox:
        verdict = run_checks(sandbox, checks_from_scenario(data.checks), data.initial_state, final_state,
                             now=now, seed=seed)  # fmt: skip
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
        for row in scenarios:
            if row["mode"] != "non_conversational":
                continue
            environment = by_id[row["env_id"]]
            state = column(row, "initial_state")
            yield ScenarioTask(ScenarioData(
                id=row["scenario_id"], name=row["scenario_id"], prompt=row["task"],
                system_prompt=agent_prompt("rollout_task", row, environment), scenario_id=row["scenario_id"],
                env_id=row["env_id"], code=environment_code(environment), initial_state=state,
                checks=list(column(row, "checks")), now=scenario_world(row)[0],
            ), config.task)  # fmt: skip


PYPROJECT = """[project]
name = "{name}"
version = "{version}"
description = "The scenarios of {path} at {revision} as a verifiers taskset (generated by builder)."
requires-python = ">=3.11"
dependencies = ["builder[verifiers]"]

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
