"""`python -m builder scenarios ENV.py --state S.json`: verified scenarios for one environment file, without the
pipeline. The file is checked against the contract, the state must load and answer every tool, and then the
scenarios stage runs on it as on an accepted environment, every slot starting from that state (`start`).

The model is the one the config names (`--profile`, `--config`, `--set`, `--llm-url`), started on its first
call only (never, when the graph method words by template: `scenarios.wording = "template"`). Written to the
output folder: `scenarios.jsonl` or `scenarios.parquet` (the `Scenario` records, one per slot and mode),
`rejections.jsonl` (the slots that failed, with their reasons), `stats.json` (the stage's stats, with the
per-method report), and the model's response cache and server log.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, TextIO

from builder.config import BuildConfig, config_hash
from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source
from builder.errors import BuilderError
from builder.llm import LLMRequestError
from builder.llm.errors import ServerError
from builder.records import Environment, Provenance, Record, Rejection, Scenario, scenario_seed
from builder.run.stage import Rejected, StageContext
from builder.sandbox.runtime import Sandbox
from builder.stages.evaluate.source import environment_text
from builder.stages.scenarios.method_stats import derive_report
from builder.stages.scenarios.verify import load_state
from builder.stats import StageStats, save_stats
from builder.tables import to_frame, write_parquet_atomic


def scenarios_command(
    path: Path, state_path: Path, config: BuildConfig, out: Path, *, now: str,
    form: Literal["jsonl", "parquet"] = "jsonl", stdout: TextIO | None = None, progress: TextIO | None = None,
) -> int:  # fmt: skip
    """Write the verified scenarios of the environment at `path` from the state at `state_path` to `out`; the
    slots and method are `config.scenarios`'. Exit code 0 when at least one scenario was verified, else 1.

    Raises:
        BuilderError: the file cannot be read or breaks the contract, the state is no JSON object or does not
            load, or the model cannot be reached.
    """
    stdout, progress = stdout or sys.stdout, progress or sys.stderr
    code = _read(path)
    try:
        interface = inspect_source(code)
    except ContractError as error:
        raise BuilderError(f"{path} breaks the environment contract:\n{error}") from None
    state = _read_state(state_path)
    env = Environment(
        provenance=Provenance(config_hash=config_hash(config)),
        plan_id=f"file:{path.name}",
        name=path.stem,
        class_name=interface.class_name,
        description=environment_text(path.stem, code),
        domain="standalone",
        code=code,
        tools=list(interface.tools),
        state_schema={},  # inferred from the state where needed: every slot starts from the given one
        status="accepted",
    )
    out.mkdir(parents=True, exist_ok=True)
    stats = StageStats("scenarios")
    records = asyncio.run(_run(env, state, state_path, config, out, now, stats, progress))
    kept = [record for record in records if isinstance(record, Scenario)]
    rejected = [record for record in records if isinstance(record, Rejection)]
    target = out / f"scenarios.{form}"
    if form == "parquet":
        write_parquet_atomic(to_frame(Scenario, kept), target)
    else:
        target.write_text("".join(record.model_dump_json() + "\n" for record in kept))
    (out / "rejections.jsonl").write_text("".join(record.model_dump_json() + "\n" for record in rejected))
    stats.kept, stats.dropped = len(kept), Counter(record.reason for record in rejected)
    derive_report(stats)
    save_stats(out / "stats.json", {"scenarios": stats})
    _summary(stats, kept, target, stdout)
    return 0 if kept else 1


async def _run(
    env: Environment, state: dict[str, Any], state_path: Path, config: BuildConfig, out: Path, now: str,
    stats: StageStats, progress: TextIO,
) -> list[Record]:  # fmt: skip
    from builder.llm.connect import open_llm
    from builder.pipeline import LazyModel
    from builder.stages.scenarios import scenarios, slot_methods

    methods = slot_methods(config.scenarios.method, config.scenarios.per_environment)
    done: list[int] = []

    def on_slot(slot: int, method: str, made: list[Scenario] | Rejection) -> None:
        done.append(slot)
        verdict = f"rejected: {made.reason}: {made.detail[:160]}" if isinstance(made, Rejection) else "verified"
        print(f"[{len(done)}/{len(methods)}] slot {slot} ({method}): {verdict}", file=progress, flush=True)

    with ExitStack() as stack:
        sandbox = stack.enter_context(Sandbox(config.sandbox))
        loaded, problems = await asyncio.to_thread(
            load_state, sandbox, env.code, state, now=now, seed=scenario_seed(env.id, now)
        )
        if loaded is None or problems:
            raise BuilderError(f"the state in {state_path} does not work in {env.name}:\n- " + "\n- ".join(problems))
        model = LazyModel(config.llm, lambda on_call: stack.enter_context(open_llm(config.llm, out, on_call=on_call)))
        ctx = StageContext(
            config, config_hash(config), out, stats, llm=model.for_stage(stats), open_sandbox=lambda: sandbox
        )
        counts = Counter(methods)
        print(f"{env.name}: {len(methods)} slots ({', '.join(f'{n} {m}' for m, n in counts.items())})",
              file=progress, flush=True)  # fmt: skip
        try:
            return await scenarios(env, ctx, start=(loaded, now), on_slot=on_slot)
        except Rejected as verdict:
            raise BuilderError(f"{env.name}: {verdict.rejection.reason}: {verdict.rejection.detail}") from None
        except (LLMRequestError, ServerError) as error:
            where = config.llm.url or (", ".join(config.llm.urls) if config.llm.urls else "the managed vLLM server")
            raise BuilderError(
                f"the model is unreachable ({where}): {error}\n"
                "The graph method needs it to word the requests: start it, name one with --llm-url URL or "
                "llm.url in --config, or word them without a model: --wording template."
            ) from None
        finally:
            await model.aclose()


def _summary(stats: StageStats, kept: list[Scenario], target: Path, out: TextIO) -> None:
    slots = {record.verification.scenario_group for record in kept}
    print(f"{len(slots)} verified scenarios ({len(kept)} records, one per mode) in {target}", file=out)
    if stats.dropped:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats.dropped.items()))
        print(f"rejected slots: {reasons} (see {target.parent / 'rejections.jsonl'})", file=out)
    for method, entry in sorted(stats.report.get("methods", {}).items()):
        cost = entry["per_verified"] or {}
        print(
            f"{method}: {entry['verified']}/{entry['slots']} slots verified, "
            f"{cost.get('calls', '-')} model calls and {cost.get('prompt_tokens', '-')} prompt tokens per "
            f"verified scenario, {entry['mean_chain_length'] or '-'} calls per gold"
            + (f", {entry['template_worded']} worded by the template" if entry.get("template_worded") else ""),
            file=out,
        )


def _read(path: Path) -> str:
    try:
        return Path(path).read_text()
    except OSError as error:
        raise BuilderError(f"cannot read {path}: {error.strerror}") from None


def _read_state(path: Path) -> dict[str, Any]:
    try:
        state = json.loads(_read(path))
    except json.JSONDecodeError as error:
        raise BuilderError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(state, dict) or not state:
        raise BuilderError(f"{path} holds no state: give a JSON object of the environment's attributes")
    return state
