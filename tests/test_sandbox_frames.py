"""The call path's framing and deadlines, against fake workers (pipes and a sleeping process) and real ones."""

import os
import signal
import subprocess
import threading
import time

import pytest

from builder.config import SandboxConfig
from builder.envs.schema import EnvInterface
from builder.envs.session import Session
from builder.sandbox import frames
from builder.sandbox.runtime import Sandbox, Worker, WorkerFailure

FAST = SandboxConfig(call_timeout_s=0.5, kill_grace_s=0.5, memory_mb=256)


@pytest.fixture
def fake():
    """A Worker whose process sleeps and whose replies the test writes itself: (worker, process, reply fd)."""
    process = subprocess.Popen(["sleep", "60"])
    req_r, req_w = os.pipe()
    resp_r, resp_w = os.pipe()
    os.set_blocking(req_w, False)
    os.set_blocking(resp_r, False)
    worker = Worker(process.pid, req_w, resp_r, FAST)
    yield worker, process, resp_w
    worker.kill()
    process.wait()
    for fd in (req_r, resp_w):
        os.close(fd)


def test_a_silent_worker_is_killed_at_the_deadline(fake):
    worker, process, _ = fake
    started = time.monotonic()
    with pytest.raises(WorkerFailure) as failure:
        worker.request({"op": "ping"}, timeout_s=0.3)
    assert failure.value.kind == "timeout" and 0.3 <= time.monotonic() - started < 1.0
    assert process.wait(timeout=5) == -9 and not worker.alive


def test_a_worker_that_stops_mid_frame_is_killed_at_the_deadline(fake):
    worker, process, resp_w = fake
    os.write(resp_w, frames.encode({"ok": True, "json": "x" * 100})[:50])
    with pytest.raises(WorkerFailure) as failure:
        worker.request({"op": "ping"}, timeout_s=0.3)
    assert failure.value.kind == "timeout" and process.wait(timeout=5) == -9


def test_an_oversized_frame_header_kills_the_worker_before_any_body_is_read(fake):
    worker, process, resp_w = fake
    os.write(resp_w, frames.HEADER.pack(FAST.max_frame_bytes + 1))
    with pytest.raises(WorkerFailure) as failure:
        worker.request({"op": "ping"})
    assert failure.value.kind == "too_large" and process.wait(timeout=5) == -9


def test_garbage_and_eof_are_protocol_and_crash_failures(fake):
    worker, process, resp_w = fake
    os.write(resp_w, frames.HEADER.pack(3) + b"\xc1\xc1\xc1")  # 0xc1 is never valid msgpack
    with pytest.raises(WorkerFailure) as failure:
        worker.request({"op": "ping"})
    assert failure.value.kind == "protocol" and process.wait(timeout=5) == -9


def test_replies_split_or_joined_across_reads_are_framed_exactly(fake):
    worker, _, resp_w = fake
    big = {"ok": True, "json": "y" * 200_000}  # larger than a pipe buffer: arrives in several reads
    data = frames.encode({"ok": True, "n": 1}) + frames.encode({"ok": True, "n": 2})
    os.write(resp_w, data)  # two frames in one read
    assert worker.receive(time.monotonic() + 1) == {"ok": True, "n": 1}
    assert worker.receive(time.monotonic() + 1) == {"ok": True, "n": 2}
    writer = threading.Thread(target=frames.write_all, args=(resp_w, frames.encode(big)))
    writer.start()  # blocks on the full pipe until receive() drains it
    assert worker.receive(time.monotonic() + 5) == big
    writer.join()


def test_frame_reader_buffers_frames_and_refuses_an_oversized_one():
    read_fd, write_fd = os.pipe()
    reader = frames.FrameReader(read_fd, 1000)
    os.write(write_fd, frames.encode({"a": 1}) + frames.encode({"b": 2})[:3])
    assert reader.read() == {"a": 1}
    os.write(write_fd, frames.encode({"b": 2})[3:] + frames.HEADER.pack(1001))
    assert reader.read() == {"b": 2}
    with pytest.raises(frames.FrameError, match="exceeds"):
        reader.read()
    os.close(write_fd)
    os.close(read_fd)


def test_encode_recovers_after_an_unpackable_message():
    with pytest.raises(TypeError):
        frames.encode({"x": object()})
    assert frames.decode(frames.encode({"x": 1})[frames.HEADER.size :]) == {"x": 1}


SOURCE = """
class T:
    def __init__(self):
        self.n = 0

    def plain(self, a: int, b: int = 2) -> int:
        return a + b

    def keywords(self, **kwargs) -> int:
        return len(kwargs)

    def echo(self, text: str) -> int:
        return len(text)

    def blob(self, size: int) -> str:
        return "z" * size
"""


def _tool(name, properties, required):
    parameters = {"type": "object", "properties": properties, "required": required}
    return {"type": "function", "function": {"name": name, "description": "", "parameters": parameters}}


def test_worker_checks_arguments_against_the_real_signature():
    # The schema given to the session lies about the signatures, so the worker's own check is what answers.
    integer = {"type": "integer"}
    tools = (
        _tool("plain", {"a": integer, "b": integer, "c": integer}, []),
        _tool("keywords", {"a": integer}, []),
        _tool("echo", {"text": {"type": "string"}}, ["text"]),
        _tool("blob", {"size": integer}, ["size"]),
    )
    with Sandbox(FAST) as sandbox, Session(sandbox, SOURCE, interface=EnvInterface(class_name="T", tools=tools)) as s:
        assert s.call("plain", {"a": 1}).result == 3 and s.call("plain", {"a": 1, "b": 5}).result == 6
        missing, extra = s.call("plain", {"b": 1}), s.call("plain", {"a": 1, "c": 1})
        assert (missing.error_kind, extra.error_kind) == ("bad_arguments", "bad_arguments")
        assert "'a'" in missing.error and "'c'" in extra.error
        assert s.call("keywords", {"a": 1}).result == 1 and s.call("keywords", {}).result == 0
        # Frames larger than a pipe buffer, both ways: a request the parent writes in parts, a reply read in parts.
        assert s.call("echo", {"text": "é" * 300_000}).result == 300_000
        assert s.call("blob", {"size": 900_000}).result == "z" * 900_000
        assert s.call("plain", {"a": 1}).result == 3


LOOP = """
class T:
    def __init__(self):
        self.n = 0

    def spin(self) -> int:
        while True:
            self.n += 1

    def add(self) -> int:
        self.n += 1
        return self.n
"""


def test_soft_deadline_signal_from_the_parent_times_out_a_call_and_is_harmless_between_calls():
    tools = (_tool("spin", {}, []), _tool("add", {}, []))
    with Sandbox(FAST) as sandbox, Session(sandbox, LOOP, interface=EnvInterface(class_name="T", tools=tools)) as s:
        assert s.call("add").result == 1
        os.kill(s._worker.pid, signal.SIGALRM)  # between requests: ignored, the worker lives on
        time.sleep(0.05)
        assert s.call("add").result == 2
        started = time.monotonic()
        result = s.call("spin")
        elapsed = time.monotonic() - started
        assert result.error_kind == "timeout" and FAST.call_timeout_s <= elapsed < FAST.call_timeout_s + 0.4
        assert s._worker.alive  # a soft timeout: same worker, no replay needed
        assert s.call("add").ok
