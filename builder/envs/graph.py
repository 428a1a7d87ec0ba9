"""The tool dependency graph of an environment: which tools feed which, by data and by state.

Nodes are tools, with the state attributes each reads and writes (read from the AST: the method and the private
helpers it calls). Edges are typed:

- `data`: a field of one tool's result carries a value another tool takes as a parameter (an id, a name, a date).
  Found by execution in the sandbox: the producing tool is called on the state, and the consuming tool is called
  with that value and, as a control, with an invented one; the edge exists when the real value is accepted and the
  invented one is not. A value every tool accepts (free text) links nothing.
- `state`: one tool writes an attribute another reads (from the code alone).

Environment code only runs in sandbox sessions; this module parses it and reads JSON results.
"""

from __future__ import annotations

import ast
from typing import Any

from builder.envs.lint import Contract
from builder.envs.probe import generate_arguments
from builder.envs.schema import inspect_source
from builder.envs.session import Session, SessionError, ToolResult
from builder.envs.signatures import environment_class, tool_methods
from builder.evidence import Edge, ToolGraph, ToolNode
from builder.pyast import parse
from builder.sandbox.runtime import Sandbox
from builder.sandbox.world import DEFAULT_NOW, DEFAULT_SEED

# Method calls that change the object they are called on (a list, dict or set of the state).
MUTATORS = frozenset(
    {"append", "extend", "insert", "remove", "pop", "popitem", "clear", "update", "setdefault", "add", "discard",
     "sort", "reverse", "__setitem__", "__delitem__"}
)  # fmt: skip
MAX_PROBES = 300  # consumer calls one extraction may make; beyond it the graph is marked truncated
_INVENTED = {"string": "no-such-value-0000", "integer": -987654321}  # the control value of a parameter


# ------------------------------------------------------------------------------------------ state access


def state_access(code: str) -> dict[str, tuple[tuple[str, ...], tuple[str, ...]]]:
    """Each tool of the environment class -> (attributes it reads, attributes it may write), sorted.

    A write is an assignment into (or a mutating call on) `self.<attr>` or a local name bound to part of it
    (`account = self.accounts[i]; account["balance"] -= x`): a heuristic that errs on yes. Private helpers the
    tool calls (`self._helper()`, transitively) count as the tool's own code.
    """
    cls = environment_class(parse(code))
    if cls is None:
        return {}
    methods = {node.name: node for node in cls.body if isinstance(node, ast.FunctionDef)}
    access = {}
    for tool in tool_methods(cls):
        reads: list[str] = []
        writes: list[str] = []
        for method in _with_helpers(tool, methods):
            reads += [a for a in _self_attributes(method) if a not in methods]
            writes += [a for a in written_attributes(method) if a not in methods]
        access[tool.name] = (tuple(sorted(set(reads + writes))), tuple(sorted(set(writes))))
    return access


def _with_helpers(method: ast.AST, methods: dict[str, ast.FunctionDef]) -> list[ast.AST]:
    found, queue = [method], [method]
    while queue:
        for node in ast.walk(queue.pop()):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and _is_self(node.func.value):
                helper = methods.get(node.func.attr)
                if node.func.attr.startswith("_") and helper is not None and helper not in found:
                    found.append(helper)
                    queue.append(helper)
    return found


def _is_self(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "self"


def _self_attributes(node: ast.AST) -> list[str]:
    return [n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute) and _is_self(n.value)]


