"""Turning one model reply into one clean piece of an environment module, or into errors to feed back.

A piece is the class with its constructor (the state piece) or one operation's method. The model's text is
untrusted and only ever parsed (`ast`), never run. Trivial problems are fixed deterministically and recorded
by name (`Piece.fixes`): Markdown fences and prose around the code, tabs, a method written inside a class or
under another name, a missing `self`, decorators, a missing docstring, tool stubs in the state piece.
"""

from __future__ import annotations

import ast
import re
import textwrap
from collections.abc import Collection
from dataclasses import dataclass

from builder.pyast import parse
from builder.records import EnvPlan, OperationPlan

STATE = "__init__"  # key of the state piece; never an operation name (those are public snake_case names)

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_CODE_START = re.compile(r"^\s*(def |class |import |from \S+ import |@|async def )")


@dataclass(frozen=True)
class PieceError:
    """Why a piece is not acceptable: a stable `code`, a message saying what to change, the line in the piece."""

    code: str
    message: str
    line: int = 0
    text: str = ""

    def __str__(self) -> str:
        where = f"line {self.line}: " if self.line else ""
        shown = f" (the line is `{self.text.strip()}`)" if self.text.strip() else ""
        return f"[{self.code}] {where}{self.message}{shown}"


@dataclass(frozen=True)
class Piece:
    """Clean code of one piece: its top-level imports and its body (class or methods, at column 0)."""

    key: str
    imports: tuple[str, ...]
    body: str
    fixes: tuple[str, ...] = ()


def extract_code(text: str) -> tuple[str, list[str]]:
    """The code in a model reply: fenced blocks joined, or the text from the first code-looking line on.

    Returns:
        (code, fixes applied).
    """
    fixes: list[str] = []
    blocks = [body for lang, body in _FENCE.findall(text) if lang.casefold() in ("", "python", "py", "python3")]
    if blocks:
        text, fixes = "\n\n".join(blocks), ["stripped_fences"]
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if _CODE_START.match(line)), 0)
    if start:
        lines, fixes = lines[start:], [*fixes, "dropped_leading_prose"]
    if any("\t" in line[: len(line) - len(line.lstrip())] for line in lines):
        lines, fixes = [line.expandtabs(4) for line in lines], [*fixes, "expanded_tabs"]
    code = textwrap.dedent("\n".join(lines)).strip("\n")
    trimmed = _drop_trailing_prose(code)
    if trimmed != code:
        code, fixes = trimmed, [*fixes, "dropped_trailing_prose"]
    return code + "\n", fixes


def _drop_trailing_prose(code: str) -> str:
    """Cut unindented non-code lines off the end while the code does not parse (explanations after code)."""
    lines = code.splitlines()
    while lines and not _parses("\n".join(lines)):
        last = lines[-1]
        if last.strip() and (last[:1].isspace() or _CODE_START.match(last) or last.lstrip().startswith("#")):
            break
        lines.pop()
    return "\n".join(lines) if lines and _parses("\n".join(lines)) else code


def _parses(code: str) -> bool:
    try:
        parse(code)
    except (SyntaxError, RecursionError, MemoryError):
        return False
    return True


def _parse(code: str, truncated: bool) -> ast.Module | PieceError:
    try:
        return parse(code)
    except (RecursionError, MemoryError):  # absurdly deep nesting: the parser gives up before any syntax error
        return PieceError("syntax", "the code is nested too deeply to parse; write simpler code")
    except SyntaxError as error:
        cut = " The reply used up its whole token budget and stops unfinished." if truncated else ""
        lines = code.splitlines()
        text = lines[error.lineno - 1] if error.lineno and 0 < error.lineno <= len(lines) else ""
        return PieceError("syntax", f"the code does not parse: {error.msg}.{cut}", error.lineno or 0, text)


def _imports(tree: ast.Module) -> tuple[str, ...]:
    return tuple(ast.unparse(node) for node in tree.body if isinstance(node, ast.Import | ast.ImportFrom))


def _segment(lines: list[str], node: ast.AST, skip: Collection[int] = ()) -> str:
    """Source lines of `node` (decorators excluded), minus the 0-based line numbers in `skip`, dedented."""
    chosen = [lines[i] for i in range(node.lineno - 1, node.end_lineno or node.lineno) if i not in skip]
    return textwrap.dedent("\n".join(chosen))


def state_piece(text: str, plan: EnvPlan, truncated: bool = False) -> Piece | list[PieceError]:
    """The class statement with its docstring, `__init__` and private helpers; tool stubs are dropped."""
    code, fixes = extract_code(text)
    tree = _parse(code, truncated)
    if isinstance(tree, PieceError):
        return [tree]
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    inits = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"]
    if not classes and inits:  # only the constructor was written: put it in the planned class
        code = f"class {plan.class_name}:\n" + textwrap.indent(_segment(code.splitlines(), inits[0]), "    ") + "\n"
        tree, fixes = parse(code), [*fixes, "wrapped_in_class"]
        classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    if not classes:
        return [PieceError("missing_class", f"write the class statement `class {plan.class_name}:` with __init__")]
    cls = next((c for c in classes if c.name == plan.class_name), classes[-1])
    if len(classes) > 1:
        fixes.append("dropped_extra_classes")
    lines = code.splitlines()
    skip: set[int] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not node.name.startswith("_"):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            skip.update(range(first - 1, node.end_lineno or node.lineno))
    if skip:
        fixes.append("dropped_tool_stubs")  # tools come from the operation pieces, one request each
    body = _segment(lines, cls, skip) + "\n"
    if cls.name != plan.class_name:
        body = re.sub(rf"^class\s+{re.escape(cls.name)}\b", f"class {plan.class_name}", body, count=1)
        fixes.append("renamed_class")
    body = body.replace(f"class {plan.class_name}(object)", f"class {plan.class_name}", 1)
    tree_body = _parse(body, truncated)
    if isinstance(tree_body, PieceError):  # e.g. the class held nothing but tool stubs
        return [PieceError("missing_init", "define __init__(self) setting the state attributes")]
    errors = state_errors(tree_body.body[0], plan)  # type: ignore[arg-type]
    return errors or Piece(STATE, _imports(tree), body, tuple(fixes))


