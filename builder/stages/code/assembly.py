"""Assembling pieces into one environment module, and every check of the module against the contract and plan.

Problems found in the assembled module (the lint, the return contract, the tool schemas compared with the
plan) are mapped back to the piece whose lines they are on, so only that piece is regenerated, with the exact
message. Imports are hoisted, deduplicated, and completed from the standard-library allow-list when a piece
uses a module or a `typing` name it forgot to import. The module docstring carries the plan's description and
numbered rules, so the code states what it enforces to whoever reads it (the evaluate stage's tester and checker,
scenario writers, agents). `split_module` is the inverse of `assemble`: the pieces of a finished module, so a
later stage can regenerate one of them. Nothing here runs the generated code.
"""

from __future__ import annotations

import ast
import builtins
import textwrap
from dataclasses import dataclass, field
from typing import Any

from builder.envs.lint import lint
from builder.envs.schema import inspect_source
from builder.envs.signatures import annotation_schema, tool_methods
from builder.envs.validate import standard_schema
from builder.pyast import parse, symbols
from builder.records import EnvPlan, OperationPlan
from builder.sandbox.allowed import ALLOWED_MODULES
from builder.stages.code.pieces import STATE, Piece, PieceError, signature

IMPORTS = "imports"  # pseudo-piece owning import lines no piece wrote (the automatic ones)

_FROM_IMPORTS = {
    **{name: "typing" for name in "Any Optional List Dict Tuple Set Union Literal Iterable Sequence Mapping".split()},
    **{name: "collections" for name in ("defaultdict", "Counter", "OrderedDict", "deque")},
    **{name: "datetime" for name in ("timedelta", "date", "timezone")},
}
_MODULES = {name for name in ALLOWED_MODULES if "." not in name and not name.startswith("_")}
# Attributes only the `datetime.datetime` class has: code calling them on a bare `datetime` means the class.
_DATETIME_CLASS_ATTRIBUTES = {"now", "utcnow", "strptime", "fromisoformat", "fromtimestamp", "combine", "today"}


@dataclass(frozen=True)
class Assembly:
    """The module's source and which piece each line came from (1-based, inclusive spans)."""

    source: str
    spans: tuple[tuple[int, int, str], ...]
    import_owners: dict[int, tuple[str, ...]] = field(default_factory=dict)
    added_imports: tuple[str, ...] = ()

    def locate(self, line: int) -> tuple[str, int]:
        """(piece key, line within the piece) of a module line; header lines belong to their importers."""
        for start, end, key in self.spans:
            if start <= line <= end:
                return key, line - start + 1
        # An automatic import can only name an allowed module, so a problem there belongs to a piece that wrote one.
        owners = [owner for owner in self.import_owners.get(line, ()) if owner != IMPORTS]
        return (owners[0] if owners else STATE), 0


def assemble(plan: EnvPlan, state: Piece, methods: list[Piece]) -> Assembly:
    """One module: docstring, imports (hoisted and completed), the class, then each method indented into it."""
    first = _render(plan, state, methods, extra=())
    added = missing_imports(first.source)
    return _render(plan, state, methods, extra=tuple(added)) if added else first


def module_docstring(plan: EnvPlan) -> list[str]:
    """The module docstring's lines: the plan's description, then its numbered rules."""

    def clean(text: str) -> str:
        return " ".join(text.split()).replace("\\", "/").replace('"""', "'''")

    if not plan.rules:
        return [f'"""{clean(plan.description)}"""']
    rules = [f"{number}. {clean(rule)}" for number, rule in enumerate(plan.rules, 1)]
    return [f'"""{clean(plan.description)}', "", "Rules:", *rules, '"""']


def _render(plan: EnvPlan, state: Piece, methods: list[Piece], extra: tuple[str, ...]) -> Assembly:
    lines = [*module_docstring(plan), ""]
    owners: dict[str, list[str]] = {}
    for piece in [state, *methods]:
        for statement in piece.imports:
            owners.setdefault(statement, []).append(piece.key)
    for statement in extra:
        owners.setdefault(statement, []).append(IMPORTS)
    import_owners: dict[int, tuple[str, ...]] = {}
    for statement in sorted(owners, key=lambda s: (s.startswith("from "), s)):
        lines.append(statement)
        import_owners[len(lines)] = tuple(owners[statement])
    lines += ["", ""]
    spans = []
    body = state.body.rstrip("\n").splitlines()
    spans.append((len(lines) + 1, len(lines) + len(body), STATE))
    lines += body
    for piece in methods:
        lines.append("")
        indented = textwrap.indent(piece.body.rstrip("\n"), "    ").splitlines()
        spans.append((len(lines) + 1, len(lines) + len(indented), piece.key))
        lines += indented
    return Assembly("\n".join(lines) + "\n", tuple(spans), import_owners, extra)


