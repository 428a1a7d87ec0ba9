"""The zygote: a pre-warmed interpreter that forks one hardened worker per episode (run as a script).

Started by `builder.sandbox.runtime` with a clean environment, `cwd=/` and one control socket. It imports the
allowed modules once, then for every request (two pipe fds passed with SCM_RIGHTS) forks a worker that closes
everything else, applies the hardening of `harden.py` and serves frames on its pipes. Stdlib + msgpack only:
the generated code runs here, so nothing of the parent (pydantic, the store, secrets) is ever imported.
"""

from __future__ import annotations

import builtins
import copy
import gc
import importlib
import inspect
import json
import os
import signal
import socket
import sys
import time
from typing import Any

import allowed
import frames
import harden
import tracking
import world


class SoftTimeout(BaseException):
    """Raised by the parent's SIGALRM inside a call; a BaseException so `except Exception` in generated code misses
    it."""


def _preload(extra: list[str]) -> None:
    for name in list(allowed.ALLOWED_MODULES) + extra:
        importlib.import_module(name)
    # Warm lazy paths that would otherwise open files after the lockdown (docs/sandbox.md).
    import datetime
    import decimal
    import random
    import re
    import uuid

    datetime.datetime.strptime("2024-01-02 03:04", "%Y-%m-%d %H:%M")
    datetime.date(2024, 1, 1).strftime("%A %B")
    "x".encode("idna"), "x".encode("latin-1"), "x".encode("ascii"), b"x".decode("utf-16", "ignore")
    uuid.uuid4(), random.Random(0).random(), decimal.Decimal("1.10") * 3, re.compile(r"\d+\w*").match("1a")
    json.loads(json.dumps({"a": [1.5, None, True]}))
    try:
        raise KeyError("warm traceback formatting")
    except KeyError as error:
        _describe(error)
    # The episode's fixed clock and seeded randomness, before any environment module can bind the originals.
    world.install()
    tracking.install()
    datetime.datetime.now().isoformat(), datetime.date.today(), time.strftime("%c"), uuid.uuid1(), random.Random()


ERROR_CHARS = 2000  # builder.limits.DETAIL_CHARS; this file runs alone in the worker, importing nothing of builder
PRISTINE_BUILTINS = dict(builtins.__dict__)


def _describe(error: BaseException) -> str:
    try:
        text = f"{type(error).__name__}: {error}"
    except BaseException:  # a hostile __str__
        text = type(error).__name__
    return text[:ERROR_CHARS]


def _harden(config: dict[str, Any]) -> dict[str, str]:
    """Apply every layer the machine allows, in order; returns layer -> detail for the ones that took effect."""
    layers: dict[str, str] = {"clean_env": ",".join(sorted(os.environ)), "deadline_kill": "parent SIGKILL"}
    steps = [
        ("rlimits", lambda: harden.apply_rlimits(config["memory_mb"], config["cpu_s"], config["open_files"])),
        ("uid_drop", harden.drop_uid),
        ("landlock", harden.apply_landlock),
        ("seccomp", harden.apply_seccomp),
    ]
    for name, step in steps:
        try:
            layers[name] = step()
        except OSError as error:
            layers[f"-{name}"] = str(error)
    if config.get("netns_applied"):
        layers["netns"] = "empty network namespace"
    if "netns" in layers or "seccomp" in layers:
        layers["no_network"] = "socket() denied" if "seccomp" in layers else "empty network namespace"
    return layers


# The result and state encoder, built once (`json.dumps` with options builds a new encoder on every call).
JSON_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False)


