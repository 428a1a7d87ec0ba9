"""The environment contract (docs/sandbox.md) as an AST lint: each violation is a `Problem` with a stable code.

The lint never executes the code. It is a pre-flight filter that gives the generating model precise feedback
(its messages say what to change), not the security boundary: that is the sandbox. Codes are stable strings;
add new ones, never rename old ones.

Two trust levels (`Contract`) read the same problems differently. `strict` (generated code) refuses a module with
any problem. `import` (environments someone else wrote: BFCL-style classes, EnvScaler's release) refuses only
what leaves nothing to load (`STRUCTURAL`: no parse, no class) and reports the rest as information; the
sandbox, which never trusted the lint, stays the boundary.
"""

from __future__ import annotations

import ast
import re
import unicodedata
from collections import Counter
from typing import Literal

from pydantic import BaseModel, ConfigDict

from builder.envs.docstrings import parse_docstring
from builder.envs.signatures import annotation_schema, environment_class, tool_methods, tool_parameters
from builder.errors import ItemError
from builder.pyast import parse
from builder.sandbox.allowed import ALLOWED_MODULES

# code -> what it means (also the README table). Stable: codes are aggregated in stats and fed to models.
PROBLEM_CODES: dict[str, str] = {
    "syntax": "the module does not parse",
    "import_not_allowed": "an import outside the standard-library allow-list",
    "no_env_class": "no environment class is defined",
    "multiple_env_classes": "more than one top-level class",
    "top_level_code": "a top-level statement other than imports, constants, the class and helper functions",
    "forbidden_name": "use of a builtin that reaches outside the state (eval, exec, open, getattr, ...)",
    "dunder_access": "an attribute or string naming a dunder (__class__, __globals__, ...)",
    "module_attribute": "an attribute that reaches another module through a module (datetime.sys, uuid.os, ...)",
    "frame_access": "an attribute that reaches interpreter frames or code (gi_frame, f_back, tb_frame, ...)",
    "format_string_call": "str.format / format_map, which can reach attributes from a string",
    "match_class_pattern": "a `case Cls(attr=...)` pattern, which reads attributes without an attribute node",
    "metaclass": "a metaclass or class keyword",
    "init_arguments": "__init__ takes arguments; the runtime creates the environment with none",
    "reserved_tool_name": "a public method named like a runtime hook (reset, get_reward, close, step)",
    "variadic_parameters": "a tool with *args or **kwargs; tool parameters must be named",
    "missing_type_hint": "a tool parameter or return value without a type hint",
    "unsupported_type": "a tool parameter type that has no JSON schema (use str, int, float, bool, list, dict, "
    "Optional, Literal)",
    "missing_docstring": "a tool without a docstring",
    "undocumented_parameter": "a tool parameter missing from the docstring's Args section",
    "no_tools": "the class has no public methods",
    "async_tool": "an async tool; tools are plain synchronous methods",
    "clock_parameter": "a tool parameter that carries the current date or time (today, now, as_of): the "
    "environment reads its own clock",
}

FORBIDDEN_NAMES = frozenset(
    "eval exec compile open input breakpoint __import__ globals locals vars getattr setattr delattr "
    "memoryview help exit quit dir".split()
)
FRAME_ATTRIBUTES = frozenset(
    "gi_frame gi_code cr_frame cr_code ag_frame ag_code f_back f_globals f_locals f_builtins f_code "
    "tb_frame tb_next co_code func_globals mro".split()
)
MODULE_ATTRIBUTES = frozenset(
    "sys os builtins bltns subprocess socket importlib ctypes posix nt io shutil pathlib signal "
    "_os _sys _thread threading multiprocessing pickle marshal gc inspect types code codeop runpy".split()
)
# Which trust level the code is read under: `strict` refuses any problem, `import` only the STRUCTURAL ones.
Contract = Literal["strict", "import"]
CONTRACTS: tuple[Contract, ...] = ("strict", "import")
# Without a parsable class with public methods there is nothing to load, whoever wrote the module. (Several
# classes are fine under import: the environment is the last one, `signatures.environment_class`.)
STRUCTURAL = frozenset({"syntax", "no_env_class"})
DUNDER = re.compile(r"__\w+__")
RESERVED_TOOLS = frozenset({"reset", "get_reward", "close", "step"})
# A parameter through which the caller would say what time it is: the rules that depend on it ("a rescheduled date
# cannot be in the past") are then the caller's to bypass. A record's own dates (a booking's date) are not this.
_CLOCK_NAMES = re.compile(r"^(today|now|as_of|asof|as_of_(date|time|datetime))$|^(current|today|now)_\w+$")
_CLOCK_WORDS = re.compile(
    r"\b(current (date|time|day|datetime|timestamp)|today'?s date|the date of today|date of this action|"
    r"time of (this|the) action|when (this|the) action (happens|takes place|is performed)|as of)\b",
    re.IGNORECASE,
)
CLOCK_ADVICE = (
    "the environment has its own clock: read the current date-time with datetime.datetime.now() or "
    "datetime.date.today() inside the method (the sandbox sets it for each episode) and drop this parameter. "
    "A record's own dates (a booking's date, a due date) stay parameters."
)


