"""`import classes` on modules shaped like BFCL's real multi-turn classes: constants imported from a sibling module
(by the installed package path and by a relative import) are inlined; a seeded `self._random` is left out of the
state under the import contract only; a refused import names the module and what to do. Real CLI, executor,
sandbox and store; fixtures in tests/fixtures/bfcl/siblings/ (written for these tests, in BFCL's style).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from builder.cli import main
from builder.config import SandboxConfig
from builder.envs.session import Session, SessionError
from builder.sandbox.runtime import Sandbox
from builder.stages.imports.siblings import MARK, inline_siblings, inlined_imports
from builder.stages.imports.sources import read_classes
from builder.store import Store

SIBLINGS = Path(__file__).parent / "fixtures" / "bfcl" / "siblings"


pytestmark = pytest.mark.usefixtures("restore_logging")  # `main` adds handlers to the builder logger


def run_import(root: Path, *paths: Path) -> dict:
    overrides = {"store.path": root / "store", "sandbox.call_timeout_s": 2, "llm.url": "http://agent.invalid/v1"}
    options = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    args = ["import", "classes", *map(str, paths), "--profile", "none", "--run-dir", str(root / "run")]
    assert main([*args, *options, "--until", "vet"]) == 0
    return json.loads((root / "run" / "audit.json").read_text())


def test_sibling_imports_are_inlined_and_private_non_json_state_is_left_out(tmp_path):
    audit = run_import(tmp_path, SIBLINGS / "travel_api.py", SIBLINGS / "greeter_api.py")
    assert audit["environments"]["accepted"] == 2, audit
    envs = {env.class_name: env for env in Store(tmp_path / "store").environments()}
    travel, greeter = envs["TravelAPI"], envs["GreeterAPI"]
    assert "bfcl_eval" not in travel.code and ".long_context" not in greeter.code
    assert f"{MARK} long_context.py: EXTRA_CITIES, FARE_TABLE" in travel.code
    assert "_BASE_CITIES = " in travel.code  # what EXTRA_CITIES is built from comes along
    assert "UNUSED_NOTES" not in travel.code and "FARE_TABLE" not in greeter.code  # only what is imported
    assert audit["inlined_sibling_imports"]["count"] == 2
    assert {"module": "long_context.py", "names": ["WELCOME_TEXT"]}.items() <= next(
        item for item in audit["inlined_sibling_imports"]["items"] if item["env"].endswith("greeter_api.py")
    ).items()
    assert audit["private_state_omitted"]["count"] == 1
    assert audit["private_state_omitted"]["items"][0]["attributes"] == ["_random"]
    with Sandbox(SandboxConfig()) as sandbox:
        with Session(sandbox, travel.code, contract="import") as session:
            assert session.call("list_cities").result == {"cities": ["Lisbon", "Porto", "Faro", "Braga"]}
            booked = session.call("book_trip", {"origin": "Lisbon", "destination": "Porto"}).result
            state = session.snapshot()
            assert "_random" not in state and session.omitted == {"_random"}
            assert state["bookings"][booked["booking_id"]]["fare"] == "35.5"
        with Session(sandbox, travel.code, contract="import") as again:  # seeded: the same id in a fresh worker
            assert again.call("book_trip", {"origin": "Lisbon", "destination": "Porto"}).result == booked
        with Session(sandbox, greeter.code, contract="import") as session:
            assert session.call("greet", {"name": "Ana"}).result["text"].startswith("Ana: Welcome aboard.\n")


def test_the_strict_contract_still_refuses_a_private_attribute_that_is_not_json():
    strict = "class Strict:\n    def __init__(self):\n        import random\n        self._random = random.Random(1)\n"
    strict += '\n    def ping(self) -> dict:\n        """Ping."""\n        return {}\n'
    with Sandbox(SandboxConfig()) as sandbox:
        with Session(sandbox, strict, contract="strict") as session, pytest.raises(SessionError) as error:
            session.snapshot()
        assert error.value.kind == "state_not_json" and "'_random'" in str(error.value)
        with Session(sandbox, strict, contract="import") as session:
            assert session.snapshot() == {} and session.omitted == {"_random"}


def test_a_public_attribute_that_is_not_json_still_fails_under_import():
    code = (
        "import random\n\nclass Api:\n    def __init__(self):\n        self.ids = set()\n"
        "        self._random = random.Random(3)\n\n    def ping(self) -> dict:\n        return {}\n"
    )
    with Sandbox(SandboxConfig()) as sandbox, Session(sandbox, code, contract="import") as session:
        with pytest.raises(SessionError) as error:
            session.snapshot()
    assert error.value.kind == "state_not_json" and "'ids'" in str(error.value)


def test_an_unresolvable_sibling_import_is_left_for_the_sandbox_to_report(tmp_path):
    shutil.copy(SIBLINGS / "long_context.py", tmp_path / "long_context.py")
    module = tmp_path / "api.py"
    module.write_text(
        "from pkg.long_context import NOT_THERE\nfrom pkg.elsewhere import X\n\n\nclass Api:\n"
        "    def ping(self) -> dict:\n        return {'x': NOT_THERE}\n"
    )
    code, read = inline_siblings(module.read_text(), module)
    assert code == module.read_text() and read == () and inlined_imports(code) == ()
    audit = run_import(tmp_path / "out", module)
    assert audit["environments"]["accepted"] == 0
    assert "No module named 'pkg'" in audit["not_loading"]["items"][0]["message"]


def test_star_imports_and_the_revision_follow_the_sibling(tmp_path):
    for name in ("long_context.py", "greeter_api.py"):
        shutil.copy(SIBLINGS / name, tmp_path / name)
    module = tmp_path / "api.py"
    module.write_text("from .long_context import *\n\n\nclass Api:\n    def ping(self) -> dict:\n        return {}\n")
    code, read = inline_siblings(module.read_text(), module)
    assert read == (tmp_path / "long_context.py",)
    assert inlined_imports(code)[0].names == ("EXTRA_CITIES", "FARE_TABLE", "WELCOME_TEXT", "UNUSED_NOTES")
    compile(code, "api.py", "exec")
    before = read_classes([str(tmp_path / "greeter_api.py")]).revision
    (tmp_path / "long_context.py").write_text((tmp_path / "long_context.py").read_text() + "\nMORE = 1\n")
    assert read_classes([str(tmp_path / "greeter_api.py")]).revision != before  # the sibling's bytes are pinned


def test_a_refused_import_names_the_module_and_what_to_do(tmp_path):
    module = tmp_path / "shell_api.py"
    module.write_text("import subprocess\n\n\nclass ShellAPI:\n    def ls(self) -> dict:\n        return {}\n")
    audit = run_import(tmp_path / "out", module)
    entry = audit["not_loading"]["items"][0]
    assert entry["refused_module"] == "subprocess"
    assert "remove the import of 'subprocess'" in entry["fix"] and "builder/sandbox/allowed.py" in entry["fix"]
