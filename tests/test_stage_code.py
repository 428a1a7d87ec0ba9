import ast
import asyncio
import json
from pathlib import Path

import polars as pl
import pytest

from builder.config import SandboxConfig, load_config
from builder.envs.lint import lint
from builder.envs.schema import inspect_source
from builder.llm import ChatRequest, LLMRequestError, ScriptedModel, text_reply
from builder.llm.connect import client_for
from builder.records import Environment, EnvPlan, Topic
from builder.run.executor import run_stages
from builder.run.stage import BatchStage, ItemStage, Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.code import code, regenerate
from builder.stages.code.assembly import (
    assemble,
    missing_imports,
    schema_problems,
    split_module,
    state_schema,
    unbound_names,
)
from builder.stages.code.pieces import Piece, PieceError, extract_code, method_piece, signature, state_piece
from builder.stages.plan import plan
from builder.stages.plan.rules import (
    OperationsDraft,
    StateDraft,
    clean_operations,
    clean_state,
    entity_plans,
    operation_plans,
)
from builder.stats import StageStats

FIXTURES = Path(__file__).parent / "fixtures" / "synthesis"
CODE = {path.stem: path.read_text() for path in (FIXTURES / "library_code").glob("*.txt")}
OPERATION_NAMES = ["get_book", "list_member_loans", "borrow_book", "return_book", "find_books", "find_members"]


def library_plan() -> EnvPlan:
    state = clean_state(StateDraft.model_validate_json((FIXTURES / "library_state.json").read_text()), "library_loans")
    entities = entity_plans(state)
    drafts = OperationsDraft.model_validate_json((FIXTURES / "library_operations.json").read_text())
    return EnvPlan(
        provenance={"config_hash": "hash", "parent_ids": ["topic-1"]},
        topic_id="topic-1",
        name="library_loans",
        domain="library",
        class_name=state.class_name,
        description=state.description,
        entities=tuple(entities),
        rules=tuple(state.rules),
        operations=tuple(operation_plans(clean_operations(drafts, entities))),
    )


def piece_of(request: ChatRequest) -> str:
    """Which piece a code request asks for: an operation name, or __init__ for the state piece."""
    text = request.messages[1].content
    return next((name for name in OPERATION_NAMES if f"Write the method {name}," in text), "__init__")


def scripted(overrides=None):
    """Answers each piece from the fixtures; `overrides[piece]` is a list of replies used first, in order."""
    queues = {key: list(replies) for key, replies in (overrides or {}).items()}

    def answer(request: ChatRequest):
        key = piece_of(request)
        if queues.get(key):
            return queues[key].pop(0)
        return CODE[key]

    return ScriptedModel(answer)


def context(tmp_path, model, *overrides, sandbox=None):
    """A code-stage context; without `sandbox` the load check is off (most tests need no sandbox worker)."""
    config = load_config(None, [*([] if sandbox else ["code.load_check=false"]), *overrides])
    llm = client_for(config.llm, model, model_id="m")
    return StageContext(
        config, "hash", tmp_path, StageStats("code"), llm=llm, open_sandbox=sandbox and (lambda: sandbox)
    )


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig()) as runtime:
        yield runtime


def requests_for(model, key):
    return [r for r in model.requests if piece_of(r) == key]


