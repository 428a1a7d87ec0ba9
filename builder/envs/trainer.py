"""Trainer-facing API: a live, sandboxed environment built from one published `environments` + `scenarios` row.

`LiveEnvironment` is the plain API (reset, tools, call -> str, reward, solved, close). `trl_environment_factory`
adapts it to TRL's `GRPOTrainer(environment_factory=..., reward_funcs=trl_reward)`: a class whose public methods
are the tools (real signatures, type hints and Google docstrings, so TRL derives the same schemas), `reset(**row)`
picks the scenario named by the dataset row, and `trl_reward` scores each episode with the published reward: the
scenario's checks on the environment's state and, when the task asks to be told something, the completion's
answer (`builder.envs.answer`; TRL hands reward functions the completion, not the environment's `get_reward`). A
conversational scenario is one episode too: its class also has a `reply_to_user` tool, `reset` returns the
simulated user's opening message and the tool returns the user's answers (`builder.envs.conversation`). The
environment code never runs in the trainer's process; only schemas and JSON cross the boundary. Every episode
runs at its scenario's `now` (the row's `now` column; 2024-06-01T09:00:00 for rows without one) with the
scenario's seed, as the rollouts did, so the same calls give the same results and "today" is the scenario's.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal, Optional, Union

from builder.envs.answer import agent_answer, answer_check
from builder.envs.checks import Verdict, checks_from_scenario, published_reward
from builder.envs.conversation import REFUSED, REPLY_TOOL, Conversation, SimulatedUser, scenario_from_row
from builder.envs.lint import Contract
from builder.envs.schema import inspect_source
from builder.envs.session import Session
from builder.envs.signatures import tool_defaults
from builder.errors import BuilderError
from builder.records import scenario_seed
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED
from builder.views.agent import agent_system_prompt
from builder.views.code import policy_text


def column(row: Mapping[str, Any], *names: str) -> Any:
    """The first present column among `names`, decoding JSON-string columns."""
    for name in names:
        if name in row and row[name] is not None:
            value = row[name]
            is_json_text = isinstance(value, str) and name.endswith(("_json", "state", "checks"))
            return json.loads(value) if is_json_text else value
    raise BuilderError(f"row has none of the columns {', '.join(names)}")


def environment_code(environment: Mapping[str, Any]) -> str:
    """The row's code, verified against `code_sha256` when the row carries one (loading runs Hub code)."""
    code = str(column(environment, "code"))
    expected = environment.get("code_sha256")
    if expected and hashlib.sha256(code.encode()).hexdigest() != expected:
        raise BuilderError("environment code does not match its code_sha256; refusing to run it")
    return code


def environment_contract(environment: Mapping[str, Any]) -> Contract:
    """How strictly the row's code is linted before it runs: `import` for an imported environment (its provenance
    names an `origin`), else `strict` (`builder.records.Environment.contract`)."""
    provenance = environment.get("provenance")
    if isinstance(provenance, str):
        provenance = json.loads(provenance)
    return "import" if isinstance(provenance, Mapping) and provenance.get("origin") else "strict"


def scenario_world(scenario: Mapping[str, Any]) -> tuple[str, int]:
    """The `(now, seed)` of a scenario row's episodes: its `now` column and the seed of its environment and now."""
    now = str(scenario.get("now") or DEFAULT_NOW)
    env_id = scenario.get("env_id")
    return now, scenario_seed(str(env_id), now) if env_id else DEFAULT_SEED


