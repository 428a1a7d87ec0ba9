"""code: write an environment module from its plan, piece by piece, and repair what fails.

One request writes the class with its constructor (the state piece); one request per operation writes that
operation's method, all concurrently. The pieces are cleaned (`pieces`), assembled into one module, linted,
checked against the return contract, and their derived tool schemas compared with the plan (`assembly`).
Each failing piece — and only it — is regenerated with its exact errors fed back, at most `code.repair_attempts`
times (`builder.llm.reask.reask_each`). The generated code is never run in this process: with `code.load_check`
the assembled module is loaded in a sandbox worker (import, constructor, state snapshot), and a failure goes back
to the state piece. `regenerate` runs the same loop for a later stage on a finished module (evaluate, when a tool
fails its probe).

Rejection reasons: `code_unparsable` (a piece never parsed or never defined its method), `code_load_failed`
(the module never loaded in the sandbox), `code_state_mismatch` (the constructor never set the planned state),
`code_contract` (lint, return-contract or undefined-name problems remained), `code_schema_mismatch` (a tool's
parameters never matched the plan), `llm_request`.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source
from builder.envs.session import Session, SessionError
from builder.evidence import Synthesis
from builder.limits import DETAIL_CHARS
from builder.llm import ChatRequest, LLMRequestError
from builder.llm.reask import NoUsableReply, Refusal, reask_each
from builder.naming import snake_case
from builder.prompts import prompt, prompt_version
from builder.records import ChatMessage, Environment, EnvPlan, OperationPlan, Record, Sampling
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages._llm import system_user
from builder.stages._repair import ToolProblemText, ToolRepair
from builder.stages.code.assembly import Assembly, assemble, module_errors, split_module, state_schema
from builder.stages.code.pieces import STATE, Piece, PieceError, docstring, method_piece, signature, state_piece
from builder.views.plan import describe_entity

# Error codes in the order they decide the rejection reason when several pieces fail differently.
_REASONS = (
    ({"syntax", "missing_class", "missing_init", "missing_method"}, "code_unparsable"),
    ({"load_failed"}, "code_load_failed"),
    ({"state_mismatch"}, "code_state_mismatch"),
    ({"schema_mismatch"}, "code_schema_mismatch"),
)
RAW_OUTPUT_LIMIT = 20_000


@dataclass
class _Synthesis:
    """One environment in the making: each piece's request, last reply, clean code and open errors."""

    plan: EnvPlan
    requests: dict[str, list[ChatMessage]]
    raw: dict[str, str] = field(default_factory=dict)
    pieces: dict[str, Piece] = field(default_factory=dict)
    errors: dict[str, list[PieceError]] = field(default_factory=dict)
    generated: Counter[str] = field(default_factory=Counter)

    def take(self, key: str, text: str, truncated: bool) -> None:
        """Record a reply for piece `key`: its clean piece, or its errors."""
        self.raw[key] = text
        self.generated[key] += 1
        if key == STATE:
            made = state_piece(text, self.plan, truncated)
        else:
            made = method_piece(text, next(op for op in self.plan.operations if op.name == key), truncated)
        if isinstance(made, Piece):
            self.pieces[key] = made
            self.errors.pop(key, None)
        else:
            self.errors[key] = made

    def refusal(self, key: str) -> Refusal:
        """Why piece `key` is asked again: its errors, with its last reply shown back (`reask_each` shows only
        the last attempt, so the context stays bounded however many repairs are allowed)."""
        found = {key: self.errors[key]}
        listed = "\n".join(f"- {error}" for error in self.errors[key])
        what = "class with its constructor" if key == STATE else f"method {key}"
        feedback = f"That code has these problems:\n{listed}\nWrite the whole corrected {what} again, code only."
        return Refusal(_reason(found), _detail(found), feedback, shown=self.raw[key])

    def refusals(self) -> dict[str, Refusal]:
        return {key: self.refusal(key) for key in sorted(self.errors)}

    def summary(self, assembly: Assembly) -> Synthesis:
        """What `Environment.synthesis` records: requests, regenerations, fixes and added imports."""
        return Synthesis(
            requests=sum(self.generated.values()),
            regenerated={key: count - 1 for key, count in sorted(self.generated.items()) if count > 1},
            fixes={key: tuple(piece.fixes) for key, piece in sorted(self.pieces.items()) if piece.fixes},
            added_imports=tuple(assembly.added_imports),
        )


async def code(plan: EnvPlan, ctx: StageContext) -> list[Record]:
    """A candidate Environment whose module passes the lint and whose tools match the plan, or a rejection."""
    sampling = _sampling(ctx)
    work = _Synthesis(plan, _requests(plan))
    assembly = await _synthesize(ctx, plan, work, sampling, attempt=0)
    if assembly is not None:
        return [_environment(ctx, plan, assembly.source, sampling, work.summary(assembly))]
    errors = work.errors
    raise Rejected(ctx.reject(plan, _reason(errors), _detail(errors), raw_output=_raw(work.raw, errors)))


