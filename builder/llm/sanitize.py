"""Cleaning model text of characters no record can hold: lone surrogates and NUL.

A JSON grammar allows the escape `"\\ud800"` without its low half, and `json.loads` (the SDK's, or ours on
structured output and tool-call arguments) turns it into a lone surrogate: a `str` that pydantic cannot
serialize, SQLite and Parquet cannot store. NUL (`"\\u0000"`) serializes, but no Python source, path or
C-string API takes it. Both are cleaned once, where the text comes out of the model layer: a reply's content,
reasoning and tool calls (`clean_reply`, before the response cache) and the values of parsed structured output
(`clean_value`). A lone surrogate becomes U+FFFD (the replacement character, so the text keeps its length and
shows where something was lost); a NUL is dropped. Everything else is left exactly as it was.
"""

from __future__ import annotations

import json
import re
from typing import Any

from builder.llm.base import Reply
from builder.records import FunctionCall, ToolCall

REPLACEMENT = "\ufffd"
# After json.loads a valid pair is one character, so every surrogate code point left in a str is a lone one.
_SURROGATE = re.compile("[\ud800-\udfff]")
# JSON escapes that may decode to a lone surrogate or NUL. A match is only a hint (a valid pair matches too, and so
# does an escaped backslash before "u"): the text is decoded to find out, and kept as it is when nothing was bad.
_BAD_ESCAPE = re.compile(r"\\u(?:d[89ab][0-9a-f]{2}|d[c-f][0-9a-f]{2}|0000)", re.IGNORECASE)


def clean_text(text: str) -> str:
    """`text` with lone surrogates replaced by U+FFFD and NUL characters removed."""
    if text.isascii():
        return text.replace("\x00", "")
    return _SURROGATE.sub(REPLACEMENT, text).replace("\x00", "")


def clean_value(value: Any) -> Any:
    """A decoded JSON value with every string in it (keys included) cleaned by `clean_text`."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, dict):
        return {clean_value(key): clean_value(item) for key, item in value.items()}
    if isinstance(value, list):
        return [clean_value(item) for item in value]
    return value


def clean_json_text(text: str) -> str:
    """JSON text (tool-call arguments, structured output) whose decoded strings hold no lone surrogate or NUL.

    Text whose decoded strings are clean is returned as it is, byte for byte (raw lone surrogates and NULs
    aside, which are cleaned as in `clean_text`). Otherwise valid JSON is decoded, cleaned and encoded again;
    text that is not JSON keeps its escapes (it is refused later as invalid, and escapes are plain ASCII).
    """
    cleaned = clean_text(text)
    if not _BAD_ESCAPE.search(cleaned):
        return cleaned
    try:
        value = json.loads(cleaned)
    except ValueError:
        return cleaned
    fixed = clean_value(value)
    return cleaned if fixed == value else json.dumps(fixed, ensure_ascii=False)


def clean_reply(reply: Reply) -> Reply:
    """`reply` with its content, reasoning and tool calls (names, ids, arguments) cleaned."""
    update: dict[str, Any] = {}
    for name in ("content", "reasoning"):
        text = getattr(reply, name)
        if text is not None and (cleaned := clean_text(text)) != text:
            update[name] = cleaned
    calls = tuple(_clean_call(call) for call in reply.tool_calls)
    if calls != reply.tool_calls:
        update["tool_calls"] = calls
    return reply.model_copy(update=update) if update else reply


def _clean_call(call: ToolCall) -> ToolCall:
    function = FunctionCall(name=clean_text(call.function.name), arguments=clean_json_text(call.function.arguments))
    cleaned = call.model_copy(update={"id": clean_text(call.id), "function": function})
    return call if cleaned == call else cleaned
