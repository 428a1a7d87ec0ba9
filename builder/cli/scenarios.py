"""`python -m builder scenarios ENV.py --state S.json`: verified scenarios for one environment file, without the
pipeline. The file is checked against the contract, the state must load and answer every tool, and then the
pipeline's scenarios stage runs on it as on an accepted environment, every slot starting from that state.

The model is the one the config names (`--profile`, `--config`, `--set`, `--llm-url`; `-n`, `--method` and
`--wording` are applied first, so `--set` has the last word), started on its first call only (never, when the
graph method words by template: `scenarios.wording = "template"`). Written to the output folder:
`scenarios.jsonl` or `scenarios.parquet` (the `Scenario` records, one per slot and mode), `rejections.jsonl` (the
slots that failed, with their reasons), `stats.json` (the stage's stats, with the per-method report), and the
model's response cache and server log.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal, TextIO

from builder.cli.common import add_config_options, config_of
from builder.cli.env import add_now_option
from builder.config import BuildConfig, config_hash
from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source
from builder.errors import BuilderError, ConfigError
from builder.llm import LLMRequestError
from builder.llm.errors import ServerError, ServerUnreachable
from builder.records import Environment, Provenance, Record, Rejection, Scenario, scenario_seed
from builder.run.stage import Rejected
from builder.stages.scenarios.verify import load_state
from builder.stats import StageStats, save_stats
from builder.tables import to_frame, write_parquet_atomic
from builder.views.code import environment_text


def add_commands(commands: argparse._SubParsersAction) -> None:
    scenarios = commands.add_parser(
        "scenarios",
        help="write verified scenarios for one environment file",
        description="Make verified scenarios (task, user script, checks, gold actions) for one environment file, "
        "every one starting from the given state: the scenarios stage of the pipeline on this file alone. The "
        "graph method samples tool chains and needs the model only to word the user's request; the llm method "
        "has the model write task, gold and checks. The model is the one the config names (started on its first "
        "call); with --wording template the graph method words the requests from a template and no model is "
        "started. Writes DIR/scenarios.jsonl (one Scenario JSON object a line; --parquet: DIR/scenarios.parquet, "
        "the store's table schema), DIR/rejections.jsonl and DIR/stats.json (cost and yield per method). Exit 1 "
        "when no scenario was verified.",
    )
    scenarios.add_argument("path", type=Path, metavar="ENV.py")
    scenarios.add_argument(
        "--state", type=Path, required=True, metavar="STATE.json", help="the initial state (a JSON object)"
    )
    scenarios.add_argument(
        "-n", type=int, metavar="N", help="scenario slots to try (default: scenarios.per_environment)"
    )
    scenarios.add_argument(
        "--out", type=Path, metavar="DIR", help="output folder (default: ./scenarios-<ENV file stem>)"
    )
    scenarios.add_argument(
        "--method", choices=("graph", "llm", "both"), help="how to make them (default: scenarios.method, both)"
    )
    scenarios.add_argument(
        "--wording", choices=("model", "template", "model_then_template"),
        help="who words the graph method's requests (default: scenarios.wording); template needs no model at all "
        "and implies --method graph",
    )  # fmt: skip
    scenarios.add_argument("--parquet", action="store_true", help="write scenarios.parquet instead of JSONL")
    add_now_option(scenarios)
    add_config_options(scenarios)
    scenarios.set_defaults(handler=cmd_scenarios)


def cmd_scenarios(args: argparse.Namespace) -> int:
    if args.n is not None and args.n < 1:
        raise ConfigError(f"-n must be at least 1, not {args.n}")
    if args.wording == "template" and args.method not in (None, "graph"):
        raise ConfigError(f"--wording template makes no model call, but the {args.method} method needs the model")
    method = "graph" if args.wording == "template" and args.method is None else args.method
    flags = [f"scenarios.per_environment={args.n}"] if args.n is not None else []
    if method is not None:
        flags.append(f'scenarios.method="{method}"')
    if args.wording is not None:
        flags.append(f'scenarios.wording="{args.wording}"')
    args.overrides = [*flags, *args.overrides]  # --set has the last word
    out = args.out or Path(f"scenarios-{args.path.stem}")
    form = "parquet" if args.parquet else "jsonl"
    return scenarios_command(args.path, args.state, config_of(args), out, now=args.now, form=form)


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
    from builder.pipeline import SCENARIOS

    out.mkdir(parents=True, exist_ok=True)
    stats = StageStats("scenarios", report=SCENARIOS.report())
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
    SCENARIOS.derive(stats)
    save_stats(out / "stats.json", {"scenarios": stats})
    _summary(stats, kept, target, stdout)
    return 0 if kept else 1


async def _run(
    env: Environment, state: dict[str, Any], state_path: Path, config: BuildConfig, out: Path, now: str,
    stats: StageStats, progress: TextIO,
) -> list[Record]:  # fmt: skip
    from builder.pipeline import SCENARIOS, open_resources
    from builder.stages.scenarios import slot_methods
    from builder.stages.scenarios.families import slot_families

    methods = slot_methods(config.scenarios.method, slot_families(config.scenarios.per_environment,
                                                                  config.scenarios.families))  # fmt: skip
    done: list[int] = []

    def on_slot(slot: int, method: str, made: list[Scenario] | Rejection) -> None:
        done.append(slot)
        verdict = f"rejected: {made.reason}: {made.detail[:160]}" if isinstance(made, Rejection) else "verified"
        print(f"[{len(done)}/{len(methods)}] slot {slot} ({method}): {verdict}", file=progress, flush=True)

    with ExitStack() as stack:
        # The pipeline's own resources: the model started on its first call, the sandbox, the blocking threads.
        resources = open_resources(config, out, stack)
        ctx = resources.context(config, config_hash(config), out, stats)
        loaded, problems = await asyncio.to_thread(
            load_state, ctx.sandbox, env.code, state, now=now, seed=scenario_seed(env.id, now)
        )
        if loaded is None or problems:
            raise BuilderError(f"the state in {state_path} does not work in {env.name}:\n- " + "\n- ".join(problems))
        counts = Counter(methods)
        print(f"{env.name}: {len(methods)} slots ({', '.join(f'{n} {m}' for m, n in counts.items())})",
              file=progress, flush=True)  # fmt: skip
        try:
            # The stage function, as the pipeline calls it, with every slot starting from the given state.
            return await SCENARIOS.fn(env, ctx, start=(loaded, now), on_slot=on_slot)
        except Rejected as verdict:
            raise BuilderError(f"{env.name}: {verdict.rejection.reason}: {verdict.rejection.detail}") from None
        except (LLMRequestError, ServerError, ServerUnreachable) as error:
            where = config.llm.url or (", ".join(config.llm.urls) if config.llm.urls else "the managed vLLM server")
            raise BuilderError(
                f"the model is unreachable ({where}): {error}\n"
                "The graph method needs it to word the requests: start it, name one with --llm-url URL or "
                "llm.url in --config, or word them without a model: --wording template."
            ) from None
        finally:
            await resources.aclose()


def _summary(stats: StageStats, kept: list[Scenario], target: Path, out: TextIO) -> None:
    slots = {record.verification.scenario_group for record in kept}
    print(f"{len(slots)} verified scenarios ({len(kept)} records, one per mode) in {target}", file=out)
    if stats.dropped:
        reasons = ", ".join(f"{reason} {count}" for reason, count in sorted(stats.dropped.items()))
        print(f"rejected slots: {reasons} (see {target.parent / 'rejections.jsonl'})", file=out)
    for method, entry in sorted(stats.report.methods.items()):
        cost = entry.per_verified or {}
        print(
            f"{method}: {entry.verified}/{entry.slots} slots verified, "
            f"{cost.get('calls', '-')} model calls and {cost.get('prompt_tokens', '-')} prompt tokens per "
            f"verified scenario, {entry.mean_chain_length or '-'} calls per gold"
            + (f", {entry.template_worded} worded by the template" if entry.template_worded else "")
            + (
                f", {entry.fell_back_to_llm} with no chain made by the llm method ({entry.fell_back_verified} verified)"
                if entry.fell_back_to_llm
                else ""
            ),
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