@dataclass(frozen=True)
class Regenerated:
    """What `regenerate` made: the repaired module (None: the pieces still fail), the errors left, and cost."""

    assembly: Assembly | None
    errors: dict[str, list[PieceError]]
    requests: int
    raw: str


async def regenerate(
    ctx: StageContext, subject: Record, plan: EnvPlan, pieces: dict[str, Piece],
    errors: dict[str, list[PieceError]], repair: int,
) -> Regenerated:  # fmt: skip
    """Regenerate the pieces named in `errors` of a finished module (the others stay as they are), each with its
    current code and errors fed back, through the same bounded loop as `code`: lint, contract, schemas, load.

    `subject` is what an `llm_request` rejection names; `repair` numbers this repair of the module (from 1; the
    code stage's own writing is 0), so its requests are fresh samples rather than cached replies.
    """
    work = _Synthesis(plan, _requests(plan), raw={key: piece.body for key, piece in pieces.items()})
    work.pieces, work.errors = dict(pieces), {key: list(found) for key, found in errors.items()}
    assembly = await _synthesize(ctx, subject, work, _sampling(ctx), attempt=repair)
    raw = _raw(work.raw, work.errors or errors)
    return Regenerated(assembly, {} if assembly else work.errors, sum(work.generated.values()), raw)


async def repair_tools(
    ctx: StageContext, env: Environment, plan: EnvPlan, problems: Mapping[str, Sequence[ToolProblemText]],
    repair: int,
) -> ToolRepair | None:  # fmt: skip
    """The evaluate gates' repair (`builder.stages._repair.RepairTools`): the methods named in `problems`
    regenerated (`regenerate`) in `env`'s module, which must be `plan`'s; None when it is not (not coded from
    this plan, or its methods are not the plan's): nothing to regenerate."""
    pieces = split_module(env.code, plan)
    if set(pieces) != {STATE, *(op.name for op in plan.operations)} or set(problems) - set(pieces):
        return None
    errors = {tool: [PieceError(p.code, p.message) for p in found] for tool, found in problems.items()}
    made = await regenerate(ctx, env, plan, pieces, errors, repair=repair)
    if made.assembly is None:
        left = {key: tuple(str(error) for error in found) for key, found in sorted(made.errors.items())}
        return ToolRepair(source=None, requests=made.requests, left=left)
    return ToolRepair(source=made.assembly.source, requests=made.requests)


def _sampling(ctx: StageContext) -> Sampling:
    return Sampling(temperature=ctx.config.llm.temperature, max_tokens=ctx.config.code.max_tokens)


def _requests(plan: EnvPlan) -> dict[str, list[ChatMessage]]:
    requests = {STATE: system_user(prompt("code_state"), state_request(plan))}
    return requests | {op.name: system_user(prompt("code_method"), method_request(plan, op)) for op in plan.operations}


async def _synthesize(
    ctx: StageContext, subject: Record, work: _Synthesis, sampling: Sampling, attempt: int
) -> Assembly | None:
    """Write every piece (or, with errors already in `work`, the failing ones), then regenerate the failing ones
    with their errors fed back (`reask_each`, as `attempt` of the module's repairs), at most `code.repair_attempts`
    times: the module once every check passes, or None (`work.errors` says why)."""
    plan = work.plan
    assembled: list[Assembly] = []

    async def write(key: str, conversation: list[ChatMessage], sample: int) -> Piece | Refusal:
        # Plain text, not JSON with a `code` field: code inside a JSON string must escape every quote, backslash
        # and newline, which models get wrong more often than fences, and the JSON wrapper would add no check
        # that `ast` and the lint do not already do. Fences and prose are stripped deterministically.
        text, truncated = await _write(ctx, subject, conversation, sampling, sample)
        work.take(key, text, truncated)
        return work.refusal(key) if key in work.errors else work.pieces[key]

    async def judge(_written: dict[str, Piece]) -> dict[str, Refusal]:
        """The pieces together: assembled, linted, their schemas compared and the module loaded."""
        assembly = assemble(plan, work.pieces[STATE], [work.pieces[op.name] for op in plan.operations])
        work.errors = module_errors(assembly, plan)
        if not work.errors and ctx.config.code.load_check:
            work.errors = await asyncio.to_thread(load_errors, ctx.sandbox, assembly.source, plan)
        assembled[:] = [] if work.errors else [assembly]
        return work.refusals()

    attempts = ctx.config.code.repair_attempts + 1
    try:
        await reask_each(work.requests, write, attempts=attempts, attempt=attempt, judge=judge, refused=work.refusals())
    except NoUsableReply:
        return None
    return assembled[0]


