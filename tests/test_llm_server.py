"""The managed server without vLLM: command line, environment, model resolution, and the process lifecycle
against a fake server script (start, health wait, crash with log tail, timeout, no process left behind)."""

from __future__ import annotations

import os
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

from builder.config import LLMConfig
from builder.llm import ServerError, VLLMServer, open_llm
from builder.llm import server as server_module
from builder.llm.server import server_command, server_env
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template, resolve_model

FAKE_SERVER = """
import http.server, os, subprocess, sys, time
port, delay, mode = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like vLLM's engine core
print(f"child {child.pid}", flush=True)
if mode == "stubborn":  # like vLLM hanging in its own SIGTERM handling
    import signal
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "crash":
    print("ValueError: no model here", flush=True)
    sys.exit(3)
time.sleep(delay)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def fake_vllm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, delay: float = 0.2, mode: str = "serve") -> None:
    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)

    def command(config: LLMConfig, model: str, device: str, port: int) -> list[str]:
        return [sys.executable, str(script), str(port), str(delay), mode]

    monkeypatch.setattr(server_module, "server_command", command)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


def child_pid(log: Path) -> int:
    return int(next(line for line in log.read_text().splitlines() if line.startswith("child ")).split()[1])


def no_child_left(log: Path) -> bool:
    """True if the fake server's child is gone, or was never started (a very slow start was cut off)."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("child ")]
    return not lines or not alive(int(lines[0].split()[1]))


def test_cpu_command_has_the_recipe_flags() -> None:
    command = server_command(LLMConfig(max_model_len=4096), "/models/smol", "cpu", 8123)
    assert command[:3] == [sys.executable, "-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(command)
    for flag in (
        "--model /models/smol",
        "--served-model-name local",
        "--host 127.0.0.1",
        "--port 8123",
        "--max-model-len 4096",
        "--enable-auto-tool-choice",
        "--tool-call-parser hermes",
        "--tool-strict-level parameter",
        f"--chat-template {chatml_tools_template()}",
        "--enforce-eager",
    ):
        assert flag in text
    assert "--tensor-parallel-size" not in text and "serve" not in command
    assert "{%- generation %}" in chatml_tools_template().read_text()


ZEN3 = "processor\t: 0\nflags\t\t: fpu sse sse2 avx avx2 fma bmi2\nprocessor\t: 1\n"
ZEN5 = "processor\t: 0\nflags\t\t: fpu avx avx2 avx512f avx512bw avx512_bf16\n"


def test_cpu_dtype_is_float32_without_avx512() -> None:
    assert server_module.cpu_dtype(ZEN3) == "float32"  # bfloat16 is emulated there: 4x slower
    assert server_module.cpu_dtype(ZEN5) == "auto"
    assert server_module.cpu_dtype("") == "float32"  # no flags line: assume the slow case


def test_dtype_on_the_command_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module, "cpu_dtype", lambda: "float32")
    assert server_command(LLMConfig(), "/m", "cpu", 1)[-2:] == ["--dtype", "float32"]
    assert "--dtype" not in server_command(LLMConfig(), "/m", "gpu", 1)  # vLLM's own choice on a GPU
    explicit = server_command(LLMConfig(dtype="bfloat16"), "/m", "cpu", 1)
    assert explicit[-2:] == ["--dtype", "bfloat16"]
    monkeypatch.setattr(server_module, "cpu_dtype", lambda: "auto")
    assert "--dtype" not in server_command(LLMConfig(), "/m", "cpu", 1)


def test_gpu_command_for_qwen3() -> None:
    config = LLMConfig(
        model="Qwen/Qwen3-8B",
        tensor_parallel_size=2,
        reasoning_parser="qwen3",
        extra_server_args=("--gpu-memory-utilization", "0.85"),
    )
    command = server_command(config, "Qwen/Qwen3-8B", "gpu", 8000)
    text = " ".join(command)
    assert "--tensor-parallel-size 2" in text and "--reasoning-parser qwen3" in text
    assert "--enforce-eager" not in text and "--chat-template" not in text  # Qwen3's own template has tools
    assert command[-2:] == ["--gpu-memory-utilization", "0.85"]