def _root(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The state attribute `node` reaches into (`self.a[x]["b"]` -> a; an alias of part of `a` -> a)."""
    while isinstance(node, ast.Attribute | ast.Subscript):
        if isinstance(node, ast.Attribute) and _is_self(node.value):
            return node.attr
        node = node.value
    return aliases.get(node.id) if isinstance(node, ast.Name) else None


def written_attributes(method: ast.AST) -> list[str]:
    """The state attributes `method` assigns into or mutates: through `self.<attr>`, or a local name bound to part
    of the state (`account = self.accounts[i]; account["balance"] -= x`)."""
    aliases: dict[str, str] = {}
    for node in ast.walk(method):
        if isinstance(node, ast.Assign | ast.For) and (found := _self_attributes(_bound_from(node))):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            aliases.update({t.id: found[0] for t in targets if isinstance(t, ast.Name)})
    written = []
    for node in ast.walk(method):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign | ast.Delete):
            targets = list(node.targets)
        elif isinstance(node, ast.AugAssign | ast.AnnAssign):
            targets = [node.target]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in MUTATORS:
            if (root := _root(node.func.value, aliases)) is not None:
                written.append(root)
        written += [root for t in targets if not isinstance(t, ast.Name) and (root := _root(t, aliases))]
    return written


def _bound_from(node: ast.Assign | ast.For) -> ast.expr:
    return node.value if isinstance(node, ast.Assign) else node.iter


# ------------------------------------------------------------------------------------------------ graph


def extract_graph(
    sandbox: Sandbox, code: str, state: dict[str, Any] | None = None,
    *, now: str = DEFAULT_NOW, seed: int = DEFAULT_SEED, max_probes: int = MAX_PROBES,
    contract: Contract = "strict",
) -> ToolGraph:  # fmt: skip
    """The dependency graph of `code` from `state` (default: what `__init__` builds) at `now` and `seed`.

    Raises ContractError (the code violates `contract`) or SessionError (it does not load).
    """
    interface = inspect_source(code, contract)
    access = state_access(code)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in interface.tools}
    nodes = tuple(
        ToolNode(
            name=name, parameters=tuple(schemas[name]["properties"]), reads=access[name][0], writes=access[name][1]
        )
        for name in schemas
    )
    with Session(sandbox, code, state, interface=interface, now=now, seed=seed) as session:
        initial = session.snapshot()
    prober = _Prober(sandbox, code, initial, interface, now, seed, max_probes)
    produced = {name: prober.produce(name) for name in schemas}
    edges = []
    for target, parameters in schemas.items():
        for parameter, schema in parameters["properties"].items():
            kind = _scalar_kind(schema)
            if kind is None:
                continue
            for source, fields in produced.items():
                for field, value in fields.items():
                    if source == target or not _fits(value, kind) or not _may_name(field, parameter, value):
                        continue
                    if prober.accepts(target, parameter, value, kind):
                        edges.append(Edge(kind="data", source=source, target=target, output=field, input=parameter,
                                          example=value))  # fmt: skip
    for writer in nodes:
        for reader in nodes:
            for attribute in writer.writes:
                if reader.name != writer.name and attribute in reader.reads:
                    edges.append(Edge(kind="state", source=writer.name, target=reader.name, output=attribute,
                                      input=attribute))  # fmt: skip
    return ToolGraph(nodes=nodes, edges=tuple(edges), truncated=prober.truncated)


class _Prober:
    """Tool calls in fresh sessions from one state, each consumer probe once, within a budget."""

    def __init__(self, sandbox, code, state, interface, now, seed, budget) -> None:  # noqa: ANN001
        self.sandbox, self.code, self.state, self.interface = sandbox, code, state, interface
        self.now, self.seed, self.budget = now, seed, budget
        self.schemas = {t["function"]["name"]: t["function"]["parameters"] for t in interface.tools}
        self.truncated = False
        self._answers: dict[tuple[str, str, str], bool] = {}

    def call(self, name: str, arguments: dict[str, Any]) -> ToolResult | None:
        try:
            with Session(self.sandbox, self.code, self.state, self.interface, now=self.now, seed=self.seed) as s:
                return s.call(name, arguments)
        except SessionError:
            return None

    def produce(self, tool: str) -> dict[str, Any]:
        """The field values of `tool`'s successful results, over a few argument sets drawn from the state."""
        fields: dict[str, Any] = {}
        for arguments in argument_sets(self.schemas[tool], self.state):
            if self.budget <= 0:
                self.truncated = True
                break
            self.budget -= 1
            fields = _fields(self.call(tool, arguments)) | fields
        return fields

    def accepts(self, tool: str, parameter: str, value: Any, kind: str) -> bool:
        """Whether `tool` answers `value` for `parameter` and refuses an invented value there."""
        return self._succeeds(tool, parameter, value) and not self._succeeds(tool, parameter, _INVENTED[kind])

    def _succeeds(self, tool: str, parameter: str, value: Any) -> bool:
        key = (tool, parameter, repr(value))
        if key not in self._answers:
            if self.budget <= 0:
                self.truncated = True
                return False
            self.budget -= 1
            arguments = argument_sets(self.schemas[tool], self.state)[0] | {parameter: value}
            self._answers[key] = succeeded(self.call(tool, arguments))
        return self._answers[key]


# ------------------------------------------------------------------------------------- values from state


def state_values(parameter: str, schema: dict[str, Any], state: dict[str, Any]) -> list[Any]:
    """Values for `parameter` found in `state`, most likely first: the keys (or record ids) of collections its
    name or description names (`account_id`, "Account to debit." -> accounts), then the values of fields named
    like it; for a string with neither, every collection key and string in the state. Enums give their values."""
    if "enum" in schema:
        return list(schema["enum"])
    kind = _scalar_kind(schema)
    words = f"{parameter} {schema.get('description', '')}".casefold()
    related: list[Any] = []
    for name, value in state.items():
        stem = name.casefold().removesuffix("s")
        if len(stem) > 2 and stem in words:
            related += _record_ids(value)
    related += [v for v in _named_leaves(state, parameter)]
    if kind == "string" and not related:
        related = [key for value in state.values() for key in _record_ids(value)]
        related += [leaf for leaf in _named_leaves(state, None) if isinstance(leaf, str)]
    fitting = [v for v in related if kind is None or _fits(v, kind)]
    return list(dict.fromkeys(fitting))


def argument_sets(parameters: dict[str, Any], state: dict[str, Any], count: int = 4) -> list[dict[str, Any]]:
    """Up to `count` argument sets for a tool: the first uses each parameter's most likely state value (the
    probe's generated value where the state has none), the others the next values, parameter by parameter."""
    base = generate_arguments(parameters, state)
    pools = {}
    for name in parameters.get("required", []):
        pool = state_values(name, parameters["properties"][name], state)
        if pool:
            base[name] = pool[0]
            pools[name] = pool
    sets = [base]
    for depth in range(1, count):
        variant = {name: pool[depth % len(pool)] for name, pool in pools.items()}
        if base | variant not in sets:
            sets.append(base | variant)
    return sets


def _record_ids(value: Any) -> list[Any]:
    """The keys of a map of records, or the `id` fields of a list of records."""
    if isinstance(value, dict) and value and all(isinstance(v, dict) for v in value.values()):
        return list(value)
    if isinstance(value, list):
        return [r["id"] for r in value if isinstance(r, dict) and isinstance(r.get("id"), str | int)]
    return []


def _named_leaves(value: Any, name: str | None) -> list[Any]:
    """The scalar values of every field called `name` (every field when None) inside `value`."""
    found = []
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(item, dict | list) and (name is None or key == name):
                found.append(item)
            found += _named_leaves(item, name)
    elif isinstance(value, list):
        for item in value:
            found += _named_leaves(item, name)
    return found


def succeeded(result: ToolResult | None) -> bool:
    """The call answered without an error and without a domain refusal (`{"success": false}` or an `error`)."""
    if result is None or not result.ok:
        return False
    value = result.result
    return not (isinstance(value, dict) and (value.get("success") is False or "error" in value))


def _fields(result: ToolResult | None) -> dict[str, Any]:
    """The first string or integer value at each field path of a successful result."""
    found: dict[str, Any] = {}
    if succeeded(result):
        _collect(result.result, "", found)  # type: ignore[union-attr]
    return found


def _collect(value: Any, path: str, found: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            _collect(item, f"{path}.{key}" if path else str(key), found)
    elif isinstance(value, list):
        for item in value:
            _collect(item, f"{path}[]", found)
    elif isinstance(value, str | int) and not isinstance(value, bool) and path not in found:
        found[path] = value


def _scalar_kind(schema: dict[str, Any]) -> str | None:
    """`string` or `integer` for a parameter a value can name something through (not an enum, not a flag)."""
    if "enum" in schema:
        return None
    kinds = schema.get("type")
    if kinds is None and "anyOf" in schema:
        kinds = [option.get("type") for option in schema["anyOf"]]
    kinds = kinds if isinstance(kinds, list) else [kinds]
    return next((kind for kind in ("string", "integer") if kind in kinds), None)


def _may_name(field: str, parameter: str, value: Any) -> bool:
    """Whether a result value can be what a parameter names: any string; a number only from a field named like
    the parameter or like an id (a count or an amount that happens to be valid links nothing)."""
    if isinstance(value, str):
        return True
    last = field.rsplit(".", 1)[-1].removesuffix("[]")
    return last == parameter or last == "id" or last.endswith("_id")


def _fits(value: Any, kind: str) -> bool:
    if kind == "string":
        return isinstance(value, str) and 0 < len(value) <= 200
    return isinstance(value, int) and not isinstance(value, bool)