def clock_parameter(name: str, description: str = "") -> bool:
    """Whether a tool parameter carries the current date or time (by its name, or its description)."""
    return bool(_CLOCK_NAMES.match(name.casefold()) or _CLOCK_WORDS.search(description or ""))


class Problem(BaseModel):
    """One contract violation: a stable `code`, the 1-based `line` (0: whole module) and an actionable message."""

    model_config = ConfigDict(frozen=True)

    code: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"line {self.line}: [{self.code}] {self.message}"


class ContractError(ItemError):
    """Generated code violates the environment contract; `problems` lists every violation."""

    reason = "contract_violation"

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("environment violates the contract:\n  " + "\n  ".join(map(str, problems)))
        self.problems = problems


def refused(problems: list[Problem], contract: Contract) -> list[Problem]:
    """The problems that refuse the module under `contract`: every one under strict, the STRUCTURAL ones under
    import (the others are information there)."""
    if contract not in CONTRACTS:
        raise ValueError(f"unknown contract {contract!r}; expected one of {', '.join(CONTRACTS)}")
    return list(problems) if contract == "strict" else [p for p in problems if p.code in STRUCTURAL]


def problem_counts(problems: list[Problem] | tuple[Problem, ...]) -> dict[str, int]:
    """How many problems of each code, by code: the counted warnings of an imported module."""
    return dict(sorted(Counter(p.code for p in problems).items()))


def lint(source: str) -> list[Problem]:
    """Every contract violation in `source`, sorted by line. An empty list means the module may be loaded."""
    try:
        tree = parse(source)
    except SyntaxError as error:
        return [Problem(code="syntax", line=error.lineno or 0, message=f"syntax error: {error.msg}")]
    problems = _module_problems(tree) + _expression_problems(tree)
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    env = classes[0] if len(classes) == 1 else environment_class(tree)
    if env is not None:
        problems += _class_problems(env)
    unique = {(p.line, p.code, p.message): p for p in problems}
    return [unique[key] for key in sorted(unique)]


def _module_problems(tree: ast.Module) -> list[Problem]:
    problems: list[Problem] = []
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    if not classes:
        problems.append(Problem(code="no_env_class", line=0, message="define exactly one environment class"))
    for extra in classes[1:]:
        problems.append(
            Problem(
                code="multiple_env_classes", line=extra.lineno,
                message=f"class {extra.name}: put everything in the single environment class {classes[0].name} "
                "(use dicts for records and _private methods for helpers)",
            )
        )  # fmt: skip
    for node in tree.body:
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]:
            continue  # module docstring
        if not isinstance(node, ast.Import | ast.ImportFrom | ast.ClassDef | ast.FunctionDef | ast.Assign
                          | ast.AnnAssign):  # fmt: skip
            problems.append(
                Problem(
                    code="top_level_code", line=node.lineno,
                    message=f"top-level {type(node).__name__} statement: move logic into the class's methods",
                )
            )  # fmt: skip
    return problems


def _class_problems(cls: ast.ClassDef) -> list[Problem]:
    """Contract problems of the environment class: constructor, tool names, hints, types, docstrings."""
    problems: list[Problem] = []
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            args = node.args
            if len(args.args) - len(args.defaults) > 1 or args.kwonlyargs and None in args.kw_defaults:
                problems.append(_problem("init_arguments", node, "__init__ must work with no arguments"))
    methods = tool_methods(cls)
    if not methods:
        problems.append(_problem("no_tools", cls, f"class {cls.name} has no public methods to serve as tools"))
    for method in methods:
        problems += _method_problems(method)
    return problems