def test_server_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    cpu = server_env(LLMConfig(cpu_kvcache_space_gb=2), "cpu", offline=True)
    assert cpu["HF_HUB_OFFLINE"] == "1" and cpu["VLLM_CPU_KVCACHE_SPACE"] == "2"
    gpu = server_env(LLMConfig(), "gpu", offline=False)
    assert "HF_HUB_OFFLINE" not in gpu and "VLLM_CPU_KVCACHE_SPACE" not in gpu


def test_resolve_model(tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_model(str(model_dir)) == (str(model_dir), True)
    with pytest.raises(ServerError, match="does not exist"):
        resolve_model(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ServerError, match="holds no model"):
        resolve_model(str(tmp_path / "empty"))
    monkeypatch.setenv("BUILDER_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")
    (target / "model.safetensors").write_bytes(b"")
    assert resolve_model(EMBEDDED_MODEL) == (str(target), True)  # already converted: nothing to do


def test_wrong_model_path_fails_before_starting(tmp_path: Path) -> None:
    server = VLLMServer(LLMConfig(model=str(tmp_path / "nope")), tmp_path / "server.log")
    with pytest.raises(ServerError, match="model path .*nope does not exist"):
        server.start()
    assert server.process is None


def test_missing_vllm_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(server_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ServerError, match=r"vLLM is not installed: pip install 'builder-envs\[cpu\]'"):
        VLLMServer(LLMConfig(device="cpu"), tmp_path / "server.log").start()


def test_start_health_and_stop_leave_no_process(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    fake_vllm(monkeypatch, tmp_path)
    log = tmp_path / "run" / "llm_server.log"
    with VLLMServer(LLMConfig(model=str(model_dir), device="cpu"), log) as server:
        assert httpx.get(server.url.replace("/v1", "/health")).status_code == 200
        leader, child = server.process.pid, child_pid(log)
        assert alive(leader) and alive(child)
    assert server.process is None
    assert not alive(leader) and not alive(child)
    assert log.read_text().startswith("$ ")


def test_stop_on_error_inside_the_block(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    fake_vllm(monkeypatch, tmp_path)
    log = tmp_path / "server.log"
    with pytest.raises(KeyboardInterrupt):
        with VLLMServer(LLMConfig(model=str(model_dir), device="cpu"), log) as server:
            leader = server.process.pid
            raise KeyboardInterrupt
    assert not alive(leader) and not alive(child_pid(log))


def test_crash_during_start_shows_log_tail(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    fake_vllm(monkeypatch, tmp_path, mode="crash")
    log = tmp_path / "server.log"
    with pytest.raises(ServerError, match=r"(?s)exited with code 3 during start-up.*ValueError: no model here"):
        VLLMServer(LLMConfig(model=str(model_dir), device="cpu"), log).start()
    deadline = time.monotonic() + 5
    while alive(child_pid(log)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child_pid(log))


def test_start_timeout_stops_the_server(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    fake_vllm(monkeypatch, tmp_path, delay=30)
    log = tmp_path / "server.log"
    config = LLMConfig(model=str(model_dir), device="cpu", server_start_timeout_s=1.0)
    server = VLLMServer(config, log)
    with pytest.raises(ServerError, match="not healthy after 1 s"):
        server.start()
    assert server.process is None and no_child_left(log)


OWNER = """
import sys, time
sys.path.insert(0, {root!r})
from pathlib import Path
from builder.config import LLMConfig
from builder.llm import server as server_module
from builder.llm.server import VLLMServer
server_module.server_command = lambda config, model, device, port: [
    sys.executable, {script!r}, str(port), "0.1", "serve"]
server = VLLMServer(LLMConfig(model={model!r}, device="cpu"), Path({log!r}))
server.start()
print(server.process.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGKILL"])
def test_server_dies_with_its_owner(tmp_path: Path, model_dir: Path, signal_name: str) -> None:
    """SIGTERM runs the normal stop; after SIGKILL of the owner the reaper ends the server's whole group."""
    import signal
    import subprocess

    script = tmp_path / "fake_vllm.py"
    script.write_text(FAKE_SERVER)
    log = tmp_path / "server.log"
    root = str(Path(__file__).resolve().parents[1])
    owner_code = OWNER.format(root=root, script=str(script), model=str(model_dir), log=str(log))
    owner = subprocess.Popen([sys.executable, "-c", owner_code], stdout=subprocess.PIPE, text=True)
    leader = int(owner.stdout.readline())
    engine = child_pid(log)
    assert alive(leader) and alive(engine)
    owner.send_signal(getattr(signal, signal_name))
    owner.wait(timeout=30)
    deadline = time.monotonic() + 15
    while (alive(leader) or alive(engine)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(leader) and not alive(engine)


def test_server_that_ignores_sigterm_is_killed(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    fake_vllm(monkeypatch, tmp_path, mode="stubborn")
    monkeypatch.setattr(server_module, "_STOP_GRACE_S", 1.0)
    log = tmp_path / "server.log"
    with VLLMServer(LLMConfig(model=str(model_dir), device="cpu"), log) as server:
        leader = server.process.pid
    assert not alive(leader) and not alive(child_pid(log))


def model_folder(tmp_path: Path, config: str) -> Path:
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(config)
    (folder / "model.safetensors").write_bytes(b"")
    return folder


def test_context_limit_reads_the_models_config(tmp_path: Path) -> None:
    folder = model_folder(tmp_path, '{"max_position_embeddings": 8192, "rope_parameters": {"rope_type": "default"}}')
    assert server_module.context_limit(str(folder)) == 8192
    (folder / "config.json").write_text('{"max_position_embeddings": 40960, "rope_scaling": {"factor": 4.0}}')
    assert server_module.context_limit(str(folder)) is None  # YaRN: vLLM derives a longer context itself
    (folder / "config.json").write_text("not json")
    assert server_module.context_limit(str(folder)) is None
    assert server_module.context_limit(str(tmp_path / "missing")) is None
    config = LLMConfig(max_model_len=32768)
    (folder / "config.json").write_text('{"max_position_embeddings": 40960}')  # Qwen3-8B: more than asked
    assert server_module.fitted_max_model_len(config, str(folder)) == 32768


def test_the_builtin_model_is_served_with_its_own_8k_context(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("BUILDER_CACHE_DIR", str(tmp_path / "cache"))
    target = tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct"
    target.mkdir(parents=True)
    (target / "config.json").write_text('{"max_position_embeddings": 8192}')  # as converted from the GGUF
    (target / "model.safetensors").write_bytes(b"")
    fake_vllm(monkeypatch, tmp_path)
    fake = server_module.server_command
    served: list[int] = []

    def command(config: LLMConfig, *args: object) -> list[str]:
        served.append(config.max_model_len)
        return fake(config, *args)

    monkeypatch.setattr(server_module, "server_command", command)
    config = LLMConfig(device="cpu")  # the built-in default model, llm.max_model_len 32768
    assert config.model == EMBEDDED_MODEL and config.max_model_len == 32768
    with open_llm(config, tmp_path / "run", cache=False) as client:
        assert client.context_tokens == 8192  # the client fits budgets into what the server really has
    assert served == [8192]


def test_a_vllm_outside_the_range_is_refused_before_starting(tmp_path: Path, model_dir: Path, monkeypatch) -> None:
    monkeypatch.setattr(server_module, "installed_vllm_version", lambda: "0.30.0")
    server = VLLMServer(LLMConfig(model=str(model_dir), device="gpu"), tmp_path / "server.log")
    with pytest.raises(
        ServerError, match=r"vLLM 0.30.0 is too old .* >=0.31.0,<0.33: pip install 'builder-envs\[gpu\]'"
    ):
        server.start()
    assert server.process is None
    monkeypatch.setattr(server_module, "installed_vllm_version", lambda: "0.33.1")
    with pytest.raises(ServerError, match="newer than builder is tested with"):
        VLLMServer(LLMConfig(model=str(model_dir), device="cpu"), tmp_path / "server.log").start()


def test_version_problems() -> None:
    problem = server_module.vllm_version_problem
    assert problem("0.31.0") is None and problem("0.32.0") is None and problem("0.32.4+cpu") is None
    assert "too old" in problem("0.30.9") and "too old" in problem("0.9.2")
    assert "newer" in problem("0.33.0rc1") and "newer" in problem("1.0.0")
    assert problem("main") is None  # unreadable: cannot judge
    assert server_module.installed_vllm_version() in (None, "0.32.0")  # this machine's vllm-cpu, if installed


def test_the_gpu_extra_pins_the_range_the_server_checks() -> None:
    project = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["gpu"] == [f"vllm{server_module.VLLM_RANGE}"]
    (cpu_pin,) = [pin for pin in project["optional-dependencies"]["cpu"] if pin.startswith("vllm-cpu==")]
    assert server_module.vllm_version_problem(cpu_pin.split("==")[1]) is None
