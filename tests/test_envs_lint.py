"""The contract lint: one failing fixture per problem code, clean fixtures pass, the §2 escape corpus is rejected."""

from pathlib import Path

import pytest

from builder.envs.lint import PROBLEM_CODES, lint

FIXTURES = Path(__file__).parent / "fixtures" / "envs"

TOOL = '''
    def ping(self, text: str) -> str:
        """Echo.

        Args:
            text: What to echo.

        Returns:
            The text.
        """
        return text
'''


def env(body: str = "", header: str = "") -> str:
    return f"{header}\nclass E:\n    def __init__(self):\n        self.x = 1\n{TOOL}{body}"


BROKEN = {
    "syntax": "class E(:\n",
    "import_not_allowed": env(header="import os"),
    "no_env_class": "x = 1\n",
    "multiple_env_classes": env() + "\nclass F:\n    pass\n",
    "top_level_code": env() + "\nprint('hi')\n",
    "forbidden_name": env("    def _h(self):\n        return eval('1')\n"),
    "dunder_access": env("    def _h(self):\n        return ().__class__\n"),
    "module_attribute": env("    def _h(self):\n        return datetime.sys\n", header="import datetime"),
    "frame_access": env("    def _h(self):\n        return (x for x in []).gi_frame\n"),
    "format_string_call": env("    def _h(self):\n        return '{0}'.format(1)\n"),
    "match_class_pattern": env(
        "    def _h(self, v):\n        match v:\n            case object(real=r):\n                return r\n"
    ),
    "metaclass": "import abc\nclass E(metaclass=abc.ABCMeta):\n" + TOOL,
    "init_arguments": "class E:\n    def __init__(self, db):\n        self.db = db\n" + TOOL,
    "reserved_tool_name": env(TOOL.replace("def ping", "def reset")),
    "variadic_parameters": env(TOOL.replace("text: str)", "text: str, *rest: str)").replace("ping", "p2")),
    "missing_type_hint": env(TOOL.replace("text: str", "text").replace("ping", "p2")),
    "unsupported_type": env(TOOL.replace("text: str", "text: set").replace("ping", "p2")),
    "missing_docstring": env("    def p2(self, a: int) -> int:\n        return a\n"),
    "undocumented_parameter": env(TOOL.replace("text: str)", "text: str, n: int)").replace("ping", "p2")),
    "no_tools": "class E:\n    def _only(self):\n        return 1\n",
    "async_tool": env(TOOL.replace("def ping", "async def p2")),
    "clock_parameter": env(
        TOOL.replace("text: str)", "text: str, today: str)")
        .replace("ping", "p2")
        .replace("            text: What to echo.", "            text: What to echo.\n            today: Today's date.")
    ),
}


def test_every_code_has_a_failing_fixture():
    assert set(BROKEN) == set(PROBLEM_CODES)


@pytest.mark.parametrize("code", sorted(BROKEN))
def test_each_code_is_reported_with_a_line_and_a_message(code):
    problems = lint(BROKEN[code])
    assert code in {p.code for p in problems}, problems
    problem = next(p for p in problems if p.code == code)
    assert problem.line >= 0 and len(problem.message) > 10


@pytest.mark.parametrize("name", ["bank.py", "library.py", "counter.py"])
def test_fixture_environments_are_clean(name):
    assert lint((FIXTURES / name).read_text()) == []


ESCAPES = [  # notes/sandbox.md §2: each escapes plain exec; the lint must reject all of them
    "__import__('os')",
    "().__class__.__base__.__subclasses__()",
    "datetime.sys.modules['os']",
    "enum.bltns.open('/etc/passwd')",
    "uuid.os.popen('id')",
    "'{0.__class__}'.format(())",
    "string.Formatter().get_field('0.__class__', [()], {})",
    "(lambda: (yield))().gi_frame.f_back.f_globals",
    "functools.reduce(getattr, ['__class__'], ())",
    "operator.attrgetter('__class__.__base__')(())",
    "ｅｖａｌ('1+1')",
    "e.__traceback__.tb_frame.f_globals",
]


@pytest.mark.parametrize("payload", ESCAPES)
def test_known_escapes_are_rejected(payload):
    source = env(
        f"    def _h(self, e):\n        return {payload}\n",
        header="import datetime, enum, uuid, string, functools, operator",
    )
    assert lint(source), payload


def test_from_typing_import_sys_is_rejected():
    assert "module_attribute" in {p.code for p in lint(env(header="from typing import sys"))}


def test_a_records_own_date_is_no_clock_parameter():
    documented = "            text: What to echo.\n            due: When it is due, YYYY-MM-DD."
    tool = TOOL.replace("text: str)", "text: str, due: str)").replace("ping", "p2")
    due = env(tool.replace("            text: What to echo.", documented))
    assert "clock_parameter" not in {p.code for p in lint(due)}
