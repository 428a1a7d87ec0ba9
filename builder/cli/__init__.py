"""The command line: parse arguments and dispatch to one small function per subcommand.

Each module holds one group of commands, its parser and its handlers: `run` (run, stats, config), `imports`
(import envscaler|classes), `env`, `scenarios`, `bench`, `serve`, `release` (export, publish, hub serve); `common`
holds what they share.
Exit codes: 0 success, 1 failure, 2 usage error (bad arguments or config), 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from builder import __version__
from builder.cli import bench, env, imports, release, run, scenarios, serve
from builder.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, logger
from builder.errors import BuilderError, ConfigError
from builder.run.executor import Interrupted


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m builder",
        description="Mass-produce executable, stateful, tool-interactive environments for training LLM agents, "
        "and publish them as a versioned Hugging Face dataset.",
    )
    parser.add_argument("--version", action="version", version=f"builder {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for group in (run, imports, env, scenarios, bench, serve, release):  # in the order `--help` lists them
        group.add_commands(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # exits with 2 on usage errors
    _configure_console_logging(args.verbose)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # inside the try: a closed pipe surfaces here, not at interpreter exit
        return code
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except Interrupted as error:
        print(f"\n{error}", file=sys.stderr)
        return 128 + error.signum
    except BuilderError as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`... | head`): not an error; keep Python from complaining again at exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except Exception:
        logger.exception("unexpected error (a bug in builder; please report it with this traceback)")
        return EXIT_FAILURE


def _configure_console_logging(verbose: bool) -> None:
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.addHandler(console)
    logger.setLevel(logging.INFO)