class LiveEnvironment:
    """One environment with one scenario, in the sandbox. Create, `reset()`, `call()`, `reward()`, `close()`.

    Args:
        environment: a row of the `environments` data (needs `code`).
        scenario: a row of the `scenarios` data (needs `initial_state` or `initial_state_json`, `task`,
            `checks`); JSON-string columns are decoded.
        sandbox: the runtime to use (one per process is plenty); a private one is started when omitted.
        contract: how strictly the code is linted (default: `environment_contract(environment)`).
    """

    def __init__(
        self, environment: Mapping[str, Any], scenario: Mapping[str, Any] | None = None,
        sandbox: Sandbox | None = None, contract: Contract | None = None,
    ) -> None:  # fmt: skip
        self._own_sandbox = sandbox is None
        self.sandbox = sandbox or Sandbox()
        self.code = environment_code(environment)
        self.interface = inspect_source(self.code, contract or environment_contract(environment))
        self.scenario: Mapping[str, Any] = scenario or {}
        self._session: Session | None = None
        self._initial: dict[str, Any] = {}
        self._verdict: tuple[str, Verdict] | None = None
        self._seen: list[str] = []
        self.now, self.seed = scenario_world(self.scenario)

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` list, in the published order (by name, as export writes it and TRL lists a class's
        methods)."""
        return sorted(self.interface.tools, key=lambda tool: tool["function"]["name"])

    @property
    def task(self) -> str:
        """The scenario's task text ('' without a scenario)."""
        return str(self.scenario.get("task", ""))

    def reset(self, scenario: Mapping[str, Any] | None = None) -> str:
        """Start a fresh episode from the (given or current) scenario's initial state; returns the task."""
        if scenario is not None:
            self.scenario = scenario
        self._close_session()
        state = column(self.scenario, "initial_state", "initial_state_json") if self.scenario else {}
        self.now, self.seed = scenario_world(self.scenario)
        self._session = Session(self.sandbox, self.code, state, interface=self.interface, now=self.now, seed=self.seed)
        self._initial = self._session.snapshot()
        self._verdict = None
        self._seen: list[str] = []
        return self.task

    def call(self, name: str, arguments: Mapping[str, Any] | str | None = None) -> str:
        """Call a tool; returns the tool message content (JSON result or `Error: ...`), never raises."""
        if self._session is None:
            self.reset()
        assert self._session is not None
        self._verdict = None
        content = self._session.call(name, dict(arguments) if isinstance(arguments, Mapping) else arguments).content()
        self._seen.append(content)  # what the agent has read: the answer's facts must be among it
        return content

    def state(self) -> dict[str, Any]:
        """The current state snapshot."""
        if self._session is None:
            self.reset()
        assert self._session is not None
        return self._session.snapshot()

    def verdict(self, answer: str = "") -> Verdict:
        """The published reward's verdict on (initial, current) state and on `answer`, what the agent said
        (`builder.envs.checks.published_reward`: the scenario's checks with its collateral guard, in a fresh sandbox
        worker, and its answer facts; cached until a call or another answer)."""
        if self._verdict is None or self._verdict[0] != answer:
            checks = checks_from_scenario(list(column(self.scenario, "checks", "checks_json")))
            final = self.state()
            verdict = published_reward(
                self.sandbox, checks, self._initial, final, now=self.now, seed=self.seed,
                check=answer_check(self.scenario), answer=answer, seen="\n".join(self._seen),
            )  # fmt: skip
            self._verdict = (answer, verdict)
        return self._verdict[1]

    def reward(self, answer: str = "") -> float:
        """The published reward: 1 when solved, 0 for no progress or collateral damage, else partial credit.
        `answer` is what the agent said (`builder.envs.answer.agent_answer`); it matters when the task asks to be
        told something."""
        return self.verdict(answer).reward

    def solved(self, answer: str = "") -> bool:
        """True when every check (the collateral guard included) passed and `answer` states the answer facts."""
        return self.verdict(answer).solved

    def _close_session(self) -> None:
        if self._session is not None:
            self._session.close()
            self._session = None

    def close(self) -> None:
        """End the episode (and the private sandbox, if this object started one)."""
        self._close_session()
        if self._own_sandbox:
            self.sandbox.close()


CONVERSATIONAL_SUFFIX = "/conversational"


def trl_environment_factory(
    environment: Mapping[str, Any], scenarios: Iterable[Mapping[str, Any]], sandbox: Sandbox | None = None,
    user: SimulatedUser | None = None,
) -> type:  # fmt: skip
    """A class for `GRPOTrainer(environment_factory=...)`: one instance per rollout, tools as methods.

    TRL calls `reset(**row)` with the dataset row's columns; the row names its scenario by `scenario_id`
    (or carries it whole in `scenario`), and its `now` column, when present, is the episode's date-time.
    Pass `reward_funcs=trl_reward`, which scores each episode with the published reward. All instances share one
    sandbox (started on first use unless given).

    With `user`, the class plays conversational scenarios: `reset` returns the simulated user's opening message
    (TRL appends it to the row's last, empty, user message), `reply_to_user(message)` returns the user's answer,
    and once the user has ended the conversation every tool call is refused. `trl_reward` gives None (TRL leaves
    the rollout out of the reward) when the simulator failed or kept leaking, as rollouts void such episodes.
    """
    code = environment_code(environment)
    interface = inspect_source(code, environment_contract(environment))
    by_id = {str(column(s, "id", "scenario_id")): s for s in scenarios}
    shared: dict[str, Sandbox] = {"sandbox": sandbox} if sandbox is not None else {}
    tool_names = [tool["function"]["name"] for tool in interface.tools]

    def __init__(self: Any) -> None:
        if "sandbox" not in shared:
            shared["sandbox"] = Sandbox()
        self._live = LiveEnvironment(environment, None, shared["sandbox"])
        self._conversation: Conversation | None = None

    def reset(self: Any, **row: Any) -> str | None:
        if "scenario" in row and row["scenario"] is not None:
            scenario = row["scenario"]
            scenario = json.loads(scenario) if isinstance(scenario, str) else scenario
        else:
            scenario = by_id[str(column(row, "scenario_id"))]
        if row.get("now"):
            scenario = {**scenario, "now": row["now"]}
        self._live.reset(scenario)
        if user is None:
            return None  # the row's prompt already holds the task
        self._conversation = Conversation(user, scenario_from_row(scenario), tool_names)
        return self._conversation.open() or ""

    def _reward(self: Any, answer: str) -> float | None:
        if self._conversation is not None and self._conversation.void:
            return None
        return self._live.reward(answer)

    def reply_to_user(self, message: str) -> str:  # no annotation on self: TRL reads every hint as a parameter
        """Send a message to the user and wait for the answer.

        Args:
            message: What to tell or ask the user, in plain language.

        Returns:
            The user's answer.
        """
        if self._conversation is None:
            return "Error: there is no user in this episode."
        return self._conversation.reply(message)

    namespace: dict[str, Any] = {"__init__": __init__, "reset": reset, "_reward": _reward}
    defaults = tool_defaults(code)
    for tool in interface.tools:
        name = tool["function"]["name"]
        namespace[name] = tool_method(tool["function"], defaults.get(name, {}))
    name = interface.class_name
    if user is not None:
        if REPLY_TOOL in namespace:
            raise BuilderError(f"{interface.class_name} has a tool named {REPLY_TOOL}, the user's channel")
        namespace[REPLY_TOOL] = reply_to_user
        name += "Conversational"
    namespace["__doc__"] = f"Sandboxed {interface.class_name} for TRL (generated by builder)."
    return type(name, (), namespace)


def trl_reward(completions: Sequence[Any], environments: Sequence[Any] | None = None, **_: Any) -> list[float | None]:
    """The reward function for `GRPOTrainer(reward_funcs=trl_reward, environment_factory=...)`: each completion's
    published reward from its environment instance (a `trl_environment_factory` class), with what the agent said
    in the completion as its answer (`builder.envs.answer.agent_answer`). None for a void episode, which TRL
    leaves out of the reward.

    Raises:
        BuilderError: the trainer passed no environments (it was built without `environment_factory`).
    """
    if environments is None:
        raise BuilderError("trl_reward needs GRPOTrainer(environment_factory=trl_environment_factories(...))")
    return [env._reward(completion_answer(completion)) for completion, env in zip(completions, environments,
                                                                                  strict=True)]  # fmt: skip


def completion_answer(completion: Any) -> str:
    """What the agent said in a TRL completion: the text itself, or its messages' text and `reply_to_user` calls."""
    if isinstance(completion, str):
        return completion
    return agent_answer(message for message in completion if isinstance(message, Mapping))


def trl_prompt_row(scenario: Mapping[str, Any], environment: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The columns `GRPOTrainer` needs from a published `scenarios` row: `prompt` (the agent system prompt the
    rollouts used when the `environments` row is given, then the user message), `environment` (the key of
    `trl_environment_factories`), `scenario_id` and `now` (which `reset` reads). The system prompt tells the
    agent the scenario's date-time. Use it with `Dataset.map`.

    A non-conversational scenario's user message is its task. A conversational one's is empty: `reset` fills
    it with the simulated user's opening message, and its system prompt tells the agent to talk to the user
    through `reply_to_user`; its `environment` is `<env_id>/conversational`.
    """
    conversational = scenario.get("mode") == "conversational"
    messages = [{"role": "user", "content": "" if conversational else str(column(scenario, "task"))}]
    if environment is not None:
        name = "rollout_conversation_tool" if conversational else "rollout_task"
        messages.insert(0, {"role": "system", "content": agent_prompt(name, scenario, environment)})
    env_id = str(column(scenario, "env_id"))
    return {
        "prompt": messages,
        "environment": env_id + CONVERSATIONAL_SUFFIX if conversational else env_id,
        "scenario_id": str(column(scenario, "scenario_id", "id")),
        "now": scenario_world(scenario)[0],
    }


def agent_prompt(name: str, scenario: Mapping[str, Any], environment: Mapping[str, Any]) -> str:
    """The agent system prompt `prompts/<name>.md` for a scenario row: the environment's name, domain,
    description and policy (its `policy` column, else the rules in its code's docstring), and the scenario's
    date-time: the prompt rollouts use (`builder.views.agent`)."""
    policy = environment.get("policy")
    return agent_system_prompt(
        name, name=str(column(environment, "name")), domain=str(column(environment, "domain")),
        description=str(column(environment, "description")), now=scenario_world(scenario)[0],
        policy=str(policy) if policy is not None else policy_text(str(environment.get("code") or "")),
    )  # fmt: skip


def trl_environment_factories(
    environments: Iterable[Mapping[str, Any]], scenarios: Iterable[Mapping[str, Any]],
    sandbox: Sandbox | None = None, user: SimulatedUser | None = None,
) -> dict[str, type]:  # fmt: skip
    """`{env_id: class}` for a dict `environment_factory` (TRL selects per row by its `environment` column),
    plus `{env_id}/conversational` for environments with conversational scenarios, played with `user`.

    Raises:
        BuilderError: conversational scenarios without a `user` (give one, or filter them out first with
            `mode == "non_conversational"`).
    """
    scenario_rows = list(scenarios)
    factories = {}
    for environment in environments:
        env_id = str(column(environment, "env_id", "id", "name"))
        mine = [s for s in scenario_rows if str(s.get("env_id")) == env_id]
        talks = [s for s in mine if s.get("mode") == "conversational"]
        if talks and user is None:
            raise BuilderError(
                f"{len(talks)} conversational scenario(s) of {env_id} need a simulated user: pass "
                "user=SimulatedUser.endpoint(base_url, model), or keep only rows with mode == 'non_conversational'"
            )
        factories[env_id] = trl_environment_factory(environment, [s for s in mine if s not in talks], sandbox)
        if talks:
            factories[env_id + CONVERSATIONAL_SUFFIX] = trl_environment_factory(environment, talks, sandbox, user)
    return factories


def tool_method(function: Mapping[str, Any], defaults: Mapping[str, Any] | None = None) -> Callable[..., str]:
    """A method with the tool's real signature, annotations and docstring that forwards to `self._live` (a
    `LiveEnvironment`), refusing once `self._conversation` (if any) has ended; written so that
    `transformers.utils.get_json_schema` (what TRL calls) gives back `function` itself."""
    name = function["name"]
    parameters = function["parameters"]
    required = set(parameters.get("required", []))
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    annotations: dict[str, Any] = {}
    doc_args = []
    for pname, schema in parameters.get("properties", {}).items():
        annotations[pname] = python_type(schema)
        default = inspect.Parameter.empty if pname in required else (defaults or {}).get(pname, schema.get("default"))
        params.append(inspect.Parameter(pname, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=annotations[pname]))  # fmt: skip
        doc_args.append(f"    {pname}: {schema.get('description', pname)}")
    returns = function.get("return", {"type": "string", "description": "The tool's JSON result."})
    annotations["return"] = python_type(returns)

    def method(self: Any, **arguments: Any) -> str:
        conversation = getattr(self, "_conversation", None)
        if conversation is not None and conversation.ended:
            return REFUSED  # the user ended the episode, as at `user_stop` in rollouts
        return self._live.call(name, arguments)

    method.__name__ = method.__qualname__ = name
    method.__signature__ = inspect.Signature(params, return_annotation=annotations["return"])  # type: ignore[attr-defined]
    method.__annotations__ = annotations
    args_block = "\n\nArgs:\n" + "\n".join(doc_args) if doc_args else ""
    returns_block = f"\n\nReturns:\n    {returns['description']}" if "description" in returns else ""
    method.__doc__ = f"{function.get('description') or name}{args_block}{returns_block}"
    return method


def python_type(schema: Mapping[str, Any]) -> Any:
    """The Python annotation whose JSON schema is `schema` (for libraries that derive schemas from hints)."""
    if schema.get("nullable") is True:
        inner = python_type({key: value for key, value in schema.items() if key != "nullable"})
        return Optional[inner]  # noqa: UP045 (Any | None is not an expression)
    if "enum" in schema:
        return Literal[tuple(schema["enum"])]
    if "anyOf" in schema:
        return Union[tuple(python_type(option) for option in schema["anyOf"])]  # noqa: UP007
    kind = schema.get("type")
    if isinstance(kind, list):
        rest = [k for k in kind if k != "null"]
        inner = Union[tuple(python_type({**schema, "type": k}) for k in rest)] if rest else type(None)  # noqa: UP007
        return Optional[inner] if "null" in kind else inner  # noqa: UP045
    if kind == "array":
        if "prefixItems" in schema:
            return tuple[tuple(python_type(item) for item in schema["prefixItems"])]
        return list[python_type(schema["items"])] if "items" in schema else list
    if kind == "object":
        extra = schema.get("additionalProperties")
        return dict[str, python_type(extra)] if isinstance(extra, Mapping) else dict
    simple = {"string": str, "integer": int, "number": float, "boolean": bool, "null": type(None)}
    return simple.get(kind, Any)