def split_module(source: str, plan: EnvPlan) -> dict[str, Piece]:
    """The pieces of an assembled module, keyed like the code stage's: `assemble` of them gives the module back.

    The class line, its docstring, `__init__` and anything before the first planned method form the state piece;
    each planned method with the private helpers after it (up to the next planned method) forms that method's
    piece. The module's imports all go to the state piece: they are hoisted and deduplicated on assembly anyway.
    """
    tree = parse(source)
    lines = source.splitlines()
    imports = tuple(
        "\n".join(lines[node.lineno - 1 : node.end_lineno])
        for node in tree.body
        if isinstance(node, ast.Import | ast.ImportFrom)
    )
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef))
    planned = {op.name for op in plan.operations}
    owners: list[tuple[str, int]] = [(STATE, min([cls.lineno] + [d.lineno for d in cls.decorator_list]))]
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name in planned:
            owners.append((node.name, min([node.lineno] + [d.lineno for d in node.decorator_list])))
    ends = [start - 1 for _, start in owners[1:]] + [cls.end_lineno or len(lines)]
    pieces = {}
    for (key, start), end in zip(owners, ends, strict=True):
        text = "\n".join(lines[start - 1 : end]).rstrip()
        body = text if key == STATE else textwrap.dedent(text)
        pieces[key] = Piece(key, imports if key == STATE else (), body + "\n")
    return pieces


def unbound_names(source: str) -> dict[str, int]:
    """Names some scope loads that no scope it can see binds (nor are builtins), with the first line using each:
    each a NameError waiting to happen, e.g. `datetime.now()` in a method when only another method imports it."""
    return {name: min(use.lineno for use in uses) for name, uses in sorted(_unbound_uses(source).items())}


def _unbound_uses(source: str) -> dict[str, list[ast.Name]]:
    """Each unbound name with its uses (the loads inside the scopes that cannot see a binding of it).

    `symtable` resolves scopes as the compiler does, without running anything: a name that a function, lambda,
    comprehension or class body reads is local, free (bound by an enclosing function) or global, and a global
    one must be bound at module level or be a builtin.
    """
    try:
        tree, table = parse(source), symbols(source)
    except (SyntaxError, ValueError):
        return {}
    known = {symbol.get_name() for symbol in table.get_symbols() if symbol.is_assigned() or symbol.is_imported()}
    known |= set(dir(builtins))
    spans: dict[str, list[tuple[int, int]]] = {}  # name -> line spans of the scopes where it is unbound
    scope_end = {node.lineno: node.end_lineno or node.lineno for node in ast.walk(tree) if isinstance(node, _SCOPES)}
    scope_end[0] = len(source.splitlines())  # the module's own scope (line 0 in symtable)
    pending = [table]
    while pending:
        scope = pending.pop()
        pending.extend(scope.get_children())
        for symbol in scope.get_symbols():
            if symbol.is_referenced() and symbol.is_global() and symbol.get_name() not in known:
                line = scope.get_lineno()
                spans.setdefault(symbol.get_name(), []).append((line, scope_end.get(line, line)))
    uses: dict[str, list[ast.Name]] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id in spans:
            if any(start <= node.lineno <= end for start, end in spans[node.id]):
                uses.setdefault(node.id, []).append(node)
    return uses


# AST nodes that open a scope of their own (what `symtable` calls a function or class block).
_SCOPES = (
    ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp,
    ast.GeneratorExp,
)  # fmt: skip


def missing_imports(source: str) -> list[str]:
    """Import statements for names the code uses without binding them, when the allow-list provides them."""
    uses = _unbound_uses(source)
    datetime_uses = {(use.lineno, use.col_offset) for use in uses.get("datetime", ())}
    datetime_attributes = {
        node.attr
        for node in (ast.walk(parse(source)) if datetime_uses else ())
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and (node.value.lineno, node.value.col_offset) in datetime_uses
    }
    added = []
    for name in sorted(uses):
        if name == "datetime" and datetime_attributes and datetime_attributes <= _DATETIME_CLASS_ATTRIBUTES:
            added.append("from datetime import datetime")
        elif name in _MODULES:
            added.append(f"import {name}")
        elif name in _FROM_IMPORTS:
            added.append(f"from {_FROM_IMPORTS[name]} import {name}")
    return sorted(added, key=lambda s: (s.startswith("import "), s))