class Worker:
    """One episode: at most one environment instance, or check functions, served over two pipes."""

    def __init__(self, config: dict[str, Any], req_fd: int, resp_fd: int) -> None:
        self.config = config
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.env: Any = None
        self.tools: dict[str, Any] = {}
        self.signatures: dict[str, inspect.Signature] = {}
        # tool -> (accepted keyword names, required names) when its signature is plain keywords, for a set check
        # in place of the much slower Signature.bind on every call.
        self.keywords: dict[str, tuple[frozenset[str], frozenset[str]] | None] = {}
        # Under the import contract, private attributes that are not JSON (BFCL's `self._random = Random(seed)`)
        # are left out of snapshots rather than failing them; `omitted` names them for the caller to report.
        self.omit_private = False
        self.omitted: set[str] = set()
        # What the parent's copy of the state is, so that a snapshot can send only what changed (tracking.py).
        self.baseline = tracking.Baseline({})
        self.reader: frames.FrameReader | None = None
        self.handlers = {"load": self.load, "call": self.call, "snapshot": self.snapshot, "check": self.check}
        self.busy = False

    def on_alarm(self, signum: int, frame: Any) -> None:
        """SIGALRM from the parent at the soft deadline: a timeout error if a request is running, else nothing.

        The parent sends it (its clock already runs for the hard deadline), which spares the worker a
        setitimer pair on every call. Between requests it only interrupts a read, which Python retries.
        """
        if self.busy:
            raise SoftTimeout()

    def serve(self, layers: dict[str, str]) -> None:
        self.send({"ok": True, "layers": layers, "pid": os.getpid()})
        reader = self.reader = frames.FrameReader(self.req_fd, self.config["max_frame_bytes"])
        while True:
            try:
                request = reader.read()
            except frames.FrameError:
                os._exit(0)
            self.send(self.handle(request))

    def send(self, reply: dict[str, Any]) -> None:
        data = frames.encode(reply)
        if len(data) - frames.HEADER.size > self.config["max_frame_bytes"]:
            data = frames.encode({"ok": False, "kind": "too_large", "error": "response exceeds the size cap"})
        frames.write_all(self.resp_fd, data)

    def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        handler = self.handlers.get(op)
        if handler is None:
            return {"ok": True} if op == "ping" else {"ok": False, "kind": "protocol", "error": f"bad op {op!r}"}
        self.busy = True
        try:
            return handler(request)
        except SoftTimeout:
            return {"ok": False, "kind": "timeout", "error": f"timed out after {self.config['soft_timeout_s']}s"}
        except MemoryError:
            return {"ok": False, "kind": "memory", "error": "MemoryError: the memory limit was reached"}
        except RecursionError:
            return {"ok": False, "kind": "raised", "error": "RecursionError: maximum recursion depth exceeded"}
        except BaseException as error:
            return {"ok": False, "kind": "raised", "error": _describe(error)}
        finally:
            self.busy = False

    def load(self, request: dict[str, Any]) -> dict[str, Any]:
        world.begin(request["now"], request["seed"])
        namespace = _fresh_namespace("generated_env")
        exec(compile(request["code"], "<environment>", "exec"), namespace)
        cls = namespace.get(request["class_name"])
        if not isinstance(cls, type):
            return {"ok": False, "kind": "load_failed", "error": f"class {request['class_name']} not defined"}
        self.omit_private = bool(request.get("omit_private"))
        self.env = cls()
        if request.get("load_scenario") and callable(getattr(cls, "_load_scenario", None)):
            # BFCL's protocol (imported classes only): the class fills its defaults from the scenario itself;
            # the attributes are still set as given below, so a snapshot loads back to the same state.
            self.env._load_scenario(copy.deepcopy(request["state"]))
        tracked = {key: tracking.wrap(value) for key, value in request["state"].items()}
        request["state"] = None  # the plain containers die here: the records are then held by the tracked ones only
        for key, value in tracked.items():
            setattr(self.env, key, value)
        attributes = vars(self.env)
        self.baseline = tracking.Baseline({
            key: value for key, value in tracked.items()
            if type(value) in (tracking.TrackedDict, tracking.TrackedList) and attributes.get(key) is value
        })  # fmt: skip
        seeded = self._seed(request, tracked, attributes)
        del tracked, attributes
        # A state of tens of MB is millions of objects: moved out of the collector's reach once, a tool that
        # allocates does not make every full collection walk the whole state again (calls stay state-size free).
        gc.freeze()
        self.tools = {name: getattr(self.env, name) for name in request["tools"]}
        self.signatures = {name: inspect.signature(method) for name, method in self.tools.items()}
        self.keywords = {name: _plain_keywords(signature) for name, signature in self.signatures.items()}
        return {"ok": True, "seeded": seeded} if seeded is not None else {"ok": True}

    def _seed(self, request: dict[str, Any], given: dict[str, Any], attributes: dict[str, Any]) -> int | None:
        """The generation of the first snapshot when the parent may take the state it sent as that snapshot
        (it asked, promising JSON data, and the instance holds exactly those attributes), else None.

        Its JSON size is bounded without encoding it: no value takes more than 7 JSON characters per msgpack
        byte (`false, ` is 1 byte), so 8 times the frame is a bound; above the cap the first snapshot is whole.
        """
        bound = 8 * (self.reader.last_size if self.reader is not None else self.config["max_state_bytes"])
        if not request.get("as_snapshot") or bound > self.config["max_state_bytes"]:
            return None
        if attributes.keys() != given.keys():
            return None
        if any(attributes[key] is not value for key, value in given.items()):
            return None
        return self.baseline.adopt(dict(attributes), bound)

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        method = self.tools.get(request["name"])
        if method is None:
            return {"ok": False, "kind": "unknown_tool", "error": f"unknown tool {request['name']!r}"}
        args = request["args"]
        keywords = self.keywords.get(request["name"])
        if keywords is None or not (keywords[1] <= args.keys() <= keywords[0]):
            try:  # not a plain signature, or the arguments do not fit: bind() decides and words the error
                self.signatures[request["name"]].bind(**args)
            except TypeError as error:
                return {"ok": False, "kind": "bad_arguments", "error": str(error)}
        result = method(**args)
        return self._as_json(result, "result")

    def snapshot(self, request: dict[str, Any]) -> dict[str, Any]:
        # When the parent holds the previous snapshot (`since` is its generation), only the attributes and
        # records that may have changed are encoded and sent (tracking.py); otherwise the whole state.
        state = dict(vars(self.env)) if self.env is not None else {}
        for key in self.omitted:  # known not to be JSON: not encoded (and failed) again on every snapshot
            state.pop(key, None)
        self.baseline.verify(state)
        if request.get("since") is not None and request.get("since") == self.baseline.generation:
            patches = self.baseline.patches(state, JSON_ENCODER.encode, self.config["max_state_bytes"])
            if patches is not None:
                generation = self.baseline.generation
                return {"ok": True, "patches": patches, "generation": generation, "omitted": sorted(self.omitted)}
        reply = self._whole_snapshot(state)
        if reply["ok"]:
            reply["generation"] = self.baseline.adopt(state, len(reply["json"]))
        return reply

    def _whole_snapshot(self, state: dict[str, Any]) -> dict[str, Any]:
        # One encoding of the whole state (the cost of a snapshot is that of its JSON text); only when it fails
        # are the attributes encoded one by one, to name the one that is not JSON.
        reply = self._as_json(state, "state", self.config["max_state_bytes"])
        if reply["ok"] or reply["kind"] != "not_json":
            return reply | {"omitted": sorted(self.omitted)} if reply["ok"] else reply
        for key, value in list(state.items()):
            attribute = self._as_json(value, f"state attribute {key!r}", self.config["max_state_bytes"])
            if attribute["ok"]:
                continue
            if not (self.omit_private and key.startswith("_") and attribute["kind"] == "not_json"):
                return attribute | {"kind": "state_not_json"}
            self.omitted.add(key)
            del state[key]
        reply = self._as_json(state, "state", self.config["max_state_bytes"])
        return reply | {"omitted": sorted(self.omitted)} if reply["ok"] else reply | {"kind": "state_not_json"}

    def check(self, request: dict[str, Any]) -> dict[str, Any]:
        world.begin(request["now"], request["seed"])
        namespace = _fresh_namespace("check")
        exec(compile(request["source"], "<check>", "exec"), namespace)
        function = namespace.get(request["function"])
        if not callable(function):
            return {"ok": False, "kind": "load_failed", "error": f"no function {request['function']!r}"}
        verdict = function(json.loads(request["initial_json"]), json.loads(request["final_json"]))
        if type(verdict) is not bool:
            return {"ok": False, "kind": "not_bool", "error": f"returned {type(verdict).__name__}, not bool"}
        return {"ok": True, "passed": verdict}

    def _as_json(self, value: Any, what: str, limit: int | None = None) -> dict[str, Any]:
        try:
            text = JSON_ENCODER.encode(value)
        except (TypeError, ValueError) as error:
            return {"ok": False, "kind": "not_json", "error": f"{what} is not JSON: {_describe(error)}"}
        limit = limit or self.config["max_result_bytes"]
        if len(text) > limit:
            return {"ok": False, "kind": "too_large", "error": f"{what} is larger than {limit} bytes"}
        return {"ok": True, "json": text}


