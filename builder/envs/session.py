"""Live environment sessions: one sandboxed worker per session, tools called by name with JSON arguments.

Every failure of a call comes back as a `ToolResult` with `ok=False`, a stable `error_kind` and a message a
model can read, the way a real API answers: unknown tool, bad arguments, the tool raised, timed out, ran out of
memory, returned something that is not JSON or too large, or killed its worker. After a worker dies the session
forks a fresh one and replays the calls made so far, so the next call sees the same state.

Every session runs in a deterministic world (builder/sandbox/world.py): the clock reads the session's `now`
(frozen) and `random`/`uuid` draw from its `seed`, so the same calls from the same state give the same results
on every run and every machine.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict

from builder.envs.lint import Contract
from builder.envs.schema import EnvInterface, inspect_source
from builder.envs.snapshots import Lineage, diff_states, from_json, patched, remember
from builder.envs.validate import argument_error
from builder.errors import ItemError
from builder.sandbox.runtime import Sandbox, Worker, WorkerFailure
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED, parse_now

__all__ = ["Session", "SessionError", "ToolResult", "diff_states"]

# Error kinds that leave the environment's state as it was before the call could have changed it.
_REPLAYABLE = {"raised", "bad_arguments", "memory", "not_json", "too_large"}


class SessionError(ItemError):
    """The environment could not be loaded or its state cannot be read; the message says why."""

    reason = "session_failed"

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class ToolResult(BaseModel):
    """The outcome of one tool call: a JSON `result`, or an `error` with a stable `error_kind`."""

    model_config = ConfigDict(frozen=True)

    name: str
    ok: bool
    result: Any = None
    error: str | None = None
    error_kind: str | None = None

    @property
    def refused(self) -> bool:
        """The tool answered with a domain error: `{"success": false}`, or an `error` without success."""
        value = self.result
        return isinstance(value, dict) and (
            value.get("success") is False or ("error" in value and not value.get("success"))
        )

    def content(self) -> str:
        """The text of the tool message an agent sees: the result as JSON, or `Error: <message>`."""
        return json.dumps(self.result, ensure_ascii=False) if self.ok else f"Error: {self.error}"


class Session:
    """One live environment instance in a sandbox worker.

    Args:
        sandbox: the runtime that forks workers.
        source: the environment module's code (linted and inspected here, never run in this process).
        state: the initial state: attribute name -> JSON value, set on an instance created with no arguments.
            Under the import contract a class with BFCL's `_load_scenario(scenario)` is first given the state
            through it (so it fills its own defaults), then the state's attributes are set as given.
        interface: the result of `inspect_source(source, contract)` when the caller already has it (its
            `contract` then decides).
        contract: the trust level `source` is inspected under when no interface is given (envs/lint.py).
        now: the episode's date-time, ISO 8601 naive local time (`2024-06-01T09:00:00`): what the environment's
            clock reads, frozen, for the whole session.
        seed: seeds `random` and `uuid` inside the worker.
        json_state: the caller promises that `state` is JSON data exactly as `json.loads` returns it (no NaN or
            Infinity) and that it will not change it: the first snapshot is then `state` itself when the loaded
            instance holds exactly its attributes, instead of the worker's whole state read back.

    Raises:
        ValueError: `now` is not an ISO 8601 naive date-time.
        ContractError: the source violates the contract.
        SessionError: the module fails to load (kind `load_failed`, `timeout`, `crashed`, ...).
    """

    def __init__(
        self, sandbox: Sandbox, source: str, state: dict[str, Any] | None = None,
        interface: EnvInterface | None = None, *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED,
        contract: Contract = "strict", json_state: bool = False,
    ) -> None:  # fmt: skip
        parse_now(now)
        self.json_state = json_state
        self.now, self.seed = now, int(seed)
        self.sandbox = sandbox
        self.source = source
        self.interface = interface or inspect_source(source, contract)
        self.initial_state = dict(state or {})
        self._schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in self.interface.tools}
        self._history: list[tuple[str, dict[str, Any]]] = []
        # Private attributes left out of the snapshots because they are not JSON (import contract only).
        self.omitted: set[str] = set()
        self._worker: Worker | None = None
        # The last snapshot and the worker's generation number for it: the next snapshot asks only for what
        # changed since (builder/sandbox/tracking.py) and is built from it, sharing every unchanged value.
        self._snapshot: dict[str, Any] | None = None
        self._generation: int | None = None
        self.lineage: Lineage | None = None  # how the last snapshot was patched from the one before (diff_states)
        self._worker = self._start()

    @property
    def tools(self) -> list[dict[str, Any]]:
        """The OpenAI `tools` list of this environment."""
        return list(self.interface.tools)

    def _start(self) -> Worker:
        self._generation = None  # a new worker has never sent this session a snapshot
        worker = self.sandbox.open_worker()
        load = {
            "op": "load", "code": self.source, "class_name": self.interface.class_name,
            "state": self.initial_state, "tools": list(self._schemas), "now": self.now, "seed": self.seed,
            "load_scenario": self.interface.contract == "import",
            "omit_private": self.interface.contract == "import",
            "as_snapshot": self.json_state and not self._history,  # a restarted worker replays calls after loading
        }  # fmt: skip
        try:
            reply = worker.request(load)
        except WorkerFailure as failure:
            raise SessionError(failure.kind, f"loading the environment failed: {failure}") from None
        if not reply.get("ok"):
            worker.kill()
            raise SessionError("load_failed", f"loading the environment failed: {reply.get('error')}")
        if type(reply.get("seeded")) is int and load["as_snapshot"]:
            self._snapshot, self._generation = dict(self.initial_state), reply["seeded"]
        return worker

    def call(self, name: str, arguments: dict[str, Any] | str | None = None) -> ToolResult:
        """Call tool `name` with a JSON object (a dict or its JSON text). Never raises for tool failures."""
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as error:
                return _error(name, "bad_arguments", f"arguments are not valid JSON: {error}")
        arguments = {} if arguments is None else arguments
        if name not in self._schemas:
            return _error(name, "unknown_tool", f"unknown tool {name!r}; available: {', '.join(self._schemas)}")
        problem = argument_error(self._schemas[name], arguments)
        if problem:
            return _error(name, "bad_arguments", problem)
        try:
            reply = self._live_worker().request({"op": "call", "name": name, "args": arguments})
        except WorkerFailure as failure:
            self._worker = None  # the next call forks a fresh worker and replays the history
            return _error(name, failure.kind, f"{failure}")
        if reply.get("ok"):
            try:
                result = from_json(reply["json"])
            except (KeyError, TypeError, ValueError):
                # Only a worker whose tool code escaped the encoder answers like this: never trust it again, and
                # leave the call out of the replay so the fresh worker does not run it a second time.
                self.close()
                return _error(name, "protocol", "the sandbox worker's reply was not the JSON it promised")
            self._history.append((name, arguments))
            return ToolResult(name=name, ok=True, result=result)
        kind = str(reply.get("kind", "raised"))
        if kind in _REPLAYABLE:
            self._history.append((name, arguments))
        return _error(name, kind, str(reply.get("error", "the tool failed")))

    def _live_worker(self) -> Worker:
        if self._worker is not None and self._worker.alive:
            return self._worker
        worker = self._start()
        for name, arguments in self._history:
            try:
                worker.request({"op": "call", "name": name, "args": arguments})
            except WorkerFailure as failure:
                raise WorkerFailure(failure.kind, f"restoring the session failed while replaying {name}") from None
        self._worker = worker
        return worker

    def snapshot(self) -> dict[str, Any]:
        """The state as JSON data: every instance attribute. Raises SessionError if it is not JSON.

        Under the import contract a private (`_`-prefixed) attribute that is not JSON is left out instead (a
        seeded `random.Random`, a lock) and named in `omitted`: the determinism gate judges what remains.

        After the first, a snapshot is built from the previous one and the records the worker reports as
        possibly changed: it shares every other value with the previous snapshot, so treat snapshots as
        read-only (copy before changing one).
        """
        worker = self._live_worker()
        try:
            reply = worker.request({"op": "snapshot", "since": self._generation})
        except WorkerFailure as failure:
            self._worker = None
            raise SessionError(failure.kind, f"reading the state failed: {failure}") from None
        if not reply.get("ok"):
            raise SessionError(str(reply.get("kind")), f"reading the state failed: {reply.get('error')}")
        self.omitted.update(str(name) for name in reply.get("omitted") or ())
        try:
            if "patches" in reply and self._snapshot is not None and self._generation is not None:
                state = patched(self._snapshot, reply["patches"])
                remember(self, Lineage(state, self._snapshot, reply["patches"]))
            else:
                state = from_json(reply["json"])
                if type(state) is not dict:
                    raise ValueError("the state is not an object")
            generation = reply["generation"]
            if type(generation) is not int:
                raise ValueError("no generation")
        except (KeyError, TypeError, ValueError, IndexError):
            self.close()
            raise SessionError("protocol", "reading the state failed: the worker's reply was not JSON") from None
        self._snapshot, self._generation = state, generation
        return state

    def close(self) -> None:
        """Kill the worker (idempotent)."""
        if self._worker is not None:
            self._worker.kill()
            self._worker = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _error(name: str, kind: str, message: str) -> ToolResult:
    return ToolResult(name=name, ok=False, error=message, error_kind=kind)
