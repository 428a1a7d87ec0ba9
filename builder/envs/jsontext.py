"""`json.dumps(value, indent=2, ensure_ascii=False)`, the same text in less than half the time for JSON data.

With an indent, the standard library encodes in pure Python through nested generators: 2.2-2.8 s for a 22 MB
state here, the largest single cost of `env replay` on a big state. This writer appends to one list and encodes
strings with the C function; it handles exactly the types a decoded JSON document holds and gives anything else
(another type, a non-string key, a cycle) to `json.dumps`, which then decides the text or the error.
"""

from __future__ import annotations

import json
from json.encoder import c_make_encoder, encode_basestring
from typing import Any


def dumps_indented(value: Any) -> str:
    """The text of `json.dumps(value, indent=2, ensure_ascii=False)`."""
    parts: list[str] = []
    try:
        _write(value, "", parts)
    except (_Unsupported, RecursionError):
        return json.dumps(value, indent=2, ensure_ascii=False)
    return "".join(parts)


class _Unsupported(Exception):
    """A value this writer leaves to `json.dumps`."""


def _scalar(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return encode_basestring(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    raise _Unsupported


_CONTAINERS = (dict, list)
# Per indent: a C encoder whose item separator carries the newline and indent, which writes a container of
# scalars exactly as the indenting encoder does once its first and last line breaks are added.
_LEAF_ENCODERS: dict[str, Any] = {}


def _leaf(value: Any, indent: str) -> str | None:
    """The indented text of a non-empty dict with string keys or a list, when every item is a scalar, or of a
    list of such dicts (a record's line items); None for anything else."""
    kind = type(value)
    if not _SCALAR_SET.issuperset(map(type, value.values() if kind is dict else value)):
        return _leaf_dicts(value, indent) if kind is list else None
    if kind is dict and not _STR.issuperset(map(type, value)):
        return None
    inner = indent + "  "
    text = "".join(_encoder(inner)(value, 0))
    return f"{text[0]}\n{inner}{text[1:-1]}\n{indent}{text[-1]}"


def _leaf_dicts(value: list[Any], indent: str) -> str | None:
    # One C call for the whole list, with the dicts' separator; the list's own separators are then the only
    # `},\n<indent>{` in the text (a string holds no raw line break), which one replace re-indents.
    for item in value:
        if type(item) is not dict or not item or not _SCALAR_SET.issuperset(map(type, item.values())):
            return None
        if not _STR.issuperset(map(type, item)):
            return None
    inner, fields = indent + "  ", indent + "    "
    text = "".join(_encoder(fields)(value, 0))
    middle = text[2:-2].replace(f"}},\n{fields}{{", f"\n{inner}}},\n{inner}{{\n{fields}")
    return f"[\n{inner}{{\n{fields}{middle}\n{inner}}}\n{indent}]"


def _encoder(inner: str) -> Any:
    encoder = _LEAF_ENCODERS.get(inner)
    if encoder is None:
        # What JSONEncoder.encode builds on every call (that alone cost 8 µs per small container), built once.
        encoder = _LEAF_ENCODERS[inner] = c_make_encoder(
            None, _refuse, encode_basestring, None, ": ", ",\n" + inner, False, False, True
        )
    return encoder


def _refuse(value: Any) -> Any:
    raise _Unsupported


_SCALAR_SET = frozenset((str, int, float, bool, type(None)))
_STR = frozenset((str,))


def _write(value: Any, indent: str, parts: list[str]) -> None:
    kind = type(value)
    if kind is not dict and kind is not list:
        parts.append(_scalar(value))
        return
    if not value:
        parts.append("{}" if kind is dict else "[]")
        return
    leaf = _leaf(value, indent)
    if leaf is not None:
        parts.append(leaf)
        return
    inner = indent + "  "
    append = parts.append
    if kind is dict:
        separator = "{\n" + inner
        for key, item in value.items():
            if type(key) is not str:  # json.dumps converts or refuses other keys
                raise _Unsupported
            if type(item) is str:
                append(f"{separator}{encode_basestring(key)}: {encode_basestring(item)}")
            elif type(item) in _CONTAINERS:
                append(f"{separator}{encode_basestring(key)}: ")
                _write(item, inner, parts)
            else:
                append(f"{separator}{encode_basestring(key)}: {_scalar(item)}")
            separator = ",\n" + inner
        append("\n" + indent + "}")
        return
    separator = "[\n" + inner
    for item in value:
        append(separator)
        _write(item, inner, parts)
        separator = ",\n" + inner
    append("\n" + indent + "]")
