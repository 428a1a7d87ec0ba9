"""Fitting code written elsewhere to builder's runtime conventions, as visible source text (never as hidden
runtime switches), so the published module is exactly what runs.

- The runtime creates an environment with no arguments and then sets the state attributes (the environment
  contract, builder/envs/lint.py).
  EnvScaler's classes take `__init__(self, init_config)`; the adapter gives them an empty config, which is what
  EnvScaler itself passes for an empty config before it sets every attribute the same way.
- A default state file is applied at the end of construction, so every later stage (gates, scenario
  generation, rollouts) sees it as the state `__init__` builds.
- EnvScaler's `check_func(final_state)` reads the initial state from a global its runtime injects; the adapter
  is a `check(initial_state, final_state)` that sets that global and calls it, so it runs in the check sandbox
  like every other check.
"""

from __future__ import annotations

import ast
import json
from typing import Any

from builder.pyast import parse

MARK = "# --- added by `python -m builder import`"

_INIT = """

{mark}: the runtime creates {cls} with no arguments, then sets its state
{imports}_builder_imported_init = {cls}.__init__


def _builder_init(self):
{body}


{cls}.__init__ = _builder_init
"""

_CHECK = """{code}


{mark}: EnvScaler's runtime gives check_func the initial state as a global
def check(_builder_initial_state, final_state):
    global initial_state
    initial_state = _builder_initial_state
    return check_func(final_state)
"""


def adapted_code(code: str, class_name: str, default_state: dict[str, Any] | None) -> str:
    """`code` with the constructor adapter appended when the class needs one (else `code` unchanged)."""
    needs_config = _init_arguments(code, class_name) > 0
    if not needs_config and not default_state:
        return code
    body = ["    _builder_imported_init(self, {})" if needs_config else "    _builder_imported_init(self)"]
    if default_state:
        text = json.dumps(default_state, ensure_ascii=False, sort_keys=True)
        body += [
            f"    for _key, _value in _builder_json.loads({text!r}).items():",
            "        setattr(self, _key, _value)",
        ]
    imports = "import json as _builder_json\n\n" if default_state else ""
    return code.rstrip() + "\n" + _INIT.format(mark=MARK, cls=class_name, body="\n".join(body), imports=imports)


def _init_arguments(code: str, class_name: str) -> int:
    """Required positional parameters of the class's own `__init__` after `self` (0: none or no such method)."""
    try:
        tree = parse(code)
    except SyntaxError:
        return 0
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    positional = item.args.posonlyargs + item.args.args
                    return max(0, len(positional) - 1 - len(item.args.defaults))
    return 0


def adapted_check(check_func: str) -> str:
    """An EnvScaler check function as a builder check (`check(initial_state, final_state) -> bool`)."""
    return _CHECK.format(code=check_func.strip(), mark=MARK)


def check_problem(check_func: str) -> str | None:
    """Why an EnvScaler check function cannot be run at all (None: it parses and defines `check_func`)."""
    try:
        tree = parse(check_func)
    except SyntaxError as error:
        return f"syntax error: {error.msg} (line {error.lineno})"
    if not any(isinstance(node, ast.FunctionDef) and node.name == "check_func" for node in tree.body):
        return "defines no top-level check_func"
    return None