async def test_plan_becomes_a_candidate_environment_that_passes_the_lint(tmp_path):
    the_plan = library_plan()
    model = scripted()
    (env,) = await code(the_plan, context(tmp_path, model))
    assert isinstance(env, Environment) and env.status == "candidate"
    assert lint(env.code) == []
    assert inspect_source(env.code).class_name == "LibraryLoansEnv"
    assert [tool["function"]["name"] for tool in env.tools] == OPERATION_NAMES
    for tool, op in zip(env.tools, the_plan.operations, strict=True):
        assert schema_problems(tool, op) == []
    assert (env.plan_id, env.name, env.domain) == (the_plan.id, "library_loans", "library")
    assert env.state_schema == state_schema(the_plan)
    assert sorted(env.state_schema["properties"]) == ["books", "loans", "members"]
    assert env.provenance.parent_ids == (the_plan.id, "topic-1")
    assert env.provenance.prompt_version.startswith("code_state@")
    assert env.provenance.model == "m"
    assert len(model.requests) == 7  # one state piece and one method per operation
    assert {r.sampling.max_tokens for r in model.requests} == {3072}  # code.max_tokens, not capped by llm.max_tokens
    assert env.synthesis.added_imports == ("from typing import Optional", "import datetime")
    assert env.synthesis.fixes["list_member_loans"] == env.synthesis.fixes["find_members"] == ("stripped_fences",)
    assert env.synthesis.regenerated == {}
    # The method request carries the exact header the plan implies.
    borrow = requests_for(model, "borrow_book")[0].messages[1].content
    assert signature(the_plan.operations[2]) in borrow
    assert "def borrow_book(self, member_id: str, book_id: str, due: str) -> dict:" in borrow


