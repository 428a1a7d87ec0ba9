"""builder parses Python only through `builder.pyast.parse` (one lock; see that module for the CPython race)."""

import ast
import re
from pathlib import Path

import builder
from builder.pyast import parse

PACKAGE = Path(builder.__file__).parent


def test_no_module_calls_ast_parse_directly():
    direct = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "pyast.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bast\.parse\(|PyCF_ONLY_AST", line)
    ]
    assert direct == [], "parse with builder.pyast.parse, which other threads cannot race"


def test_parse_is_ast_parse():
    assert ast.dump(parse("x = f(1)")) == ast.dump(ast.parse("x = f(1)"))
    assert isinstance(parse("a + 1", mode="eval"), ast.Expression)
