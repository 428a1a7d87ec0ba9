"""What this machine has, for the choices that depend on it: the packaged profile (`--profile auto`) and the
vLLM build the managed server starts (`llm.device = "auto"`)."""

from __future__ import annotations

import shutil
import subprocess


def detect_device() -> str:
    """Return "gpu" if `nvidia-smi` lists a GPU, else "cpu" (no torch import: it takes seconds)."""
    if shutil.which("nvidia-smi") is None:
        return "cpu"
    try:
        result = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu"
    return "gpu" if result.returncode == 0 and "GPU" in result.stdout else "cpu"