def _method_problems(method: ast.FunctionDef | ast.AsyncFunctionDef) -> list[Problem]:
    name = method.name
    if isinstance(method, ast.AsyncFunctionDef):
        return [_problem("async_tool", method, f"{name}: make it a plain `def`")]
    if name in RESERVED_TOOLS:
        return [_problem("reserved_tool_name", method, f"{name} is reserved for the runtime; rename the tool")]
    problems = []
    if method.args.vararg or method.args.kwarg:
        problems.append(_problem("variadic_parameters", method, f"{name}: replace *args/**kwargs by named ones"))
    if method.returns is None:
        problems.append(_problem("missing_type_hint", method, f"{name}: add a return type hint"))
    docstring = ast.get_docstring(method)
    documented = parse_docstring(docstring or "").parameters
    if not docstring:
        problems.append(_problem("missing_docstring", method, f"{name}: add a docstring with Args and Returns"))
    for arg, _ in tool_parameters(method):
        where = f"{name}({arg.arg})"
        if arg.annotation is None:
            problems.append(_problem("missing_type_hint", arg, f"{where}: add a type hint"))
            continue
        try:
            annotation_schema(arg.annotation)
        except ValueError as error:
            problems.append(_problem("unsupported_type", arg, f"{where}: {error}"))
        if docstring and arg.arg not in documented:
            problems.append(_problem("undocumented_parameter", arg, f"{where}: describe it under Args:"))
        described = documented[arg.arg].description if arg.arg in documented else ""
        if clock_parameter(arg.arg, described):
            problems.append(_problem("clock_parameter", arg, f"{where}: {CLOCK_ADVICE}"))
    return problems


def _problem(code: str, node: ast.AST, message: str) -> Problem:
    return Problem(code=code, line=getattr(node, "lineno", 0), message=message)


def _import_problems(node: ast.Import | ast.ImportFrom) -> list[Problem]:
    if isinstance(node, ast.ImportFrom):
        names = [node.module or ""] if node.level == 0 else [""]
        imported = [f"{node.module}.{alias.name}" for alias in node.names]
    else:
        names = [alias.name for alias in node.names]
        imported = []
    problems = []
    for name in names:
        if name not in ALLOWED_MODULES:
            allowed = ", ".join(sorted(m for m in ALLOWED_MODULES if m != "__future__"))
            problems.append(
                Problem(
                    code="import_not_allowed", line=node.lineno,
                    message=f"import of {name or 'a relative module'!r} is not allowed; allowed: {allowed}",
                )
            )  # fmt: skip
    for full in imported:  # `from typing import sys` reaches a module through an allowed one
        if full.rsplit(".", 1)[1] in MODULE_ATTRIBUTES:
            problems.append(Problem(code="module_attribute", line=node.lineno, message=f"do not import {full}"))
    return problems


def _expression_problems(tree: ast.Module) -> list[Problem]:
    problems: list[Problem] = []
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            problems += _import_problems(node)
        elif isinstance(node, ast.Name) and _normal(node.id) in FORBIDDEN_NAMES:
            problems.append(Problem(code="forbidden_name", line=line, message=f"do not use {node.id}()"))
        elif isinstance(node, ast.Attribute):
            problems += _attribute_problems(node)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and DUNDER.search(node.value):
            problems.append(Problem(code="dunder_access", line=line, message="strings must not name dunder attributes"))
        elif isinstance(node, ast.MatchClass) and node.kwd_attrs:
            problems.append(Problem(code="match_class_pattern", line=line, message="use plain values in case patterns"))
        elif isinstance(node, ast.ClassDef) and node.keywords:
            problems.append(Problem(code="metaclass", line=line, message=f"class {node.name}: no class keywords"))
    return problems


def _attribute_problems(node: ast.Attribute) -> list[Problem]:
    name, line = _normal(node.attr), node.lineno
    if name.startswith("__") and name.endswith("__") and name not in ("__init__", "__name__"):
        return [Problem(code="dunder_access", line=line, message=f"do not access .{node.attr}")]
    if name in FRAME_ATTRIBUTES:
        return [Problem(code="frame_access", line=line, message=f"do not access .{node.attr}")]
    if name in MODULE_ATTRIBUTES:
        return [Problem(code="module_attribute", line=line, message=f"do not access .{node.attr}")]
    if name in ("format", "format_map"):
        return [Problem(code="format_string_call", line=line, message="use f-strings instead of .format()")]
    return []


def _normal(name: str) -> str:
    # The parser already NFKC-normalises identifiers (so `ｅｖａｌ` arrives as `eval`); normalise again for safety.
    return unicodedata.normalize("NFKC", name)
