"""The standard-library modules generated code may import: preloaded by the zygote, enforced by the lint.

Stdlib only (imported by the zygote). A module belongs here if it is pure computation: no files, processes,
network, introspection of frames or interpreter internals.
"""

ALLOWED_MODULES: tuple[str, ...] = (
    "abc", "bisect", "calendar", "collections", "collections.abc", "copy", "dataclasses", "datetime",
    "decimal", "difflib", "enum", "fractions", "functools", "hashlib", "heapq", "itertools", "json", "math",
    "numbers", "operator", "random", "re", "statistics", "string", "textwrap", "time", "typing", "uuid",
    "base64", "unicodedata", "__future__",
)  # fmt: skip
