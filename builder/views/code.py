"""What prompts show of an environment's code, read from the AST without running it: the rules (the module
docstring), the class header (the state definition), method sources with the private helpers they call, the
tools as a user of them sees them, and the environment's clock."""

from __future__ import annotations

import ast
import json
import textwrap
from collections.abc import Sequence

from builder.envs.graph import written_attributes
from builder.envs.signatures import environment_class
from builder.pyast import parse
from builder.records import Environment
from builder.sandbox.world import describe_now
from builder.views.budget import PromptBudget


def _env_class(code: str) -> ast.ClassDef:
    # An imported module may put helper classes first (BFCL's File and Directory): take the environment's.
    tree = parse(code)
    cls = environment_class(tree)
    return cls if cls is not None else next(node for node in tree.body if isinstance(node, ast.ClassDef))


def _methods(cls: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}


def environment_text(env_description: str, code: str) -> str:
    """What the environment is and the rules it enforces: the module docstring (the code stage writes the plan's
    description and numbered rules there), or the record's description when the module has no docstring."""
    return ast.get_docstring(parse(code)) or env_description


def environment_source(env: Environment) -> str:
    """The environment as the evaluate stage's test-state writer and checker start every request with it (the
    prefix a model server's cache computes once per environment): its description and its whole source."""
    return (
        f"Environment `{env.class_name}` ({env.domain}): {env.description}\n\n"
        f"Its source (the module docstring states the rules, `__init__` the state, each tool is the method of its "
        f"name):\n```python\n{env.code.strip()}\n```"
    )


def policy_text(code: str) -> str:
    """The environment's policy in plain language: the numbered rules of the module docstring (the code stage
    writes the plan's rules there under "Rules:"); "" when the module states none."""
    try:
        docstring = ast.get_docstring(parse(code)) or ""
    except SyntaxError:
        return ""
    _, found, rules = docstring.partition("Rules:")
    return rules.strip() if found else ""


def now_text(now: str) -> str:
    """The environment's date-time as prompts state it (with its weekday, so "tomorrow" comes out right)."""
    return f"{describe_now(now)} (the environment's clock reads this date-time)"


def class_header(code: str) -> str:
    """The class line, its docstring and `__init__`: the state definition the checker judges against."""
    cls = _env_class(code)
    lines = code.splitlines()
    init = _methods(cls).get("__init__")
    end = init.end_lineno if init is not None else cls.body[0].end_lineno
    start = min([cls.lineno] + [d.lineno for d in cls.decorator_list])
    return "\n".join(lines[start - 1 : end])  # the class is top-level, so no dedent is needed


def method_nodes(code: str, name: str) -> list[ast.FunctionDef]:
    """Method `name` followed by the private helpers it calls directly (`self._helper(...)`).

    Raises KeyError when the class has no such method (StopIteration when the module has no class)."""
    methods = _methods(_env_class(code))
    method = methods[name]
    return [method] + [methods[helper] for helper in _called_helpers(method) if helper in methods]


def method_source(code: str, name: str) -> str:
    """The source of method `name`, followed by the private helpers it calls directly (`self._helper(...)`)."""
    lines = code.splitlines()
    return "\n\n".join(textwrap.dedent("\n".join(lines[n.lineno - 1 : n.end_lineno])) for n in method_nodes(code, name))


def _called_helpers(method: ast.FunctionDef) -> list[str]:
    names = []
    for node in ast.walk(method):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            target = node.func
            if isinstance(target.value, ast.Name) and target.value.id == "self" and target.attr.startswith("_"):
                names.append(target.attr)
    return list(dict.fromkeys(names))


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]} … ({len(text) - limit} more characters cut)"


def interface_text(env: Environment, budget: PromptBudget) -> str:
    """The environment as a user of its tools sees it: description, class header (rules, state) and tool schemas."""
    try:
        header = class_header(env.code)
    except (StopIteration, SyntaxError, IndexError):  # an accepted environment has a class; be safe anyway
        header = ""
    tools = json.dumps([tool["function"] for tool in env.tools], ensure_ascii=False)
    return (
        f"# Environment {env.name} ({env.domain})\n{environment_text(env.description, env.code)}\n\n"
        f"## Class header (state)\n```python\n{_clip(header, budget.header_chars)}\n```\n\n"
        f"## Tools\n{tools}"
    )


def writes_state(method: ast.FunctionDef) -> bool:
    """Whether `method` may change the state (the tool graph's rule: `builder.envs.graph.written_attributes`)."""
    return bool(written_attributes(method))


def writer_sources(code: str, names: Sequence[str], budget: PromptBudget) -> str:
    """The sources (with their helpers) of the distinct methods in `names` that change the state: the first
    `budget.methods` of them in call order, shown in the class's order (two requests whose solutions call the
    same methods in another order then start alike, which a model server's prefix cache reuses)."""
    writers = []
    for name in dict.fromkeys(names):
        try:
            nodes = method_nodes(code, name)
        except (KeyError, StopIteration, SyntaxError):  # not a method of the class (or no class to read)
            continue
        if any(writes_state(node) for node in nodes):
            writers.append(name)
    order = {name: position for position, name in enumerate(_methods(_env_class(code)))}
    shown = sorted(writers[: budget.methods], key=lambda name: order.get(name, len(order)))
    return "\n\n".join(method_source(code, name) for name in shown)