async def _write(
    ctx: StageContext, subject: Record, messages: list[ChatMessage], sampling: Sampling, sample: int
) -> tuple[str, bool]:
    """The model's text and whether it hit the token limit; `sample` makes each attempt a fresh sample, so a
    piece whose reply came back unchanged is not answered from the cache with the same reply again."""
    try:
        reply = await ctx.llm.chat(ChatRequest(messages=tuple(messages), sampling=sampling).resampled(sample))
    except LLMRequestError as error:  # also after every retry (the status is in the message)
        raise Rejected(ctx.reject(subject, "llm_request", str(error)[:DETAIL_CHARS])) from None
    return reply.content or "", reply.finish_reason == "length"


def load_errors(sandbox: Sandbox, source: str, plan: EnvPlan) -> dict[str, list[PieceError]]:
    """Load the module in a sandbox worker and read its state; problems belong to the state piece.

    Blocking (the sandbox API is synchronous): call it in a thread. Only module import, the constructor and the
    state snapshot run here, so a failure is the constructor's (or a default value's) doing.
    """
    try:
        with Session(sandbox, source) as session:
            state = session.snapshot()
    except (SessionError, ContractError) as error:
        return {STATE: [PieceError("load_failed", f"{error}")]}
    wrong = [e.collection for e in plan.entities if not isinstance(state.get(e.collection), dict)]
    if wrong:
        message = f"after __init__, {', '.join(f'self.{name}' for name in wrong)} must be dicts"
        return {STATE: [PieceError("state_mismatch", message)]}
    return {}


def _context(plan: EnvPlan) -> list[str]:
    lines = [f"Class: {plan.class_name} — {plan.description}", "State attributes:"]
    lines += [f"- {describe_entity(entity)}" for entity in plan.entities]
    if plan.rules:
        lines.append("Rules:")
        lines += [f"{number}. {rule}" for number, rule in enumerate(plan.rules, 1)]
    return lines


def state_request(plan: EnvPlan) -> str:
    """The user message of the state piece: the class, its state attributes and rules."""
    return "\n".join(_context(plan) + [f"Write the class {plan.class_name} with its __init__."])


def method_request(plan: EnvPlan, op: OperationPlan) -> str:
    """The user message of one method: the class context, the operation, and its exact header to start from."""
    # The class context first and the operation's own lines after it: every method request of a plan starts
    # alike, so a model server's prefix cache computes the context once.
    lines = _context(plan)
    others = [other.name for other in plan.operations if other.name != op.name]
    kind = "a query (it must not change the state)" if op.kind == "query" else "a state change"
    lines.append(f"\nWrite the method {op.name}, {kind}: {op.description}")
    lines.append(f"Other tools (written separately): {', '.join(others)}")
    if op.reads or op.writes:
        lines.append(f"It reads: {', '.join(op.reads) or 'nothing'}; it writes: {', '.join(op.writes) or 'nothing'}.")
    if op.enforces:
        lines.append(f"It enforces rules {', '.join(map(str, op.enforces))}.")
    header = signature(op) + "\n" + "\n".join("    " + line if line else "" for line in docstring(op).splitlines())
    lines.append(f"Start with exactly:\n{header}")
    return "\n".join(lines)


def _reason(errors: dict[str, list[PieceError]]) -> str:
    codes = {error.code for found in errors.values() for error in found}
    return next((reason for group, reason in _REASONS if codes & group), "code_contract")


def _detail(errors: dict[str, list[PieceError]]) -> str:
    parts = [f"{key}: " + "; ".join(map(str, found)) for key, found in sorted(errors.items())]
    return " | ".join(parts)[:DETAIL_CHARS]


def _raw(raw: dict[str, str], errors: dict[str, list[PieceError]]) -> str:
    """The last reply of every failing piece, each under a header naming the piece."""
    text = "\n".join(f"# ---- piece {key} ----\n{raw.get(key, '')}" for key in sorted(errors))
    return text[:RAW_OUTPUT_LIMIT]


def _environment(
    ctx: StageContext, plan: EnvPlan, source: str, sampling: Sampling, synthesis: Synthesis
) -> Environment:
    versions = f"{prompt_version('code_state')}+{prompt_version('code_method')}"
    provenance = ctx.provenance(
        [plan.id, plan.topic_id], model=ctx.llm.model_id, sampling=sampling, prompt_version=versions
    )
    return Environment(
        provenance=provenance,
        plan_id=plan.id,
        name=plan.name or snake_case(plan.class_name.removesuffix("Env")),
        class_name=plan.class_name,
        description=plan.description,
        domain=plan.domain,
        code=source,
        tools=list(inspect_source(source).tools),
        state_schema=state_schema(plan),
        status="candidate",
        synthesis=synthesis,
    )
