"""A fault-injecting OpenAI-compatible endpoint for tests: a scripted model behind a server that answers a given
share of requests badly, the way real servers and the gateways in front of them do.

    def model(body: dict) -> dict:                  # the request body in, a chat.completion body out
        return completion('{"value": 1}')

    with FaultyServer(model, Faults(rate=0.2, seed=7)) as server:     # 20% of requests get a transient fault
        client = LLMClient(OpenAIChatModel(server.url, "local"), model_id="m", sleep=no_sleep)
        ...
    server.injected    # Counter of the faults given, by kind

Faults (`Faults.kinds`, one chosen at random per faulty request):

- transport and status faults, which a client should retry (`TRANSIENT`): `status_429` (with `Retry-After`),
  `status_500`, `status_502`, `status_503`, `drop` (the connection is closed without an answer), `non_json` (a
  gateway's HTML page, or the JSON body cut short), `slow` (the answer comes after `slow_s`: a fault only for a
  client whose timeout is shorter);
- reply faults, a well-formed completion with bad content (`CONTENT`): `empty` (no content, no tool call),
  `cut` (half the content, finish_reason `length`), `off_schema` (JSON of another shape), `bad_tool_call` (an
  unknown tool with arguments that are not JSON), `surrogate` (a lone surrogate and a NUL inside the text, as
  JSON escapes: in the first string of JSON content or tool-call arguments, else in the middle of the content).

Seeded and independent of timing: whether the n-th sending of a given request body gets a fault, and which, is
drawn from (seed, body, n), so concurrent clients see the same faults in any order, and a retry of the same
request is a fresh draw.
"""

from __future__ import annotations

import hashlib
import json
import random
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from llm_stub import completion

Model = Callable[[dict[str, Any]], dict[str, Any]]

STATUS_FAULTS = {"status_429": 429, "status_500": 500, "status_502": 502, "status_503": 503}
TRANSIENT = (*STATUS_FAULTS, "drop", "non_json", "slow")
CONTENT = ("empty", "cut", "off_schema", "bad_tool_call", "surrogate")
ALL = (*TRANSIENT, *CONTENT)


@dataclass(frozen=True)
class Faults:
    """Which share of requests get a fault (`rate`), of which kinds (chosen uniformly), and how; `first` scripts
    the faults of the first requests exactly (a 429 burst, say)."""

    rate: float = 0.0
    kinds: tuple[str, ...] = TRANSIENT
    seed: int = 0
    first: tuple[str, ...] = ()  # faults given to the first requests, in order, before any is drawn
    retry_after: str = "1"  # the Retry-After header of a 429: delay-seconds or an HTTP date
    slow_s: float = 0.5

    def __post_init__(self) -> None:
        unknown = (set(self.kinds) | set(self.first)) - set(ALL)
        if unknown:
            raise ValueError(f"unknown faults {sorted(unknown)}; known: {ALL}")


def scripted(content: str = "ok") -> Model:
    """A model that answers every request with `content`."""
    return lambda body: completion(content)


