"""What a tool's docstring says: its description, each parameter's text, type and optionality, and its return text.

Three styles, because imported classes use all of them: Google (`Args:` with `name: text` or `name (type): text`,
BFCL's `[Optional]` marker at the start of the text), NumPy (`Parameters` over a dashed rule, `name : type` with
the text indented below) and reST (`:param name: text`, `:param type name: text`, `:type name: type`,
`:returns:`). On a Google docstring the description and return text are cut exactly as transformers'
`get_json_schema` cuts them, so generated environments render the same schema bytes as TRL derives. The parser
never fails: what it does not recognise is left out.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

from builder.envs.signatures import annotation_schema
from builder.pyast import parse

# transformers' get_json_schema rules (chat_template_utils, 5.x): the description is the text before the first
# Args:/Returns:/Raises:, the return text what follows `Returns:` up to `Raises:`.
DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
GOOGLE_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns|Return|Raises|Yields|Examples?|Notes?):\s*$")
GOOGLE_ARG = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\(([^)]*)\))?\s*:\s*(.*)$")
NUMPY_RULE = re.compile(r"^\s*-{3,}\s*$")
NUMPY_ARG = re.compile(r"^\s*(\*{0,2}\w+(?:\s*,\s*\*{0,2}\w+)*)\s*(?::\s*(.*))?$")
REST_FIELD = re.compile(r"^\s*:(\w+)(?:\s+([^:]*?))?\s*:\s*(.*)$")
REST_PARAM = ("param", "parameter", "arg", "argument", "key", "keyword")
OPTIONAL_MARK = re.compile(r"^\s*\[optional\]\s*", re.IGNORECASE)
OPTIONAL_TYPE = re.compile(r"(,\s*|\s+|^)optional\b", re.IGNORECASE)
# Docstring type words -> the Python names the annotation reader knows.
TYPE_WORDS = {
    "string": "str", "integer": "int", "boolean": "bool", "number": "float", "double": "float", "array": "list",
    "object": "dict", "mapping": "dict", "dictionary": "dict", "none": "None", "null": "None",
}  # fmt: skip


class ParameterDoc(NamedTuple):
    """One documented parameter: its text, the type the docstring names (None: none) and whether it says optional."""

    description: str
    type: str | None = None
    optional: bool = False


class Docstring(NamedTuple):
    """The parts of a docstring a tool schema uses."""

    description: str
    parameters: dict[str, ParameterDoc]
    returns: str | None


def parse_docstring(docstring: str) -> Docstring:
    """The description, the parameters (in every style found) and the return text of `docstring`."""
    text = docstring.strip()
    lines = text.expandtabs().splitlines()
    first_other = _first_numpy_or_rest_line(lines)
    head = "\n".join(lines[:first_other]) if first_other is not None else text
    summary = DESCRIPTION.match(head)
    parameters = _google(lines) | _numpy(lines) | _rest(lines)
    return Docstring(summary.group(1).strip() if summary else "", parameters, _returns(text, lines))


def docstring_type_schema(text: str | None) -> dict[str, Any] | None:
    """The JSON schema of a docstring's type text (`str`, `List[int]`, `int, optional`, `list of str`,
    `str or None`), or None when it names nothing the annotation reader knows."""
    if not text:
        return None
    cleaned = OPTIONAL_TYPE.sub("", text).strip().strip(",").strip()
    cleaned = re.sub(r"\b(?:list|array)\s+of\s+(\w+)", r"list[\1]", cleaned, flags=re.IGNORECASE)
    cleaned = re.sub(r"\s+or\s+", " | ", cleaned)
    cleaned = re.sub(r"\w+", lambda word: TYPE_WORDS.get(word.group(0).lower(), word.group(0)), cleaned)
    try:
        return annotation_schema(parse(cleaned, mode="eval").body)
    except (SyntaxError, ValueError):
        return None


def _parameter(description: str, kind: str | None) -> ParameterDoc:
    marked = OPTIONAL_MARK.match(description)
    kind = kind.strip() if kind and kind.strip() else None
    optional = bool(marked) or bool(kind and OPTIONAL_TYPE.search(kind))
    return ParameterDoc(OPTIONAL_MARK.sub("", description, count=1).strip(), kind, optional)


def _google(lines: list[str]) -> dict[str, ParameterDoc]:
    found: dict[str, list[Any]] = {}  # name -> [description, type]
    section, current, indent = None, None, 0
    for line in lines:
        header = GOOGLE_SECTION.match(line)
        if header:
            section, current = header.group(1), None
            continue
        if section not in ("Args", "Arguments", "Parameters") or not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        match = GOOGLE_ARG.match(line)
        if match and (current is None or width <= indent):
            current, indent = match.group(1).lstrip("*"), width
            found[current] = [match.group(3).strip(), match.group(2)]
        elif current is not None:
            found[current][0] = f"{found[current][0]} {line.strip()}".strip()
    return {name: _parameter(text, kind) for name, (text, kind) in found.items()}


def _numpy_sections(lines: list[str]) -> list[tuple[str, int, int]]:
    """(title, first line, end line) of each NumPy section: a title line over a dashed rule."""
    starts = [
        (lines[i].strip(), i + 2)
        for i in range(len(lines) - 1)
        if lines[i].strip() and NUMPY_RULE.match(lines[i + 1]) and not NUMPY_RULE.match(lines[i])
    ]
    return [(title, start, (starts[k + 1][1] - 2 if k + 1 < len(starts) else len(lines)))
            for k, (title, start) in enumerate(starts)]  # fmt: skip


def _numpy(lines: list[str]) -> dict[str, ParameterDoc]:
    found: dict[str, list[Any]] = {}
    for title, start, end in _numpy_sections(lines):
        if title.lower() not in ("parameters", "other parameters", "arguments", "args", "keyword arguments"):
            continue
        body = lines[start:end]
        base = min((len(line) - len(line.lstrip()) for line in body if line.strip()), default=0)
        names: list[str] = []
        for line in body:
            if not line.strip():
                continue
            match = NUMPY_ARG.match(line)
            if len(line) - len(line.lstrip()) == base and match:
                names = [name.strip().lstrip("*") for name in match.group(1).split(",")]
                for name in names:
                    found[name] = ["", match.group(2)]
            else:
                for name in names:
                    found[name][0] = f"{found[name][0]} {line.strip()}".strip()
    return {name: _parameter(text, kind) for name, (text, kind) in found.items()}


def _rest(lines: list[str]) -> dict[str, ParameterDoc]:
    texts: dict[str, str] = {}
    kinds: dict[str, str] = {}
    current: str | None = None
    for line in lines:
        match = REST_FIELD.match(line)
        if match:
            field, argument, rest = match.group(1).lower(), (match.group(2) or "").split(), match.group(3).strip()
            current = None
            if field in REST_PARAM and argument:
                current = argument[-1].lstrip("*")
                texts[current] = rest
                if len(argument) > 1:
                    kinds[current] = " ".join(argument[:-1])
            elif field == "type" and argument:
                kinds[argument[-1].lstrip("*")] = rest
        elif current is not None and line.strip():
            texts[current] = f"{texts[current]} {line.strip()}".strip()
        elif not line.strip():
            current = None
    return {name: _parameter(texts.get(name, ""), kinds.get(name)) for name in {**texts, **kinds}}


def _returns(text: str, lines: list[str]) -> str | None:
    google = RETURNS.search(text)
    if google:
        return google.group(1).strip()
    for title, start, end in _numpy_sections(lines):
        if title.lower() in ("returns", "return"):
            # `type` or `name : type` lines at the section's indent, each with its text indented below
            body = [line for line in lines[start:end] if line.strip()]
            base = min((len(line) - len(line.lstrip()) for line in body), default=0)
            text = [line.strip() for line in body if len(line) - len(line.lstrip()) > base]
            return " ".join(text or [line.strip() for line in body]) or None
    for index, line in enumerate(lines):
        match = REST_FIELD.match(line)
        if match and match.group(1).lower() in ("returns", "return"):
            more = []
            for follow in lines[index + 1 :]:
                if not follow.strip() or REST_FIELD.match(follow):
                    break
                more.append(follow.strip())
            return " ".join([match.group(3).strip(), *more]).strip() or None
    return None


def _first_numpy_or_rest_line(lines: list[str]) -> int | None:
    """Index of the first line that opens a NumPy section or a reST field (None: the docstring has neither)."""
    numpy = [start - 2 for _, start, _ in _numpy_sections(lines)]
    rest = [i for i, line in enumerate(lines) if REST_FIELD.match(line)]
    found = numpy + rest
    return min(found) if found else None