def _plain_keywords(signature: inspect.Signature) -> tuple[frozenset[str], frozenset[str]] | None:
    """(names, required names) if every parameter can be passed by keyword and none is variadic, else None."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    parameters = signature.parameters.values()
    if any(parameter.kind not in kinds for parameter in parameters):
        return None
    required = {parameter.name for parameter in parameters if parameter.default is inspect.Parameter.empty}
    return frozenset(signature.parameters), frozenset(required)


def _fresh_namespace(name: str) -> dict[str, Any]:
    return {"__name__": name, "__builtins__": dict(PRISTINE_BUILTINS)}


def _run_worker(config: dict[str, Any], req_fd: int, resp_fd: int) -> None:
    """Body of a forked worker; never returns."""
    try:
        harden.set_parent_death_signal(signal.SIGKILL)
        keep = sorted({0, 1, 2, req_fd, resp_fd})
        for low, high in zip(keep, keep[1:] + [65536], strict=True):
            os.closerange(low + 1, high)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        worker = Worker(config, req_fd, resp_fd)
        signal.signal(signal.SIGALRM, worker.on_alarm)
        harden.set_not_dumpable()
        layers = _harden(config)
        worker.serve(layers)
    finally:
        os._exit(70)


def _serve_forks(control: socket.socket, config: dict[str, Any]) -> None:
    while True:
        try:
            message, fds, _flags, _addr = socket.recv_fds(control, 64, 2)
        except OSError:
            return
        if not message:
            return
        if len(fds) != 2:
            for fd in fds:
                os.close(fd)
            continue
        pid = os.fork()
        if pid == 0:
            control.close()
            _run_worker(config, fds[0], fds[1])
        for fd in fds:
            os.close(fd)
        control.sendall(pid.to_bytes(4, "big"))
        _reap_workers()


def _reap_workers() -> None:
    """Wait for the workers that have exited. An auto-reaped child's CPU time is lost; a waited one's adds to the
    zygote's children's time, which is how builder counts the sandbox's CPU (builder/cpu.py). Until the next fork a
    finished worker stays a zombie: dead, holding only its exit status."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main() -> None:
    config = json.loads(sys.argv[1])
    control = socket.socket(fileno=int(sys.argv[2]))
    harden.set_parent_death_signal(signal.SIGKILL)
    started = time.perf_counter()
    _preload(config.get("preload", []))
    if config.get("want_netns") and os.getuid() == 0:
        try:
            harden.unshare_network()
            config["netns_applied"] = True
        except OSError:
            config["netns_applied"] = False
    info = {"preload_ms": (time.perf_counter() - started) * 1000, "netns": bool(config.get("netns_applied"))}
    control.sendall(frames.encode(info))
    _serve_forks(control, config)


if __name__ == "__main__":
    main()