def module_errors(assembly: Assembly, plan: EnvPlan) -> dict[str, list[PieceError]]:
    """Errors by piece key: lint problems, the return contract, then tool schemas against the plan."""
    errors: dict[str, list[PieceError]] = {}
    lines = assembly.source.splitlines()

    def add(line: int, code: str, message: str) -> None:
        key, relative = assembly.locate(line)
        text = lines[line - 1] if 0 < line <= len(lines) else ""
        errors.setdefault(key, []).append(PieceError(code, message, relative, text))

    for problem in lint(assembly.source):
        add(problem.line, problem.code, problem.message)
    for name, line in unbound_names(assembly.source).items():
        add(line, "undefined_name", f"{name} is not defined; define it or import it from the allowed modules")
    if errors:
        return errors
    cls = next(node for node in parse(assembly.source).body if isinstance(node, ast.ClassDef))
    seen: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            if node.name in seen:  # a later definition silently replaces the earlier one
                add(node.lineno, "duplicate_definition", f"{node.name} is already defined; rename this one")
            seen.add(node.name)
    for method in tool_methods(cls):
        for line, code, message in return_problems(method):
            add(line, code, message)
    if errors:
        return errors
    tools = {tool["function"]["name"]: tool for tool in inspect_source(assembly.source).tools}
    for op in plan.operations:
        for message in schema_problems(tools.get(op.name), op):
            errors.setdefault(op.name, []).append(PieceError("schema_mismatch", message))
    for extra in sorted(set(tools) - {op.name for op in plan.operations}):
        method = next(m for m in tool_methods(cls) if m.name == extra)
        add(method.lineno, "unplanned_tool", f"{extra} is not a planned operation; make it private (_{extra})")
    return errors


def return_problems(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[tuple[int, str, str]]:
    """Tools return JSON values and report errors as values: no bare `return`, no `raise`, some return value."""
    problems = []
    returns = 0
    for node in _own_nodes(method):
        if isinstance(node, ast.Raise):
            message = 'do not raise; return {"success": False, "error": "<reason>"} instead'
            problems.append((node.lineno, "raises", message))
        elif isinstance(node, ast.Return):
            if node.value is None or isinstance(node.value, ast.Constant) and node.value.value is None:
                problems.append((node.lineno, "bare_return", 'return a dict such as {"success": True, ...}'))
            else:
                returns += 1
    if not returns and not problems:
        problems.append((method.lineno, "no_return_value", f'{method.name} must return a dict {{"success": ...}}'))
    return problems


def _own_nodes(method: ast.AST) -> list[ast.AST]:
    """Nodes of `method`'s body, not descending into nested functions or lambdas (their returns are theirs)."""
    found: list[ast.AST] = []
    stack = list(ast.iter_child_nodes(method))
    while stack:
        node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            continue
        found.append(node)
        stack.extend(ast.iter_child_nodes(node))
    return found


def schema_problems(tool: dict[str, Any] | None, op: OperationPlan) -> list[str]:
    """How the derived schema of `op`'s tool differs from the plan; each message names the expected signature."""
    expected = f"the plan's signature is `{signature(op)}`"
    if tool is None:
        return [f"the method {op.name} is missing; {expected}"]
    parameters = tool["function"]["parameters"]
    properties, required = parameters["properties"], set(parameters.get("required", ()))
    planned = {p.name: p for p in op.parameters}
    problems = []
    for name in [p.name for p in op.parameters if p.name not in properties]:
        problems.append(f"parameter {name} is missing; {expected}")
    for name in [name for name in properties if name not in planned]:
        problems.append(f"parameter {name} is not planned; {expected}")
    for name, param in planned.items():
        if name not in properties:
            continue
        if param.required and name not in required:
            problems.append(f"parameter {name} is required: remove its default; {expected}")
        if not param.required and name in required:
            problems.append(f"parameter {name} is optional: give it the default None; {expected}")
        want = annotation_schema(parse(param.type, mode="eval").body)["type"]
        if want not in _types(properties[name]):
            problems.append(f"parameter {name} must have type {param.type}; {expected}")
    return problems


def _types(schema: dict[str, Any]) -> set[str]:
    kind = schema.get("type")
    found = set(kind) if isinstance(kind, list) else {kind} if kind else set()
    for option in schema.get("anyOf", []):
        found |= _types(option)
    return found or {"string", "integer", "number", "boolean", "array", "object"}  # Any accepts everything


def state_schema(plan: EnvPlan) -> dict[str, Any]:
    """JSON schema of the state: one object per collection mapping a record's key to the record."""
    properties = {}
    for entity in plan.entities:
        attributes = {}
        for attribute in entity.attributes:
            schema = standard_schema(annotation_schema(parse(attribute.type, mode="eval").body))
            attributes[attribute.name] = {
                **schema,
                **({"description": attribute.description} if attribute.description else {}),
            }
        properties[entity.collection] = {
            "type": "object",
            "description": f"{entity.name} records by {entity.key}",
            "additionalProperties": {"type": "object", "properties": attributes, "required": [entity.key]},
        }
    return {"type": "object", "properties": properties, "required": list(properties), "additionalProperties": False}