class FaultyServer:
    """Serves POST /v1/chat/completions from `model`, with `faults` injected; GET answers `{"status": "ok"}` (the
    pool's health probe).

    Attributes:
        requests: Every chat request body received, in order.
        injected: How many faults of each kind were given.
        answered: How many requests got the model's own answer.
    """

    def __init__(self, model: Model, faults: Faults = Faults()) -> None:
        self.model = model
        self.faults = faults
        self.requests: list[dict[str, Any]] = []
        self.injected: Counter[str] = Counter()
        self.answered = 0
        self._seen: Counter[str] = Counter()
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                self._send(200, json.dumps({"status": "ok"}).encode())

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                fault = server._draw(body)
                if fault == "drop":
                    self.close_connection = True
                    self.connection.shutdown(socket.SHUT_RDWR)
                    return
                if fault in STATUS_FAULTS:
                    headers = {"Retry-After": server.faults.retry_after} if fault == "status_429" else {}
                    error = {"error": {"message": f"injected {fault}", "code": STATUS_FAULTS[fault]}}
                    self._send(STATUS_FAULTS[fault], json.dumps(error).encode(), headers)
                    return
                if fault == "slow":
                    time.sleep(server.faults.slow_s)
                answer = server.model(body)
                if fault == "non_json":
                    self._send(*server._non_json(answer))
                    return
                if fault in CONTENT:
                    answer = spoiled(answer, fault)
                self._send(200, json.dumps(answer).encode())

            def _send(
                self, status: int, raw: bytes, headers: dict[str, str] | None = None, kind: str = "application/json"
            ) -> None:
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", kind)
                    self.send_header("Content-Length", str(len(raw)))
                    for name, value in (headers or {}).items():
                        self.send_header(name, value)
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True  # the client gave up on a slow answer

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = _Server(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> FaultyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    def _draw(self, body: dict[str, Any]) -> str | None:
        """The fault for this sending of `body` (None: answer well), from (seed, body, how often it was sent)."""
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
        with self._lock:
            self.requests.append(body)
            sent = self._seen[digest]
            self._seen[digest] += 1
            rng = random.Random(f"{self.faults.seed}:{digest}:{sent}")
            fault = rng.choice(self.faults.kinds) if rng.random() < self.faults.rate else None
            if len(self.requests) <= len(self.faults.first):
                fault = self.faults.first[len(self.requests) - 1]
            if fault is None:
                self.answered += 1
            else:
                self.injected[fault] += 1
            return fault

    def _non_json(self, answer: dict[str, Any]) -> tuple[int, bytes, dict[str, str], str]:
        """In turn a proxy's HTML error page (200, text/html) and the JSON body cut short."""
        if self.injected["non_json"] % 2:
            return 200, b"<html><body><h1>502 Bad Gateway</h1></body></html>", {}, "text/html"
        raw = json.dumps(answer).encode()
        return 200, raw[: len(raw) // 2], {}, "application/json"


class _Server(ThreadingHTTPServer):
    request_queue_size = 128  # the default 5 refuses a burst of concurrent connections: a fault nobody asked for
    daemon_threads = True


def spoiled(answer: dict[str, Any], fault: str) -> dict[str, Any]:
    """`answer` (a chat.completion body) with its message spoiled as `fault` (one of `CONTENT`) says."""
    answer = json.loads(json.dumps(answer))
    choice = answer["choices"][0]
    message = choice["message"]
    content = message.get("content") or ""
    if fault == "empty":
        message.update(content="", tool_calls=[])
        choice["finish_reason"] = "stop"
    elif fault == "cut":
        message.update(content=content[: len(content) // 2], tool_calls=[])
        choice["finish_reason"] = "length"
    elif fault == "off_schema":
        message.update(content='{"unexpected": [1, 2, 3]}', tool_calls=[])
        choice["finish_reason"] = "stop"
    elif fault == "bad_tool_call":
        call = {"id": "call_bad", "type": "function", "function": {"name": "no_such_tool", "arguments": "{not json"}}
        message.update(content=None, tool_calls=[call])
        choice["finish_reason"] = "tool_calls"
    elif fault == "surrogate":
        message["content"] = with_bad_characters(content)
        for call in message.get("tool_calls") or []:
            call["function"]["arguments"] = with_bad_characters(call["function"]["arguments"])
    return answer


BAD = "\ud800\x00"  # a lone (high) surrogate and a NUL, which json.dumps writes as the escapes \ud800 and \u0000


def with_bad_characters(text: str) -> str:
    """`text` with `BAD` after the first character of its first JSON string (JSON text stays valid JSON), or in
    its middle (any other text)."""
    try:
        value = json.loads(text)
    except ValueError:
        middle = len(text) // 2
        return text[:middle] + BAD + text[middle:]
    done = False

    def spoil(node: Any) -> Any:
        nonlocal done
        if isinstance(node, str) and not done:
            done = True
            return node[:1] + BAD + node[1:]
        if isinstance(node, dict):
            return {key: spoil(item) for key, item in node.items()}
        if isinstance(node, list):
            return [spoil(item) for item in node]
        return node

    spoiled_value = spoil(value)
    return json.dumps(spoiled_value) if done else text[: len(text) // 2] + BAD + text[len(text) // 2 :]
