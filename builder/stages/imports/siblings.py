"""Inlining what a module imports from a sibling module, so an imported environment stays one module.

BFCL's classes import constants from a module in their own folder by its installed package path
(`from bfcl_eval.eval_checker.multi_turn_eval.func_source_code.long_context import WATCH_LIST_EXTENSION`); the
sandbox has no such package, and an environment's code is a single module by design. So `import classes`
replaces such an import, in place, by the sibling's top-level statements that bind the imported names (and the
sibling's top-level names those statements use, in the sibling's order), under a visible `MARK` line naming the
file and the names: the published module is what runs, and the audit can list what was inlined from its code.

A sibling import is `from .name import ...` or `from a.b.name import ...` (any absolute path) where `name.py` is a
file next to the module. Anything else is left as written for the sandbox to judge; so is a sibling import that
cannot be resolved (the sibling does not parse, or does not bind a name): the load error then names it.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from builder.pyast import parse

MARK = "# --- inlined by `python -m builder import` from"
_MARK_LINE = re.compile(r"^# --- inlined by `python -m builder import` from (\S+): (.*)$", re.MULTILINE)


@dataclass(frozen=True)
class Inlined:
    module: str  # the sibling's file name, e.g. long_context.py
    names: tuple[str, ...]  # the names the module imported from it


def inline_siblings(code: str, path: Path) -> tuple[str, tuple[Path, ...]]:
    """`code` (the module at `path`) with its sibling imports inlined, and the sibling files read."""
    try:
        tree = parse(code)
    except SyntaxError:
        return code, ()
    lines = code.splitlines(keepends=True)
    read: list[Path] = []
    for node in reversed(tree.body):  # from the bottom up, so earlier line numbers stay valid
        sibling = _sibling(node, path)
        if sibling is None:
            continue
        text = _inlined_text(node, sibling)  # type: ignore[arg-type]
        if text is None:
            continue
        read.append(sibling)
        lines[node.lineno - 1 : node.end_lineno] = [text]
    return "".join(lines), tuple(reversed(read))


def inlined_imports(code: str) -> tuple[Inlined, ...]:
    """What `inline_siblings` inlined into `code`, read back from its mark lines."""
    return tuple(Inlined(m[1], tuple(m[2].split(", "))) for m in _MARK_LINE.finditer(code))


def _sibling(node: ast.stmt, path: Path) -> Path | None:
    if not isinstance(node, ast.ImportFrom) or not node.module or node.level > 1:
        return None
    if node.level == 1 and "." in node.module:
        return None  # `from .package.module import`: a subpackage, not a sibling file
    candidate = path.parent / f"{node.module.rsplit('.', 1)[-1]}.py"
    return candidate if candidate.is_file() and candidate.resolve() != path.resolve() else None


def _inlined_text(node: ast.ImportFrom, sibling: Path) -> str | None:
    source = sibling.read_text(encoding="utf-8", errors="replace")
    try:
        tree = parse(source)
    except SyntaxError:
        return None
    bound = _bindings(tree)
    if any(alias.name == "*" for alias in node.names):
        wanted = [name for name in bound if not name.startswith("_")]
        aliases: list[tuple[str, str]] = []
    else:
        wanted = [alias.name for alias in node.names]
        aliases = [(alias.asname, alias.name) for alias in node.names if alias.asname and alias.asname != alias.name]
    if not wanted or any(name not in bound for name in wanted):
        return None
    needed = _closure(tree, bound, wanted)
    body = [ast.get_source_segment(source, statement, padded=True) or "" for statement in needed]
    body += [f"{alias} = {name}" for alias, name in aliases]
    header = f"{MARK} {sibling.name}: {', '.join(wanted)}"
    return header + "\n" + "\n".join(body) + "\n# --- end of the inlined code\n"


def _bindings(tree: ast.Module) -> dict[str, ast.stmt]:
    """Top-level name -> the (last) statement that binds it."""
    bound: dict[str, ast.stmt] = {}
    for statement in tree.body:
        for name in _bound_names(statement):
            bound[name] = statement
    return bound


def _bound_names(statement: ast.stmt) -> list[str]:
    if isinstance(statement, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [statement.name]
    if isinstance(statement, ast.Import | ast.ImportFrom):
        return [(alias.asname or alias.name).split(".")[0] for alias in statement.names if alias.name != "*"]
    targets = statement.targets if isinstance(statement, ast.Assign) else []
    if isinstance(statement, ast.AnnAssign | ast.AugAssign):
        targets = [statement.target]
    return [node.id for target in targets for node in ast.walk(target) if isinstance(node, ast.Name)]


def _closure(tree: ast.Module, bound: dict[str, ast.stmt], wanted: list[str]) -> list[ast.stmt]:
    """The statements binding `wanted` and every top-level name they use, in the sibling's order."""
    chosen: set[int] = set()
    pending = list(wanted)
    while pending:
        statement = bound[pending.pop()]
        if id(statement) in chosen:
            continue
        chosen.add(id(statement))
        used = {node.id for node in ast.walk(statement) if isinstance(node, ast.Name)}
        pending += [name for name in used if name in bound and id(bound[name]) not in chosen]
    return [statement for statement in tree.body if id(statement) in chosen]
