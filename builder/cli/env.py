"""`env check`, `env schema`, `env graph`, `env replay`, and `reward`: one environment file, linted, loaded and
called in the sandbox."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.cli.common import add_config_options, config_of


def add_commands(commands: argparse._SubParsersAction) -> None:
    env = commands.add_parser("env", help="inspect and run one environment file in the sandbox")
    env_commands = env.add_subparsers(dest="env_command", metavar="ACTION", required=True)
    check = env_commands.add_parser("check", help="lint, load and call every tool; exit 1 on problems")
    check.add_argument("path", type=Path, metavar="ENV.py")
    check.add_argument("--state", type=Path, metavar="STATE.json", help="initial state (default: __init__'s)")
    check.add_argument("--json", action="store_true", help="print one JSON report")
    add_now_option(check)
    add_config_options(check)
    _add_contract_option(check)
    check.set_defaults(handler=cmd_env_check)
    schema = env_commands.add_parser("schema", help="print the tools as an OpenAI `tools` JSON list")
    schema.add_argument("path", type=Path, metavar="ENV.py")
    _add_contract_option(schema)
    schema.set_defaults(handler=cmd_env_schema)
    graph = env_commands.add_parser("graph", help="print the tool dependency graph (data and state edges)")
    graph.add_argument("path", type=Path, metavar="ENV.py")
    graph.add_argument("--state", type=Path, metavar="STATE.json", help="initial state (default: __init__'s)")
    form = graph.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_const", dest="form", const="json", help="print one JSON object")
    form.add_argument("--dot", action="store_const", dest="form", const="dot", help="print Graphviz DOT")
    add_now_option(graph)
    add_config_options(graph)
    _add_contract_option(graph)
    graph.set_defaults(handler=cmd_env_graph, form="text")
    replay = env_commands.add_parser("replay", help="run a list of calls from a state, then optional checks")
    replay.add_argument("path", type=Path, metavar="ENV.py")
    replay.add_argument("--state", type=Path, required=True, metavar="STATE.json")
    replay.add_argument("--calls", type=Path, required=True, metavar="CALLS.json")
    replay.add_argument("--checks", type=Path, metavar="CHECKS.py", help="file of check_*(initial, final) functions")
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    add_now_option(replay)
    add_config_options(replay)
    _add_contract_option(replay)
    replay.set_defaults(handler=cmd_env_replay)
    reward = commands.add_parser(
        "reward",
        help="the published reward of a call sequence on one scenario",
        description='Run CALLS (a JSON list of {"name", "arguments"}) on SCENARIO\'s initial state in the sandbox, '
        "at the scenario's date-time and seed, and print the published reward (what rollouts, the trainer API and "
        "the adapters give the same calls): 1 when every check and the collateral guard pass, 0 for no progress "
        "or for any change outside what the task allows, else the share of the checks that were false on the "
        "initial state and now pass (the answer check counted among them when the task asks to be told "
        "something: give the agent's answer with --answer). SCENARIO is a line of the scenarios.jsonl `python -m "
        "builder scenarios` writes, or a row of a release's `scenarios` config. Exit 1 for a bad file, a tool ENV.py "
        "lacks, or a scenario of another environment.",
    )
    reward.add_argument("path", type=Path, metavar="ENV.py")
    reward.add_argument("--scenario", type=Path, required=True, metavar="SCENARIO.json")
    reward.add_argument("--calls", type=Path, required=True, metavar="CALLS.json")
    reward.add_argument(
        "--answer", default="", metavar="TEXT",
        help="what the agent said (its final answer); graded against the scenario's answer_facts, if any",
    )  # fmt: skip
    reward.add_argument("--json", action="store_true", help='print one JSON object: "reward" and each check\'s result')
    add_config_options(reward)
    _add_contract_option(reward)
    reward.set_defaults(handler=cmd_reward)


def _add_contract_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--contract", choices=("strict", "import"), default="strict",
        help="strict (generated code, the default): any lint problem refuses the file; import (someone else's "
        "class): lint problems are counted warnings and the sandbox is the boundary",
    )  # fmt: skip


def add_now_option(parser: argparse.ArgumentParser) -> None:
    """`--now DATE-TIME`, the sandbox clock (also the `scenarios` command's)."""
    from builder.sandbox.world import DEFAULT_NOW

    parser.add_argument(
        "--now", type=_now_argument, default=DEFAULT_NOW, metavar="DATE-TIME",
        help=f"the sandbox clock's date-time, ISO 8601 local time (default {DEFAULT_NOW}; a scenario's `now`)",
    )  # fmt: skip


def _now_argument(text: str) -> str:
    from builder.sandbox.world import parse_now

    try:
        parse_now(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def cmd_env_check(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_check

    sandbox_config = config_of(args).sandbox
    return env_check(args.path, args.state, args.json, sandbox_config, now=args.now, contract=args.contract)


def cmd_env_schema(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_schema

    return env_schema(args.path, contract=args.contract)


def cmd_env_graph(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_graph

    return env_graph(args.path, args.state, args.form, config_of(args).sandbox, now=args.now, contract=args.contract)


def cmd_reward(args: argparse.Namespace) -> int:
    from builder.envs.reward_report import reward_report

    sandbox = config_of(args).sandbox
    return reward_report(
        args.path,
        args.scenario,
        args.calls,
        as_json=args.json,
        config=sandbox,
        contract=args.contract,
        answer=args.answer,
    )


def cmd_env_replay(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_replay

    sandbox_config = config_of(args).sandbox
    return env_replay(
        args.path, args.state, args.calls, args.checks, args.json, sandbox_config, now=args.now, contract=args.contract
    )
