"""`serve`: the managed vLLM server in the foreground, as `run` would start it."""

from __future__ import annotations

import argparse
from pathlib import Path

from builder.cli.common import add_config_options, config_of


def add_commands(commands: argparse._SubParsersAction) -> None:
    serve = commands.add_parser(
        "serve",
        help="run the managed vLLM server in the foreground (Ctrl-C stops it)",
        description="Start the configured model's vLLM server as `run` would, print its URL, and keep it up.",
    )
    add_config_options(serve)
    serve.add_argument("--run-dir", type=Path, metavar="DIR", help="server log folder (default: <runs_root>/serve)")
    serve.set_defaults(handler=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from builder.llm.connect import serve

    config = config_of(args)
    return serve(config.llm, args.run_dir or config.run.runs_root / "serve")
