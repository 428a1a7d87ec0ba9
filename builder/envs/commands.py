"""The `builder env` subcommands as plain functions: parsed values in, printed report out, exit code back.

Each takes the `contract` the file is read under (envs/lint.py): `strict` refuses any lint problem, `import`
prints the problems as counted warnings (on stderr, or in the JSON report) and carries on in the sandbox.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from builder.config import SandboxConfig
from builder.envs.checks import checks_from_file, run_checks
from builder.envs.graph import extract_graph
from builder.envs.jsontext import dumps_indented
from builder.envs.lint import Contract, ContractError, Problem, problem_counts
from builder.envs.probe import probe_environment
from builder.envs.schema import EnvInterface, inspect_source, tools_json
from builder.envs.session import Session, SessionError
from builder.errors import BuilderError
from builder.sandbox.frames import quiet_collector
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW


def env_schema(path: Path, out: TextIO | None = None, contract: Contract = "strict") -> int:
    """Print the environment's tools as an OpenAI `tools` JSON list. Exit 1 if `contract` refuses the module.
    `out` defaults to the `sys.stdout` of the call."""
    out = out or sys.stdout
    try:
        interface = inspect_source(read_file(path), contract)
    except ContractError as error:
        print(str(error), file=sys.stderr)
        return 1
    _print_warnings(interface)
    print(tools_json(interface), file=out)
    return 0


def env_check(
    path: Path, state_path: Path | None = None, as_json: bool = False,
    config: SandboxConfig | None = None, out: TextIO = sys.stdout, now: str = DEFAULT_NOW,
    contract: Contract = "strict",
) -> int:  # fmt: skip
    """Lint, load, call every tool twice from the same state at `now`; exit 1 if any problem was found (under
    import: any runtime problem, or a module with no single class)."""
    source = read_file(path)
    state = read_json(state_path) if state_path else None
    with Sandbox(config) as sandbox:
        probe = probe_environment(sandbox, source, state, now, contract)
    problems, results = probe.problems, probe.results
    warnings = [*_warnings(source, contract), *probe.warnings]  # the lint's information, then the runtime's
    if as_json:
        report = {
            "ok": not problems,
            "contract": contract,
            "problems": [p.model_dump() for p in problems],
            "warnings": [p.model_dump() for p in warnings],
            "warning_counts": problem_counts(warnings),
            "calls": [r.model_dump() for r in results],
        }
        print(json.dumps(report, indent=2, ensure_ascii=False), file=out)
    else:
        for result in results:
            print(f"{result.name}: {_short(result.content())}", file=out)
        for problem in problems:
            print(str(problem), file=out)
        for warning in warnings:
            print(f"warning: {warning}", file=out)
        counted = f", {len(warnings)} warning(s)" if warnings else ""
        print(f"{path}: {'ok' if not problems else f'{len(problems)} problem(s)'}{counted}", file=out)
    return 1 if problems else 0


def env_graph(
    path: Path, state_path: Path | None = None, form: str = "text",
    config: SandboxConfig | None = None, out: TextIO | None = None, now: str = DEFAULT_NOW,
    contract: Contract = "strict",
) -> int:  # fmt: skip
    """Print the tool dependency graph from STATE (default: `__init__`'s) as text, JSON or DOT; exit 1 if
    `contract` refuses the module or it does not load. `out` defaults to the `sys.stdout` of the call."""
    out = out or sys.stdout
    source = read_file(path)
    state = read_json(state_path) if state_path else None
    try:
        with Sandbox(config) as sandbox:
            graph = extract_graph(sandbox, source, state, now=now, contract=contract)
    except (ContractError, SessionError) as error:
        print(str(error), file=sys.stderr)
        return 1
    if form == "json":
        print(json.dumps(graph.model_dump(), indent=2, ensure_ascii=False), file=out)
    elif form == "dot":
        print(graph.to_dot(), file=out)
    else:
        for node in graph.nodes:
            print(
                f"{node.name}: reads {', '.join(node.reads) or '-'}; writes {', '.join(node.writes) or '-'}", file=out
            )
        for edge in graph.edges:
            if edge.kind == "data":
                line = f"{edge.source}.{edge.output or '(result)'} -> {edge.target}({edge.input}) e.g. {edge.example!r}"
            else:
                line = f"{edge.source} writes {edge.output} -> {edge.target} reads it"
            print(f"{edge.kind}: {line}", file=out)
        if graph.truncated:
            print("(the probe budget ran out: some data edges may be missing)", file=out)
    return 0


def env_replay(
    path: Path, state_path: Path, calls_path: Path, checks_path: Path | None = None, as_json: bool = False,
    config: SandboxConfig | None = None, out: TextIO = sys.stdout, now: str = DEFAULT_NOW,
    contract: Contract = "strict",
) -> int:  # fmt: skip
    """Run CALLS in one session from STATE at `now`, then optional checks (at `now` too); exit 1 if the
    environment cannot load (or `contract` refuses it)."""
    source, state_text = read_file(path), read_file(state_path)
    # A big state is millions of objects, held here two or three times (the state, its snapshots, the report):
    # every collection the command's allocations trigger would walk them all (measured: a quarter of a 20 MB
    # replay). The command makes no reference cycles worth collecting before it ends, so the collector waits.
    with quiet_collector(len(state_text)):
        constants: list[str] = []  # NaN, Infinity: JSON text Python reads, but not JSON data a snapshot holds
        state = _parse_json(state_text, state_path, lambda name: constants.append(name) or float(name))
        calls = read_json(calls_path)
        if not isinstance(calls, list) or not all(isinstance(c, dict) and "name" in c for c in calls):
            raise BuilderError(f"{calls_path}: expected a JSON list of {{'name': ..., 'arguments': {{...}}}}")
        report = _replay(source, state, calls, checks_path, config, now, contract, json_state=not constants)
        if report is None:
            return 1
        _print_replay(report, as_json, out)
    return 0


def _replay(
    source: str, state: Any, calls: list[dict[str, Any]], checks_path: Path | None, config: SandboxConfig | None,
    now: str, contract: Contract, json_state: bool,
) -> dict[str, Any] | None:  # fmt: skip
    report: dict[str, Any] = {"results": []}
    with Sandbox(config) as sandbox:
        try:
            # The state was just decoded from its file and nothing else holds it: the session may use it as the
            # first snapshot instead of reading the loaded state back (see Session's json_state).
            with Session(sandbox, source, state, now=now, contract=contract, json_state=json_state) as session:
                initial = session.snapshot()
                for call in calls:
                    result = session.call(call["name"], call.get("arguments", {}))
                    entry = {"name": result.name}
                    entry.update({"result": result.result} if result.ok else {"error": result.error})
                    report["results"].append(entry)
                report["final_state"] = session.snapshot()
        except (ContractError, SessionError) as error:
            print(str(error), file=sys.stderr)
            return None
        if checks_path is not None:
            checks = checks_from_file(read_file(checks_path))
            verdict = run_checks(sandbox, checks, initial, report["final_state"], now=now)
            report["checks"] = [c.model_dump() for c in verdict.checks]
            report["reward"] = verdict.reward
    return report


def _print_replay(report: dict[str, Any], as_json: bool, out: TextIO) -> None:
    # The report holds the whole final state: tens of MB for a big one, which json.dumps indents slowly.
    if as_json:
        print(dumps_indented(report), file=out)
        return
    for entry in report["results"]:
        outcome = json.dumps(entry["result"], ensure_ascii=False) if "result" in entry else f"Error: {entry['error']}"
        print(f"{entry['name']} -> {_short(outcome)}", file=out)
    print("final state:", dumps_indented(report["final_state"]), file=out)
    for check in report.get("checks", []):
        verdict = "pass" if check["passed"] else f"FAIL{': ' + check['error'] if check['error'] else ''}"
        print(f"{check['name']}: {verdict}", file=out)
    if "reward" in report:
        print(f"reward: {report['reward']:.3f}", file=out)


def _warnings(source: str, contract: Contract) -> list[Problem]:
    """The lint problems `contract` reports as information (none under strict, which refuses them)."""
    try:
        return list(inspect_source(source, contract).problems)
    except ContractError:
        return []


def _print_warnings(interface: EnvInterface) -> None:
    for warning in interface.problems:
        print(f"warning: {warning}", file=sys.stderr)
    if interface.problems:
        counts = ", ".join(f"{code} {count}" for code, count in interface.warnings.items())
        print(f"{len(interface.problems)} warning(s) under the import contract: {counts}", file=sys.stderr)


def _short(text: str, limit: int = 300) -> str:
    return text if len(text) <= limit else text[:limit] + "…"


def read_file(path: Path) -> str:
    """The text of a file a command names (BuilderError, a clear one, when it cannot be read)."""
    try:
        return Path(path).read_text()
    except OSError as error:
        raise BuilderError(f"cannot read {path}: {error.strerror}") from None


def read_json(path: Path) -> Any:
    """The JSON a command's file holds (BuilderError when it is not JSON)."""
    return _parse_json(read_file(path), path)


def _parse_json(text: str, path: Path, parse_constant: Callable[[str], Any] | None = None) -> Any:
    try:
        with quiet_collector(len(text)):  # a state of tens of MB: see frames.quiet_collector
            return json.loads(text, parse_constant=parse_constant)
    except json.JSONDecodeError as error:
        raise BuilderError(f"{path} is not valid JSON: {error}") from None
