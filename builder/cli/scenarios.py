"""`scenarios`: verified scenarios for one environment file and a state, without running the pipeline."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.cli.common import add_config_options, config_of
from builder.cli.env import add_now_option


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
    scenarios.add_argument("-n", type=int, default=10, metavar="N", help="scenario slots to try (default 10)")
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
    from builder.errors import ConfigError
    from builder.stages.scenarios.standalone import scenarios_command

    if args.n < 1:
        raise ConfigError(f"-n must be at least 1, not {args.n}")
    args.overrides = [*args.overrides, f"scenarios.per_environment={args.n}"]
    if args.wording == "template" and args.method not in (None, "graph"):
        raise ConfigError(f"--wording template makes no model call, but the {args.method} method needs the model")
    method = "graph" if args.wording == "template" and args.method is None else args.method
    if method is not None:
        args.overrides.append(f'scenarios.method="{method}"')
    if args.wording is not None:
        args.overrides.append(f'scenarios.wording="{args.wording}"')
    out = args.out or Path(f"scenarios-{args.path.stem}")
    form = "parquet" if args.parquet else "jsonl"
    return scenarios_command(args.path, args.state, config_of(args), out, now=args.now, form=form)
