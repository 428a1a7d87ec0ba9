"""Parent side of the sandbox: starts the zygote, forks hardened workers, talks to them with deadlines.

The parent never unpickles and never imports generated code. Every reply is a capped msgpack frame read
with `poll()` against a hard deadline; on a timeout, an oversized or garbled frame, or EOF, the worker is
SIGKILLed through a pidfd and the caller gets a `WorkerFailure` with a stable kind. A small call costs one
write and a few non-blocking reads (at most one poll) in the parent.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from builder.config import SandboxConfig
from builder.errors import BuilderError
from builder.sandbox import frames

logger = logging.getLogger(__name__)

ZYGOTE_SCRIPT = Path(__file__).with_name("zygote.py")
# The only environment the sandbox ever sees: no secrets, no PYTHON* paths, a fixed hash seed so that set and
# dict orders are the same in every worker (the determinism check depends on it), and UTC as local time so an
# episode's naive `now` (builder/sandbox/world.py) means the same moment on every machine.
CLEAN_ENV = {
    "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "PYTHONHASHSEED": "0", "PYTHONDONTWRITEBYTECODE": "1", "TZ": "UTC",
}  # fmt: skip
ALL_LAYERS = ("clean_env", "deadline_kill", "rlimits", "seccomp", "no_network", "landlock", "uid_drop", "netns")


class SandboxUnavailable(BuilderError):
    """The machine grants fewer isolation layers than the configuration requires."""


class WorkerFailure(Exception):
    """A worker died, hung past its deadline or broke the protocol; `kind` is a stable short code."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class Worker:
    """One forked, hardened sandbox process and its two pipes. Not thread-safe: one request at a time."""

    def __init__(self, pid: int, req_fd: int, resp_fd: int, config: SandboxConfig) -> None:
        self.pid = pid
        self.req_fd, self.resp_fd = req_fd, resp_fd
        self.config = config
        self.layers: dict[str, str] = {}
        self.alive = True
        self._buffer = b""
        self._soft_deadline: float | None = None  # when to send SIGALRM (a tool error); None once sent or idle
        # One poll object for the life of the worker: building and registering one per call costs more than
        # the poll itself.
        self._readable = select.poll()
        self._readable.register(resp_fd, select.POLLIN)
        try:
            self._pidfd: int | None = os.pidfd_open(pid)
        except (AttributeError, OSError):  # very old kernels: fall back to kill by pid
            self._pidfd = None

    def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and return the reply; raises WorkerFailure (and kills the worker) on any fault."""
        if not self.alive:
            raise WorkerFailure("crashed", "the sandbox worker is no longer running")
        now = time.monotonic()
        deadline = now + (timeout_s or self.config.call_timeout_s + self.config.kill_grace_s)
        self._soft_deadline = now + self.config.call_timeout_s
        try:
            self._send(frames.encode(message), deadline)
            return self.receive(deadline)
        except WorkerFailure:
            self.kill()
            raise
        finally:
            self._soft_deadline = None

    def _send(self, data: bytes, deadline: float) -> None:
        # The worker is idle between requests, so its pipe is empty and a frame that fits the pipe buffer
        # (every call) goes in one write with no poll; only a bigger frame waits for the worker to drain it.
        view = memoryview(data)
        while True:
            try:
                view = view[os.write(self.req_fd, view) :]
            except BlockingIOError:
                pass
            except OSError:  # BrokenPipeError and friends: the worker is gone
                raise WorkerFailure("crashed", "the sandbox worker died") from None
            if not view:
                return
            _wait(self.req_fd, select.POLLOUT, deadline)

    def receive(self, deadline: float) -> dict[str, Any]:
        """Read one capped frame before `deadline`; a small reply arrives whole in one read."""
        buffer = self._buffer
        while len(buffer) < frames.HEADER.size:
            buffer += self._read_some(deadline)
        (size,) = frames.HEADER.unpack_from(buffer)
        cap = self.config.max_frame_bytes
        if size > cap:
            raise WorkerFailure("too_large", f"worker sent a {size}-byte frame (cap {cap})")
        end = frames.HEADER.size + size
        if len(buffer) < end:  # a big reply: collect its chunks and join once (no quadratic concatenation)
            chunks, received = [buffer], len(buffer)
            while received < end:
                chunks.append(self._read_some(deadline))
                received += len(chunks[-1])
            buffer = b"".join(chunks)
        # A view, not a slice: a state of tens of MB is not copied once more before it is decoded.
        body, self._buffer = memoryview(buffer)[frames.HEADER.size : end], buffer[end:]
        try:
            return frames.decode(body)
        except frames.FrameError as error:
            raise WorkerFailure("protocol", str(error)) from None

    def _read_some(self, deadline: float) -> bytes:
        # First spin briefly on a non-blocking read: a small call's reply usually comes within tens of
        # microseconds, and on this VM sleeping in poll() and being woken again (plus the cold caches after it)
        # costs more than the spin (measured p50 ~58 -> ~43 µs). Then poll() (`_wait_readable`), then read.
        # The deadlines are enforced there, in the parent, whatever the worker does; poll() returns early with
        # POLLHUP when the worker dies, and the read then sees EOF.
        spin_until = time.perf_counter() + SPIN_S
        while True:
            try:
                # At most one pipe buffer (64 KiB) per read: asking for more makes os.read allocate (and fault
                # in) a buffer that large on every call, which alone cost ~25 µs per call for 1 MiB.
                chunk = os.read(self.resp_fd, PIPE_CHUNK)
            except BlockingIOError:
                if time.perf_counter() < spin_until:
                    continue
                self._wait_readable(deadline)
                spin_until = 0.0  # readable (or hung up) now: the next read will not block
                continue
            if not chunk:
                raise WorkerFailure("crashed", "the sandbox worker died")
            return chunk

    def _wait_readable(self, deadline: float) -> None:
        # poll() until the reply is readable; at the soft deadline send SIGALRM once (the worker answers with a
        # `timeout` error and lives on), at the hard deadline give up (the caller kills the worker).
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise WorkerFailure("timeout", "the sandbox worker missed its deadline and was killed")
            if self._soft_deadline is not None and now >= self._soft_deadline:
                self._soft_deadline = None
                self._signal(signal.SIGALRM)
            until = deadline if self._soft_deadline is None else min(self._soft_deadline, deadline)
            if self._readable.poll((until - now) * 1000):
                return

    def _signal(self, number: int) -> None:
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, number)
            else:
                os.kill(self.pid, number)
        except (ProcessLookupError, OSError):
            pass

    def kill(self) -> None:
        """SIGKILL the worker and release its descriptors (idempotent)."""
        if not self.alive:
            return
        self.alive = False
        self._signal(signal.SIGKILL)
        for fd in (self.req_fd, self.resp_fd, self._pidfd):
            if fd is not None:
                os.close(fd)

    close = kill


PIPE_CHUNK = 1 << 16  # the default Linux pipe capacity: one read never returns more
SPIN_S = 50e-6


def _wait(fd: int, event: int, deadline: float) -> None:
    poller = select.poll()
    poller.register(fd, event)
    remaining_ms = (deadline - time.monotonic()) * 1000
    if remaining_ms <= 0 or not poller.poll(remaining_ms):
        raise WorkerFailure("timeout", "the sandbox worker missed its deadline and was killed")


class Sandbox:
    """A zygote plus the workers it forks. Thread-safe for opening workers; each worker serves one caller.

    Start it once per process (`Sandbox(config)`), open workers with `open_worker()`, and `close()` it at the
    end (or use it as a context manager). A crashed zygote is replaced on the next `open_worker()`.
    """

    def __init__(self, config: SandboxConfig | None = None, preload: tuple[str, ...] = ()) -> None:
        self.config = config or SandboxConfig()
        # Extra modules the zygote imports before lockdown. The hostile test suite preloads pickle, subprocess,
        # socket, ... so attacks reach real system calls instead of failing at import.
        self.preload = preload
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._control: socket.socket | None = None
        self.layers: dict[str, str] = {}
        _raise_open_file_limit()
        self._start_zygote()
        self.layers = self._probe_layers()
        missing = [layer for layer in self.config.required_layers if layer not in self.layers]
        if missing:
            self.close()
            raise SandboxUnavailable(_missing_message(missing, self.layers))
        logger.info("sandbox layers: %s", ", ".join(f"{k} ({v})" for k, v in self.layers.items()))

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _start_zygote(self) -> None:
        parent_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        settings = {
            "memory_mb": self.config.memory_mb,
            "cpu_s": self.config.cpu_s,
            "open_files": 16,
            "soft_timeout_s": self.config.call_timeout_s,
            "max_frame_bytes": self.config.max_frame_bytes,
            "max_result_bytes": self.config.max_result_bytes,
            "max_state_bytes": self.config.max_state_bytes,
            "want_netns": self.config.network_namespace,
            "preload": list(self.preload),
        }
        command = [sys.executable, "-s", "-B", str(ZYGOTE_SCRIPT), json.dumps(settings), str(child_end.fileno())]
        self._process = subprocess.Popen(
            command, env=CLEAN_ENV, cwd="/", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, start_new_session=True, pass_fds=(child_end.fileno(),),
        )  # fmt: skip
        child_end.close()
        self._control = parent_end
        self._control.settimeout(60)
        header = self._recv_exact(frames.HEADER.size)
        self.zygote_info = frames.decode(self._recv_exact(frames.HEADER.unpack(header)[0]))

    def _recv_exact(self, size: int) -> bytes:
        assert self._control is not None
        data = b""
        while len(data) < size:
            chunk = self._control.recv(size - len(data))
            if not chunk:
                raise SandboxUnavailable("the sandbox zygote exited during start-up")
            data += chunk
        return data

    def _probe_layers(self) -> dict[str, str]:
        worker = self.open_worker(check_layers=False)
        worker.close()
        return worker.layers

    def open_worker(self, check_layers: bool = True) -> Worker:
        """Fork a fresh hardened worker; raises SandboxUnavailable if it lacks a required layer."""
        with self._lock:
            if self._process is None or self._process.poll() is not None:
                self._restart_zygote()
            req_r, req_w = os.pipe2(os.O_CLOEXEC)
            resp_r, resp_w = os.pipe2(os.O_CLOEXEC)
            try:
                assert self._control is not None
                socket.send_fds(self._control, [b"F"], [req_r, resp_w])
                pid = int.from_bytes(self._recv_exact(4), "big")
            except (OSError, SandboxUnavailable):
                for fd in (req_r, req_w, resp_r, resp_w):
                    os.close(fd)
                self._stop_zygote()
                raise WorkerFailure("crashed", "the sandbox zygote died; it restarts on the next episode") from None
            finally:
                if self._process is not None and self._process.poll() is None:
                    os.close(req_r)
                    os.close(resp_w)
        os.set_blocking(req_w, False)
        os.set_blocking(resp_r, False)
        worker = Worker(pid, req_w, resp_r, self.config)
        try:
            ready = worker.receive(time.monotonic() + 10)
        except WorkerFailure:
            worker.kill()  # do not leak the process and its descriptors
            raise
        worker.layers = {k: str(v) for k, v in ready.get("layers", {}).items() if not k.startswith("-")}
        self.refused = {k[1:]: str(v) for k, v in ready.get("layers", {}).items() if k.startswith("-")}
        missing = [layer for layer in self.config.required_layers if layer not in worker.layers]
        if check_layers and missing:
            worker.kill()
            raise SandboxUnavailable(_missing_message(missing, worker.layers))
        return worker

    def _restart_zygote(self) -> None:
        logger.warning("sandbox zygote is gone; starting a new one")
        self._stop_zygote()
        self._start_zygote()

    def _stop_zygote(self) -> None:
        if self._control is not None:
            self._control.close()
            self._control = None
        if self._process is not None:
            if self._process.poll() is None:
                self._process.kill()
            self._process.wait()
            self._process = None

    @property
    def zygote_pid(self) -> int | None:
        """Pid of the current zygote (for tests and diagnostics)."""
        return self._process.pid if self._process is not None else None

    def close(self) -> None:
        """Stop the zygote; its workers die with it (PR_SET_PDEATHSIG)."""
        with self._lock:
            self._stop_zygote()


def _missing_message(missing: list[str], granted: dict[str, str]) -> str:
    return (
        f"refusing to run generated code: isolation layer(s) {', '.join(missing)} required by "
        f"sandbox.required_layers are not available on this machine (granted: {', '.join(granted) or 'none'}). "
        "Run on a machine that grants them, or lower sandbox.required_layers knowingly."
    )


def _raise_open_file_limit() -> None:
    # Each open session holds three descriptors in this process; hundreds of sessions need more than 1024.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 65536
    if soft != resource.RLIM_INFINITY and soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(target, 65536), hard))