def state_errors(cls: ast.ClassDef, plan: EnvPlan) -> list[PieceError]:
    """`__init__` must set exactly the planned collections, each to a dict."""
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None:
        return [PieceError("missing_init", "define __init__(self) setting the state attributes")]
    assigned: dict[str, ast.expr | None] = {}
    for node in ast.walk(init):
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                assigned[target.attr] = getattr(node, "value", None)
    errors = []
    for entity in plan.entities:
        value = assigned.get(entity.collection)
        expected = f"self.{entity.collection} = {{}}  ({entity.name} records by {entity.key})"
        if entity.collection not in assigned:
            errors.append(PieceError("state_mismatch", f"__init__ must set {expected}", init.lineno))
        elif not (isinstance(value, ast.Dict) or isinstance(value, ast.Call) and ast.unparse(value.func) == "dict"):
            errors.append(PieceError("state_mismatch", f"set {expected}: a dict", getattr(value, "lineno", 0)))
    planned = {entity.collection for entity in plan.entities}
    for extra in sorted(set(assigned) - planned):
        message = f"self.{extra} is not planned state; keep only {', '.join(sorted(planned))} (constants go in methods)"
        errors.append(PieceError("state_mismatch", message, init.lineno))
    return errors


def method_piece(text: str, op: OperationPlan, truncated: bool = False) -> Piece | list[PieceError]:
    """The method of `op` (plus private helper methods); see the module docstring for what is fixed."""
    code, fixes = extract_code(text)
    tree = _parse(code, truncated)
    if isinstance(tree, PieceError):
        return [tree]
    defs = [n for n in tree.body if isinstance(n, ast.FunctionDef)]
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        defs += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"]
        fixes.append("extracted_from_class")
    target = next((d for d in defs if d.name == op.name), None)
    public = [d for d in defs if not d.name.startswith("_")]
    if target is None and len(public) == 1:
        target = public[0]
        fixes.append(f"renamed_method:{target.name}")
    if target is None and any(isinstance(n, ast.AsyncFunctionDef) and n.name == op.name for n in ast.walk(tree)):
        return [PieceError("async_tool", f"{op.name} must be a plain `def`, not `async def`")]
    if target is None:
        got = ", ".join(d.name for d in defs) or "none"
        return [PieceError("missing_method", f"define the method `def {op.name}(self, ...)`; defined: {got}")]
    lines = code.splitlines()
    method = _segment(lines, target)
    if target.decorator_list:
        fixes.append("dropped_decorators")
    has_self = bool(target.args.args) and target.args.args[0].arg == "self"
    self_part = "" if has_self else ("self, " if target.args.args or target.args.kwonlyargs else "self")
    if not has_self:
        fixes.append("added_self")
    method = re.sub(rf"^def\s+{re.escape(target.name)}\s*\(", f"def {op.name}({self_part}", method, count=1)
    if ast.get_docstring(target) is None and target.body:
        method = _with_docstring(method, target, op)
        fixes.append("inserted_docstring")
    helpers = [d for d in defs if d is not target and d.name.startswith("_") and d.args.args]
    if len(public) > 1:
        fixes.append("dropped_extra_definitions")
    body = "\n\n".join([method] + [_segment(lines, helper) for helper in helpers]) + "\n"
    checked = _parse(body, truncated)
    if isinstance(checked, PieceError):
        return [checked]
    return Piece(op.name, _imports(tree), body, tuple(fixes))


def _with_docstring(method: str, target: ast.FunctionDef, op: OperationPlan) -> str:
    """Insert the plan's docstring before the first statement of the (dedented) method."""
    offset = target.body[0].lineno - target.lineno  # first body line, relative to the def line
    lines = method.splitlines()
    indent = " " * (len(lines[offset]) - len(lines[offset].lstrip())) if offset < len(lines) else "    "
    if offset == 0:  # `def f(self): return 1` on one line
        return method
    doc = textwrap.indent(docstring(op), indent)
    return "\n".join(lines[:offset] + doc.splitlines() + lines[offset:])


def signature(op: OperationPlan) -> str:
    """`def name(self, a: str, b: Optional[int] = None) -> dict:`; required parameters first."""
    ordered = [p for p in op.parameters if p.required] + [p for p in op.parameters if not p.required]
    params = ["self"] + [p.name + (f": {p.type}" if p.required else f": Optional[{p.type}] = None") for p in ordered]
    return f"def {op.name}({', '.join(params)}) -> dict:"


def docstring(op: OperationPlan) -> str:
    """The Google docstring of an operation's method: summary, Args and Returns, from the plan."""
    summary = op.description.replace('"""', "'''").replace("\\", "/") or op.name.replace("_", " ")
    lines = ['"""' + summary, ""]
    if op.parameters:
        lines.append("Args:")
        for p in op.parameters:
            text = (p.description or p.name.replace("_", " ")).replace('"""', "'''").replace("\\", "/")
            lines.append(f"    {p.name}: {text}" + ("" if p.required else " (optional)"))
        lines.append("")
    result = op.returns.replace('"""', "'''").replace("\\", "/") or "the result"
    lines += ["Returns:", f'    {{"success": True, ...}} with {result}; or {{"success": False, "error": ...}}.', '"""']
    return "\n".join(lines)