async def test_code_that_does_not_parse_is_regenerated_with_the_error(tmp_path):
    broken = "def get_book(self, book_id: str) -> dict:\n    return {'success': True\n"
    model = scripted({"get_book": [broken]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    assert lint(env.code) == []
    again = requests_for(model, "get_book")
    assert len(again) == 2 and len(model.requests) == 8  # only the failing piece is asked again
    assert again[1].messages[-2].content == broken.strip()
    assert "[syntax]" in again[1].messages[-1].content
    assert [r.sample_index for r in again] == [0, 1]  # a fresh sample: never the cached reply to the same request
    assert env.synthesis.regenerated == {"get_book": 1}


async def test_contract_violations_are_mapped_to_their_piece_with_the_line(tmp_path):
    bad = CODE["return_book"].replace('f"no loan {loan_id}"', '"no loan {}".format(loan_id)')
    bad = bad.replace('loan["returned"] = True', 'loan["returned"] = eval("True")')
    model = scripted({"return_book": [bad]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    assert lint(env.code) == []
    feedback = requests_for(model, "return_book")[1].messages[-1].content
    assert "[format_string_call] line 12:" in feedback and ".format(loan_id)" in feedback
    assert "[forbidden_name] line 15: do not use eval()" in feedback
    assert [len(requests_for(model, key)) for key in OPERATION_NAMES] == [1, 1, 1, 2, 1, 1]


async def test_raising_and_bare_returns_break_the_return_contract(tmp_path):
    bad = (
        CODE["get_book"]
        .replace('return {"success": False, "error": f"no book {book_id}"}', "raise KeyError(book_id)")
        .replace('return {"success": True, "data": dict(book)}', "return")
    )
    model = scripted({"get_book": [bad]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    feedback = requests_for(model, "get_book")[1].messages[-1].content
    assert "[raises] line 12" in feedback and "[bare_return] line 13" in feedback
    assert lint(env.code) == []


async def test_signature_drift_is_a_schema_mismatch_fed_back_with_the_plan(tmp_path):
    bad = CODE["return_book"].replace("loan_id: str) -> dict", "loan_id: str, force: bool = False) -> dict")
    bad = bad.replace("loan_id: the loan", "loan_id: the loan\n        force: skip checks")
    wrong_type = CODE["borrow_book"].replace("due: str)", "due: int)")
    model = scripted({"return_book": [bad], "borrow_book": [wrong_type]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    feedback = requests_for(model, "return_book")[1].messages[-1].content
    assert "[schema_mismatch] parameter force is not planned" in feedback
    assert "`def return_book(self, loan_id: str) -> dict:`" in feedback
    assert "parameter due must have type str" in requests_for(model, "borrow_book")[1].messages[-1].content
    assert [t["function"]["name"] for t in env.tools] == OPERATION_NAMES


async def test_a_piece_that_never_becomes_valid_ends_as_a_rejection_with_raw_output(tmp_path):
    never = "Sorry, I cannot write that method.\n\ndef get_book(self, book_id: str) -> dict:\n    return {"
    model = scripted({"get_book": [never] * 10})
    with pytest.raises(Rejected) as verdict:
        await code(library_plan(), context(tmp_path, model, "code.repair_attempts=2"))
    rejection = verdict.value.rejection
    assert rejection.reason == "code_unparsable"
    assert rejection.detail.startswith("get_book: [syntax]")
    assert rejection.raw_output == f"# ---- piece get_book ----\n{never.strip()}"
    assert len(requests_for(model, "get_book")) == 3  # the first try and two repairs
    assert len(model.requests) == 9


async def test_a_constructor_that_never_sets_the_planned_state_is_rejected(tmp_path):
    wrong = (
        "class LibraryLoansEnv:\n    def __init__(self):\n        self.books = {}\n        self.today = '2024-01-01'\n"
    )
    model = scripted({"__init__": [wrong] * 5})
    with pytest.raises(Rejected) as verdict:
        await code(library_plan(), context(tmp_path, model, "code.repair_attempts=1"))
    rejection = verdict.value.rejection
    assert rejection.reason == "code_state_mismatch"
    assert "__init__ must set self.members = {}  (member records by member_id)" in rejection.detail
    assert "self.today is not planned state" in rejection.detail
    assert len(requests_for(model, "__init__")) == 2


async def test_a_refused_request_and_one_failed_after_every_retry_are_rejections(tmp_path):
    model = scripted({"borrow_book": [LLMRequestError("400 too long", status_code=400)]})
    with pytest.raises(Rejected) as verdict:
        await code(library_plan(), context(tmp_path, model))
    assert verdict.value.rejection.reason == "llm_request"
    # The server went away after answering the other pieces: this environment fails, the run goes on.
    model = scripted({"borrow_book": [LLMRequestError("failed after 5 attempts: HTTP 503", retryable=True)]})
    with pytest.raises(Rejected) as verdict:
        await code(library_plan(), context(tmp_path, model, "llm.max_retries=0"))
    assert verdict.value.rejection.reason == "llm_request" and "HTTP 503" in verdict.value.rejection.detail


# ------------------------------------------------------------------------------------ deterministic fixes


def test_fences_and_prose_are_stripped():
    text = "Sure! Here it is:\n```python\ndef f(self) -> dict:\n    return {}\n```\nThis returns an empty dict."
    assert extract_code(text) == ("def f(self) -> dict:\n    return {}\n", ["stripped_fences"])
    prose = "Here is the method:\ndef f(self) -> dict:\n    return {}\nIt returns a dict."
    code_text, fixes = extract_code(prose)
    assert code_text == "def f(self) -> dict:\n    return {}\n"
    assert fixes == ["dropped_leading_prose", "dropped_trailing_prose"]


def test_method_indentation_and_tabs_are_fixed():
    op = library_plan().operations[0]
    indented = "    def get_book(self, book_id: str) -> dict:\n\t\treturn {}\n"
    piece = method_piece(indented, op)
    assert isinstance(piece, Piece)
    assert piece.body == "def get_book(self, book_id: str) -> dict:\n    return {}\n".replace(
        "    return",
        '    """Look up one book.\n\n    Args:\n        book_id: the book\n\n    Returns:\n'
        '        {"success": True, ...} with the book record; or {"success": False, "error": ...}.\n    """\n'
        "    return",
    )
    assert piece.fixes == ("expanded_tabs", "inserted_docstring")


def test_method_in_a_class_under_another_name_without_self_is_recovered():
    op = library_plan().operations[0]
    text = (
        "class LibraryLoansEnv:\n"
        "    @staticmethod\n"
        "    def getBook(book_id: str) -> dict:\n"
        '        """Get it.\n\n        Args:\n            book_id: the book\n        """\n'
        "        return {}\n"
    )
    piece = method_piece(text, op)
    assert isinstance(piece, Piece)
    assert piece.body.startswith("def get_book(self, book_id: str) -> dict:\n")
    assert piece.fixes == ("extracted_from_class", "renamed_method:getBook", "dropped_decorators", "added_self")


def test_method_pieces_keep_private_helpers_and_drop_other_tools():
    op = library_plan().operations[0]
    text = (
        CODE["get_book"]
        + "\n\ndef _helper(self) -> int:\n    return 1\n\n\ndef list_books(self) -> dict:\n    return {}\n"
    )
    piece = method_piece(text, op)
    assert isinstance(piece, Piece)
    assert "def _helper(self)" in piece.body and "list_books" not in piece.body
    assert piece.fixes == ("dropped_extra_definitions",)
    missing = method_piece("def a(self):\n    return 1\n\ndef b(self):\n    return 2\n", op)
    assert missing == [PieceError("missing_method", "define the method `def get_book(self, ...)`; defined: a, b")]
    asynchronous = method_piece("async def get_book(self, book_id: str) -> dict:\n    return {}\n", op)
    assert asynchronous == [PieceError("async_tool", "get_book must be a plain `def`, not `async def`")]


def test_state_piece_fixes():
    the_plan = library_plan()
    only_init = "def __init__(self):\n    self.books = {}\n    self.members = dict()\n    self.loans = {}\n"
    piece = state_piece(only_init, the_plan)
    assert isinstance(piece, Piece) and piece.body.startswith("class LibraryLoansEnv:\n    def __init__(self):")
    assert piece.fixes == ("wrapped_in_class",)
    stubs = (
        "from typing import TypedDict\n\nclass Book(TypedDict):\n    title: str\n\n"
        "class Library:\n    def __init__(self):\n        self.books = {}\n        self.members = {}\n"
        "        self.loans = {}\n\n    def get_book(self, book_id: str) -> dict:\n        pass\n"
    )
    piece = state_piece(stubs, the_plan)
    assert isinstance(piece, Piece)
    assert piece.fixes == ("dropped_extra_classes", "dropped_tool_stubs", "renamed_class")
    assert "get_book" not in piece.body and piece.body.startswith("class LibraryLoansEnv:")
    not_a_dict = "class LibraryLoansEnv:\n    def __init__(self):\n        self.books = []\n"
    errors = state_piece(not_a_dict, the_plan)
    assert [e.code for e in errors] == ["state_mismatch"] * 3


def test_missing_imports_come_from_the_allow_list():
    source = (
        "class E:\n    def f(self, x: Optional[List[str]] = None) -> dict:\n"
        "        day = datetime.now().isoformat()\n        counts = defaultdict(int)\n"
        "        return {'id': str(uuid.uuid4()), 'd': day, 'm': math.floor(1.5), 'os': os.getcwd()}\n"
    )
    assert missing_imports(source) == [
        "from collections import defaultdict",
        "from datetime import datetime",
        "from typing import List",
        "from typing import Optional",
        "import math",
        "import uuid",
    ]  # `os` is not on the allow-list: it stays missing, and the module check reports it as undefined_name
    assert missing_imports("import datetime\nx = datetime.date.today()\n") == []
    assert missing_imports("x = datetime.date.today()\n") == ["import datetime"]


# ---------------------------------------------------------------------------------------- through the runner


async def test_topic_to_plan_to_code_through_the_runner(tmp_path, sandbox):
    state = (FIXTURES / "library_state.json").read_text()
    operations = (FIXTURES / "library_operations.json").read_text()

    def answer(request: ChatRequest):
        if request.response_format:
            name = request.response_format["json_schema"]["name"]
            return state if name == "StateDraft" else operations
        return CODE[piece_of(request)]

    the_topic = Topic(
        provenance={"config_hash": "hash"},
        name="library_loans",
        description="A public library's lending desk.",
        domain="library",
    )

    async def topics(_inputs, _ctx):
        return [the_topic]

    stages = (
        BatchStage("topics", topics, input=None, output=Topic),
        ItemStage("plan", plan, input=Topic, output=EnvPlan),
        ItemStage("code", code, input=EnvPlan, output=Environment),
    )
    config = load_config(None, [])
    llm = client_for(config.llm, ScriptedModel(answer), model_id="m")
    stats = await run_stages(stages, config, tmp_path / "run", llm=lambda _stats: llm, sandbox=lambda: sandbox)
    assert (stats["plan"].kept, stats["code"].kept) == (1, 1)
    frame = pl.read_parquet(tmp_path / "run" / "code.parquet")
    (row,) = frame.to_dicts()
    assert row["status"] == "candidate" and lint(row["code"]) == []
    assert [t["function"]["name"] for t in json.loads(row["tools"])] == OPERATION_NAMES
    plans = pl.read_parquet(tmp_path / "run" / "plan.parquet")
    assert plans["class_name"].to_list() == ["LibraryLoansEnv"]
    assert row["plan_id"] == plans["id"][0]


async def test_undefined_names_are_fed_back_when_no_import_can_fix_them(tmp_path):
    bad = CODE["get_book"].replace("book = self.books.get(book_id)", "book = self.books.get(book_id) or lookup(os)")
    model = scripted({"get_book": [bad]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    feedback = requests_for(model, "get_book")[1].messages[-1].content
    assert "[undefined_name] line 10: lookup is not defined" in feedback
    assert "[undefined_name] line 10: os is not defined" in feedback
    assert "lookup" not in env.code


async def test_a_helper_defined_twice_is_reported_on_the_later_piece(tmp_path):
    twice = CODE["get_book"] + "\n\ndef _open_loans(self, member_id: str) -> list:\n    return []\n"
    model = scripted({"get_book": [twice]})
    (env,) = await code(library_plan(), context(tmp_path, model))
    feedback = requests_for(model, "get_book")[1].messages[-1].content
    assert "[duplicate_definition] line 15: _open_loans is already defined" in feedback
    assert env.code.count("def _open_loans") == 1


async def test_the_module_is_loaded_in_the_sandbox_and_a_failing_constructor_is_regenerated(tmp_path, sandbox):
    crashing = CODE["__init__"].replace("self.loans = {}", "self.loans = {}\n        self.books['b0'] = 1 / 0")
    model = scripted({"__init__": [crashing]})
    (env,) = await code(library_plan(), context(tmp_path, model, sandbox=sandbox))
    feedback = requests_for(model, "__init__")[1].messages[-1].content
    assert "[load_failed]" in feedback and "ZeroDivisionError" in feedback
    assert "1 / 0" not in env.code and env.synthesis.regenerated == {"__init__": 1}


async def test_a_module_that_never_loads_is_rejected(tmp_path, sandbox):
    crashing = CODE["__init__"].replace("self.loans = {}", "self.loans = {}\n        self.books['b0'] = 1 / 0")
    model = scripted({"__init__": [crashing] * 3})
    with pytest.raises(Rejected) as verdict:
        await code(library_plan(), context(tmp_path, model, "code.repair_attempts=1", sandbox=sandbox))
    assert verdict.value.rejection.reason == "code_load_failed"
    assert "1 / 0" in verdict.value.rejection.raw_output


def test_absurd_nesting_is_a_syntax_error_not_a_crash():
    op = library_plan().operations[0]
    deep = "def get_book(self, book_id: str) -> dict:\n    return " + "1+" * 200_000 + "1\n"
    (error,) = method_piece(deep, op)
    assert error.code == "syntax"


async def test_pieces_are_requested_concurrently(tmp_path):
    """Every first-round request must be in flight at once: a sequential stage would never release this gate."""

    class Gate:
        def __init__(self, width):
            self.width, self.waiting, self.open = width, 0, asyncio.Event()

        async def chat(self, request):
            self.waiting += 1
            if self.waiting == self.width:
                self.open.set()
            await asyncio.wait_for(self.open.wait(), timeout=10)
            return text_reply(CODE[piece_of(request)])

    the_plan = library_plan()
    config = load_config(None, ["code.load_check=false"])
    llm = client_for(config.llm, Gate(len(the_plan.operations) + 1), model_id="m")
    ctx = StageContext(config, "hash", tmp_path, StageStats("code"), llm=llm)
    (env,) = await code(the_plan, ctx)
    assert lint(env.code) == []


# ------------------------------------------------------------------------------- splitting and regeneration


async def test_the_module_docstring_carries_the_rules_and_splitting_gives_the_pieces_back(tmp_path):
    the_plan = library_plan()
    (env,) = await code(the_plan, context(tmp_path, scripted()))
    docstring = ast.get_docstring(ast.parse(env.code))
    assert docstring.startswith(the_plan.description) and "\n\nRules:\n1. A member may have at most" in docstring
    assert docstring.endswith(f"{len(the_plan.rules)}. {the_plan.rules[-1]}")
    pieces = split_module(env.code, the_plan)
    assert list(pieces) == ["__init__", *OPERATION_NAMES]
    assert pieces["__init__"].body.startswith("class LibraryLoansEnv:") and "def _open_loans" in pieces["__init__"].body
    assert pieces["borrow_book"].body.startswith("def borrow_book(self, member_id: str")
    methods = [pieces[name] for name in OPERATION_NAMES]
    assert assemble(the_plan, pieces["__init__"], methods).source == env.code  # the inverse of assemble


async def test_regenerate_rewrites_only_the_failing_piece_with_its_error_fed_back(tmp_path):
    the_plan = library_plan()
    (env,) = await code(the_plan, context(tmp_path, scripted()))
    fixed = CODE["return_book"].replace('"""Take a lent book back.', '"""Take a lent book back (fixed).', 1)
    assert fixed != CODE["return_book"]
    model = scripted({"return_book": [fixed]})
    errors = {"return_book": [PieceError("tool_raised", "return_book({'loan_id': 'x'}) raised KeyError: 'x'")]}
    made = await regenerate(context(tmp_path, model), env, the_plan, split_module(env.code, the_plan), errors, repair=1)
    assert made.assembly is not None and made.requests == 1 and made.errors == {}
    (request,) = model.requests
    # Repair 1 of the module: past the code stage's own 1 + code.repair_attempts (3) samples.
    assert request.sample_index == 4 and request.messages[2].content.startswith("def return_book(self")
    assert "[tool_raised]" in request.messages[3].content and "KeyError" in request.messages[3].content
    assert "(fixed)" in made.assembly.source and made.assembly.source.replace(" (fixed)", "") == env.code
    assert "(fixed)" not in env.code


def test_a_name_bound_only_in_another_method_is_unbound_and_imported():
    # As capable models write it: one method imports datetime locally, another uses it without an import.
    source = (
        "class ClassesEnv:\n"
        "    def book(self, start: str) -> dict:\n"
        "        from datetime import datetime\n"
        "        return {'at': datetime.fromisoformat(start).isoformat(), 'now': datetime.now().isoformat()}\n"
        "\n"
        "    def cancel(self, enrollment_id: str) -> dict:\n"
        "        start = datetime.datetime.fromisoformat('2024-01-01T10:00:00')\n"
        "        day = datetime.date.today()\n"
        "        return {'success': start.date() >= day, 'ids': [uuid.uuid4().hex for _ in range(2)]}\n"
    )
    assert unbound_names(source) == {"datetime": 7, "uuid": 9}
    assert missing_imports(source) == ["import datetime", "import uuid"]
    # Bound where it is used (a parameter, a local import, a closure's variable, a comprehension's): nothing.
    fine = (
        "import json\n\nclass E:\n    def a(self, datetime: str) -> str:\n        return datetime\n\n"
        "    def b(self) -> list:\n        import random\n        seed = 3\n"
        "        def pick():\n            return random.random() + seed\n"
        "        return [pick() for _ in range(2)] + [json.dumps(x) for x in (1, 2)]\n"
    )
    assert unbound_names(fine) == {} and missing_imports(fine) == []
