"""`builder env check`: lint, load, then call every tool with schema-valid arguments and report misbehaviour.

Runtime problems use the same `Problem` record as the lint (line 0), with these stable codes; a problem one
tool call caused is a `ToolProblem` that also names the tool and the arguments it was called with, so whoever
repairs the tool can be shown the failing call.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.lint import Contract, ContractError, Problem
from builder.envs.schema import EnvInterface, inspect_source
from builder.envs.session import Session, SessionError, ToolResult
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW

RUNTIME_CODES: dict[str, str] = {
    "load_failed": "the module or the class's __init__ fails, or the state cannot be applied",
    "state_not_json": "the state holds something that is not JSON",
    "tool_raised": "a tool raised instead of returning an error value",
    "tool_timeout": "a tool did not return before the deadline",
    "tool_crashed": "a tool killed its worker or exhausted its memory",
    "result_not_json": "a tool returned something that is not JSON, or too large",
    "signature_mismatch": "the worker refused arguments that fit the derived schema",
    "nondeterministic": "the same calls from the same state gave different results or states",
}
# Runtime findings that are warnings, not problems (import contract only): the report's `warnings`.
RUNTIME_WARNINGS: dict[str, str] = {
    "private_state_omitted": "a private attribute that is not JSON was left out of the state (import contract)",
}
_KIND_TO_CODE = {
    "raised": "tool_raised", "timeout": "tool_timeout", "crashed": "tool_crashed", "memory": "tool_crashed",
    "protocol": "tool_crashed", "not_json": "result_not_json", "too_large": "result_not_json",
    "bad_arguments": "signature_mismatch",
}  # fmt: skip


class OmittedAttribute(Problem):
    """A private state attribute left out of the snapshots because it is not JSON (import contract)."""

    attribute: str


class ToolProblem(Problem):
    """A runtime problem of one tool: the call that showed it."""

    tool: str
    arguments: dict[str, Any]


class ProbeReport(BaseModel):
    """What `probe_environment` found: the `problems` (empty: the environment behaves), the `results` of the
    first pass of calls (none when the module did not load) and the runtime `warnings` (`RUNTIME_WARNINGS`)."""

    model_config = ConfigDict(frozen=True)

    problems: tuple[Problem, ...]
    results: tuple[ToolResult, ...] = ()
    warnings: tuple[Problem, ...] = ()


def probe_environment(
    sandbox: Sandbox, source: str, state: dict[str, Any] | None = None, now: str = DEFAULT_NOW,
    contract: Contract = "strict",
) -> ProbeReport:  # fmt: skip
    """Lint, load, then call every tool twice from `state` at `now`; what was found, as a `ProbeReport`.

    Lint problems count under the strict contract; under import only those that leave nothing to load do (the
    others are information: `inspect_source(source, "import").problems`), and the runtime problems decide.

    Both passes run at the same `now` and seed, so a tool that stamps records with the clock or makes ids with
    `uuid4()` is deterministic; only what the sandbox cannot fix (duration clocks, `SystemRandom`, object ids,
    state kept outside the instance) is reported as `nondeterministic`.
    """
    try:
        interface = inspect_source(source, contract)
    except ContractError as error:
        return ProbeReport(problems=error.problems)
    try:
        first, calls, first_state, omitted = _run_pass(sandbox, source, interface, state, now)
        second, _, second_state, _ = _run_pass(sandbox, source, interface, state, now)
    except SessionError as error:
        code = "state_not_json" if error.kind in ("state_not_json", "not_json") else "load_failed"
        return ProbeReport(problems=[Problem(code=code, line=0, message=str(error))])
    warnings: list[Problem] = []
    for name in sorted(omitted):
        message = f"state attribute {name!r} is not JSON: left out of the state (private, import contract)"
        warnings.append(OmittedAttribute(code="private_state_omitted", line=0, message=message, attribute=name))
    problems: list[Problem] = []
    for r, arguments in zip(first, calls, strict=True):
        if not r.ok:
            code = _KIND_TO_CODE.get(r.error_kind or "", "tool_raised")
            message = f"{r.name}: {r.error}"
            problems.append(ToolProblem(code=code, line=0, message=message, tool=r.name, arguments=arguments))
    differing = [(a.name, args) for a, b, args in zip(first, second, calls, strict=True) if a != b]
    for name, arguments in differing:
        message = f"{name}: its result differed between two runs from the same state"
        problems.append(ToolProblem(code="nondeterministic", line=0, message=message, tool=name, arguments=arguments))
    if not differing and first_state != second_state:
        problems.append(Problem(code="nondeterministic", line=0, message="the final state differed between two runs"))
    return ProbeReport(problems=problems, results=first, warnings=warnings)


def _run_pass(
    sandbox: Sandbox, source: str, interface: EnvInterface, state: dict[str, Any] | None, now: str
) -> tuple[list[ToolResult], list[dict[str, Any]], dict[str, Any], set[str]]:
    """Every tool called once, in order: the results, the arguments of each call, the final state and the private
    attributes left out of it."""
    with Session(sandbox, source, state, interface=interface, now=now) as session:
        start = session.snapshot()
        calls = [generate_arguments(tool["function"]["parameters"], start) for tool in interface.tools]
        results = [
            session.call(tool["function"]["name"], args) for tool, args in zip(interface.tools, calls, strict=True)
        ]
        return results, calls, session.snapshot(), session.omitted


def generate_arguments(parameters: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Schema-valid arguments for the required parameters, preferring ids that exist in `state`."""
    properties = parameters.get("properties", {})
    return {name: _value(properties[name], name, state) for name in parameters.get("required", [])}


def _value(schema: dict[str, Any], name: str, state: dict[str, Any]) -> Any:
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"] or schema["anyOf"]
        return _value(options[0], name, state)
    kind = schema.get("type", "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "array":
        return [_value(schema["items"], name, state)] if "items" in schema else []
    simple = {"integer": 1, "number": 1.0, "boolean": True, "object": {}, "null": None}
    return simple[kind] if kind in simple else _known_id(name, state)


def _known_id(name: str, state: dict[str, Any]) -> str:
    """The first key of the state collection the parameter name points to (account_id -> accounts)."""
    stem = name.removesuffix("_id").removesuffix("_ids")
    collections = [(k, v) for k, v in state.items() if isinstance(v, dict) and v]
    for key, value in collections:
        if stem and (key.startswith(stem) or stem in key):
            return str(sorted(value)[0])
    return str(sorted(collections[0][1])[0]) if collections else "x"
