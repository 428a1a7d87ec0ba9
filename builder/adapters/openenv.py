"""A published environment as an OpenEnv `Environment` (`pip install builder-envs[openenv]`).

`BuilderEnvironment(environment_row, scenario_rows)` is an `MCPEnvironment`: `reset(scenario_id=...)` starts an
episode of one scenario in builder's sandbox and returns the prompt the rollouts used (system prompt and user
message) with the tools; `step(ListToolsAction())` and `step(CallToolAction(tool_name=..., arguments=...))`
are MCP tool calls with the published schemas; `step(MessageAction(content=...))` is the agent's plain-text
turn. As in rollouts, a text turn ends a non-conversational episode, and in a conversational one it goes to
the simulated user (`SimulatedUser`), whose answer comes back in the observation until the user ends the
conversation. The observation that ends the episode has `done=True` and the published reward, the agent's text
turns being its answer (None when the simulated user kept leaking or failed: the episode is void).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from fastmcp import FastMCP
from fastmcp.tools import Tool, ToolResult
from mcp.types import TextContent
from openenv.core.env_server import Action, MCPEnvironment, Observation, State
from pydantic import Field
from pydantic.json_schema import SkipJsonSchema

from builder.envs.conversation import REFUSED, Conversation, SimulatedUser, scenario_from_row
from builder.envs.trainer import LiveEnvironment, agent_prompt, column
from builder.errors import BuilderError
from builder.sandbox.runtime import Sandbox


class MessageAction(Action):
    """The agent's plain-text turn (a reply without tool calls)."""

    content: str = Field(description="What the agent says")


class BuilderObservation(Observation):
    """What the agent sees next: new `messages` (the prompt after `reset`, the user's answer after a message)
    and, after `reset`, the OpenAI `tools`."""

    messages: list[dict[str, Any]] = Field(default_factory=list)
    tools: list[dict[str, Any]] = Field(default_factory=list)


class BuilderState(State):
    scenario_id: str | None = None
    end_reason: str | None = Field(None, description="agent_done, user_stop, user_leak or user_error once ended")


class _SessionTool(Tool):
    """An MCP tool with the published schema that forwards to the live sandboxed session."""

    call: SkipJsonSchema[Callable[[dict[str, Any]], str]] = Field(exclude=True)

    async def run(self, arguments: dict[str, Any]) -> ToolResult:
        return ToolResult(content=[TextContent(type="text", text=self.call(arguments))])


class BuilderEnvironment(MCPEnvironment):
    """One environment of a release and its scenarios, episodes in builder's sandbox.

    Args:
        environment: a row of the `environments` data.
        scenarios: rows of the `scenarios` data of this environment.
        sandbox: the runtime to share (one per process is plenty); a private one is started when omitted.
        user: the simulated user of conversational scenarios (required if there are any).
    """

    SUPPORTS_CONCURRENT_SESSIONS = True  # every instance has its own session; the sandbox forks a worker each

    def __init__(
        self, environment: Mapping[str, Any], scenarios: Iterable[Mapping[str, Any]],
        sandbox: Sandbox | None = None, user: SimulatedUser | None = None,
    ) -> None:  # fmt: skip
        self.environment = environment
        self.scenarios = {str(column(s, "scenario_id", "id")): s for s in scenarios}
        if not self.scenarios:
            raise BuilderError("an OpenEnv environment needs at least one scenario")
        talks = [s for s in self.scenarios.values() if s.get("mode") == "conversational"]
        if talks and user is None:
            raise BuilderError(f"{len(talks)} conversational scenario(s) need a simulated user: pass user=...")
        self.user = user
        self.live = LiveEnvironment(environment, None, sandbox)
        self._order = itertools.cycle(self.scenarios)
        self._conversation: Conversation | None = None
        self._said: list[str] = []
        self._state = BuilderState()
        server = FastMCP(str(column(environment, "name", "env_id")))
        for tool in self.live.tools:
            function = tool["function"]
            server.add_tool(_SessionTool(
                name=function["name"], description=function.get("description") or function["name"],
                parameters=function["parameters"], call=self._tool_call(function["name"]),
            ))  # fmt: skip
        super().__init__(server)

    def _tool_call(self, name: str) -> Callable[[dict[str, Any]], str]:
        def call(arguments: dict[str, Any]) -> str:
            if self._state.end_reason is not None:
                return REFUSED  # the episode is over, as after `user_stop` in rollouts
            return self.live.call(name, arguments)

        return call

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, scenario_id: str | None = None, **kwargs: Any
    ) -> BuilderObservation:
        """A fresh episode of `scenario_id` (else the `seed`-th scenario, else the next one in order)."""
        if scenario_id is None:
            ids = list(self.scenarios)
            scenario_id = ids[seed % len(ids)] if seed is not None else next(self._order)
        if scenario_id not in self.scenarios:
            raise BuilderError(f"unknown scenario {scenario_id!r}; this environment has {sorted(self.scenarios)}")
        scenario = self.scenarios[scenario_id]
        self.live.reset(scenario)
        self._state = BuilderState(episode_id=episode_id or uuid.uuid4().hex, scenario_id=scenario_id)
        self._conversation = None
        self._said: list[str] = []  # the agent's text turns: its answer (`builder.envs.answer`)
        if scenario.get("mode") != "conversational":
            system, opening = agent_prompt("rollout_task", scenario, self.environment), str(column(scenario, "task"))
        else:  # the rollouts' conversational prompt: the agent talks to the user in plain text
            assert self.user is not None
            names = [tool["function"]["name"] for tool in self.live.tools]
            self._conversation = Conversation(self.user, scenario_from_row(scenario), names)
            system = agent_prompt("rollout_conversation", scenario, self.environment)
            opening = self._conversation.open()
            if opening is None:
                return self._end(self._conversation.end_reason)
        messages = [{"role": "system", "content": system}, {"role": "user", "content": opening}]
        return BuilderObservation(messages=messages, tools=self.live.tools)

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        self._state.step_count += 1
        return super().step(action, timeout_s=timeout_s, **kwargs)

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        if not isinstance(action, MessageAction):
            return BuilderObservation(metadata={"error": f"unsupported action {type(action).__name__}"})
        if self._state.end_reason is not None:
            return self._end(self._state.end_reason)
        self._said.append(action.content)
        if self._conversation is None:
            return self._end("agent_done")
        answer = self._conversation.reply(action.content)
        if self._conversation.ended:
            return self._end(self._conversation.end_reason)
        return BuilderObservation(messages=[{"role": "user", "content": answer}])

    def _end(self, reason: str | None) -> BuilderObservation:
        self._state.end_reason = reason
        void = self._conversation is not None and self._conversation.void
        reward = None if void else self.live.reward("\n".join(self._said))
        return BuilderObservation(done=True, reward=reward, metadata={"end_reason": reason})

    @property
    def state(self) -> BuilderState:
        return self._state

    def close(self) -> None:
        self.live.close()
        super().close()
