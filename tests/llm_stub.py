"""A small stub OpenAI-compatible HTTP server for tests that need real HTTP (backend mapping, benchmark)."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

Responder = Callable[[dict[str, Any]], tuple[int, dict[str, Any]]]


def tokenized(count: int, max_model_len: int = 32768) -> dict[str, Any]:
    """A /tokenize body like vLLM's (`TokenizeResponse`)."""
    return {"count": count, "max_model_len": max_model_len, "tokens": list(range(count))}


def completion(
    content: str | None = "hello",
    *,
    tool_calls: list[dict[str, Any]] | None = None,
    finish_reason: str = "stop",
    reasoning: str | None = None,
    completion_tokens: int = 5,
) -> dict[str, Any]:
    """A chat.completion body like vLLM's."""
    message: dict[str, Any] = {"role": "assistant", "content": content, "tool_calls": tool_calls or []}
    if reasoning is not None:
        message["reasoning"] = reasoning
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 0,
        "model": "local",
        "choices": [{"index": 0, "message": message, "finish_reason": finish_reason}],
        "usage": {
            "prompt_tokens": 11,
            "completion_tokens": completion_tokens,
            "total_tokens": 11 + completion_tokens,
        },
    }


class StubServer:
    """Serves `respond(body) -> (status, json)` for POST /v1/chat/completions; records request bodies.

    `kill()` stops it the way a crashed server stops. Like vLLM, it can also answer POST /tokenize
    (`tokenize(body) -> (status, json)`, bodies recorded in `tokenized`; 404 without it), GET /version
    (`{"version": version}` when given) and GET /metrics (the Prometheus text `metrics`, when given).
    """

    def __init__(
        self,
        respond: Responder,
        delay_s: float = 0.0,
        *,
        tokenize: Responder | None = None,
        version: str | None = None,
        metrics: str | None = None,
    ) -> None:
        self.respond = respond
        self.delay_s = delay_s
        self.tokenize = tokenize
        self.version = version
        self.metrics = metrics
        self.requests: list[dict[str, Any]] = []
        self.killed = threading.Event()
        self.tokenized: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802
                if stub.killed.is_set():
                    self._drop()
                    return
                if self.path == "/version" and stub.version is not None:
                    self._send(200, {"version": stub.version})
                elif self.path == "/metrics" and stub.metrics is not None:
                    self._send(200, stub.metrics)
                else:
                    self._send(200, {"status": "ok"})

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if stub.killed.is_set():
                    self._drop()
                    return
                if self.path == "/tokenize":
                    stub.tokenized.append(body)
                    self._send(*(stub.tokenize(body) if stub.tokenize else (404, {"detail": "Not Found"})))
                    return
                stub.requests.append(body)
                if stub.delay_s:
                    time.sleep(stub.delay_s)
                answer = stub.respond(body)
                if stub.killed.is_set():  # killed while this request was in flight: it is never answered
                    self._drop()
                    return
                self._send(*answer)

            def _drop(self) -> None:
                self.close_connection = True
                self.connection.shutdown(socket.SHUT_RDWR)

            def _send(self, status: int, data: dict[str, Any] | str) -> None:
                text = isinstance(data, str)
                raw = data.encode() if text else json.dumps(data).encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain" if text else "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> StubServer:
        self.thread.start()
        return self

    def kill(self) -> None:
        """Stop like a crashed server: no new connections, and no request in flight or on an open connection is
        answered (each connection is dropped)."""
        self.killed.set()
        self.httpd.shutdown()
        self.httpd.server_close()

    def __exit__(self, *exc: object) -> None:
        if not self.killed.is_set():
            self.httpd.shutdown()
            self.httpd.server_close()
