"""The command line: parse arguments and dispatch to one small function per subcommand.

Exit codes: 0 success, 1 failure, 2 usage error (bad arguments or config), 130/143 stopped by SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path

from builder import __version__
from builder.config import PROFILES, BuildConfig, config_hash, load_config, resolve_profile, to_toml
from builder.errors import BuilderError, ConfigError, RunError
from builder.run.executor import Interrupted
from builder.stats import load_stats, render_table

logger = logging.getLogger("builder")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def _add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, metavar="FILE", help="TOML config file, layered over the profile (default: none)"
    )
    parser.add_argument(
        "--profile",
        choices=PROFILES,
        default="auto",
        help="packaged base config under --config: cpu (embedded SmolLM2-135M, small evaluate N), gpu (Qwen3-8B, "
        "the paper's N), none (built-in defaults); auto (default) picks gpu when nvidia-smi lists a GPU, else cpu",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value, e.g. --set rollout.samples_per_scenario=4 (repeatable)",
    )
    parser.add_argument(
        "--llm-url",
        dest="overrides",
        action="append",
        type=lambda url: f"llm.url={url}",
        metavar="URL",
        help="use this OpenAI-compatible endpoint (…/v1) instead of starting vLLM (same as --set llm.url=URL)",
    )


def build_parser() -> argparse.ArgumentParser:
    from builder.pipeline import STAGES

    stage_names = [stage.name for stage in STAGES]
    parser = argparse.ArgumentParser(
        prog="python -m builder",
        description="Mass-produce executable, stateful, tool-interactive environments for training LLM agents, "
        "and publish them as a versioned Hugging Face dataset.",
    )
    parser.add_argument("--version", action="version", version=f"builder {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress details to stderr")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    run = commands.add_parser(
        "run",
        help="run the pipeline (resumes an existing run folder)",
        description=f"Run the pipeline stages in order ({' → '.join(stage_names)}) over a run folder. "
        "Finished work is never redone: rerunning the same command resumes after a crash or Ctrl-C.",
    )
    _add_config_options(run)
    run.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="run folder (default: <run.runs_root>/run-<config hash>, so the same config resumes the same run)",
    )
    which = run.add_mutually_exclusive_group()
    which.add_argument("--until", choices=stage_names, metavar="STAGE", help="stop after this stage")
    which.add_argument("--only", choices=stage_names, metavar="STAGE", help="run just this stage")
    run.set_defaults(handler=cmd_run)

    stats = commands.add_parser("stats", help="print the per-stage stats of a run folder")
    stats.add_argument("run_dir", type=Path, metavar="RUN_DIR")
    stats.add_argument("--json", action="store_true", help="print stats.json instead of a table")
    stats.set_defaults(handler=cmd_stats)

    config = commands.add_parser(
        "config",
        help="print the effective config as TOML, with every key documented",
        description="Validate the config (file plus --set overrides) and print it as TOML with its hash.",
    )
    _add_config_options(config)
    config.set_defaults(handler=cmd_config)
    bench_commands = _add_sandbox_commands(commands)

    serve = commands.add_parser(
        "serve",
        help="run the managed vLLM server in the foreground (Ctrl-C stops it)",
        description="Start the configured model's vLLM server as `run` would, print its URL, and keep it up.",
    )
    _add_config_options(serve)
    serve.add_argument("--run-dir", type=Path, metavar="DIR", help="server log folder (default: <runs_root>/serve)")
    serve.set_defaults(handler=cmd_serve)

    bench_llm = bench_commands.add_parser(
        "llm",
        help="is the client the bottleneck? (server vs client throughput, client overhead)",
        description="Measure raw server throughput and full-client-path throughput against one server "
        "(see docs/llm.md).",
    )
    _add_config_options(bench_llm)
    bench_llm.add_argument("--json", action="store_true", help="print one JSON object")
    bench_llm.add_argument("--requests", type=int, default=64, metavar="N", help="requests per phase (default 64)")
    bench_llm.set_defaults(handler=cmd_bench_llm)
    bench_rollout = bench_commands.add_parser(
        "rollout",
        help="episodes per second and the rollout machinery's share of wall time",
        description="Run many graded episodes against real sandbox sessions (scripted agent, or --real for the "
        "configured model, compared with the server's best on the same requests replayed without waiting "
        "on each other; see docs/rollouts.md).",
    )
    _add_config_options(bench_rollout)
    bench_rollout.add_argument("--json", action="store_true", help="print one JSON object")
    bench_rollout.add_argument("--episodes", type=int, default=200, metavar="N", help="episodes (default 200)")
    bench_rollout.add_argument(
        "--latency-ms", type=float, default=20.0, metavar="MS", help="scripted model reply time (default 20)"
    )
    bench_rollout.add_argument("--real", action="store_true", help="use the configured model server")
    bench_rollout.set_defaults(handler=cmd_bench_rollout)
    _add_release_commands(commands)
    return parser


def _add_sandbox_commands(commands: argparse._SubParsersAction) -> argparse._SubParsersAction:
    env = commands.add_parser("env", help="inspect and run one environment file in the sandbox")
    env_commands = env.add_subparsers(dest="env_command", metavar="ACTION", required=True)
    check = env_commands.add_parser("check", help="lint, load and call every tool; exit 1 on problems")
    check.add_argument("path", type=Path, metavar="ENV.py")
    check.add_argument("--state", type=Path, metavar="STATE.json", help="initial state (default: __init__'s)")
    check.add_argument("--json", action="store_true", help="print one JSON report")
    _add_now_option(check)
    _add_config_options(check)
    check.set_defaults(handler=cmd_env_check)
    schema = env_commands.add_parser("schema", help="print the tools as an OpenAI `tools` JSON list")
    schema.add_argument("path", type=Path, metavar="ENV.py")
    schema.set_defaults(handler=cmd_env_schema)
    replay = env_commands.add_parser("replay", help="run a list of calls from a state, then optional checks")
    replay.add_argument("path", type=Path, metavar="ENV.py")
    replay.add_argument("--state", type=Path, required=True, metavar="STATE.json")
    replay.add_argument("--calls", type=Path, required=True, metavar="CALLS.json")
    replay.add_argument("--checks", type=Path, metavar="CHECKS.py", help="file of check_*(initial, final) functions")
    replay.add_argument("--json", action="store_true", help="print one JSON object")
    _add_now_option(replay)
    _add_config_options(replay)
    replay.set_defaults(handler=cmd_env_replay)
    bench = commands.add_parser("bench", help="measure the runtime on this machine")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    sandbox = bench_commands.add_parser("sandbox", help="tool-call, episode-start and check costs")
    sandbox.add_argument("--json", action="store_true", help="print one JSON object")
    _add_config_options(sandbox)
    sandbox.set_defaults(handler=cmd_bench_sandbox)
    return bench_commands


def _add_now_option(parser: argparse.ArgumentParser) -> None:
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

    sandbox_config = _config(args).sandbox
    return env_check(args.path, args.state, args.json, sandbox_config, now=args.now)


def cmd_env_schema(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_schema

    return env_schema(args.path)


def cmd_env_replay(args: argparse.Namespace) -> int:
    from builder.envs.commands import env_replay

    sandbox_config = _config(args).sandbox
    return env_replay(args.path, args.state, args.calls, args.checks, args.json, sandbox_config, now=args.now)


def cmd_bench_sandbox(args: argparse.Namespace) -> int:
    from builder.sandbox.bench import bench_sandbox

    return bench_sandbox(args.json, _config(args).sandbox)


def _add_release_commands(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a release folder (Hub layout, card, manifest) from the store, without publishing",
        description="Export the store to <hub.release_root>/<version>/: Parquet shards, dataset card, plots, "
        "release.json. The changelog is written against the repository's previous version.",
    )
    publish = commands.add_parser(
        "publish",
        help="export the store and publish it as a new tagged version",
        description="Export the store and publish it as version X (tag vX) to the local Hub (git) or the "
        "Hugging Face Hub (hf). An existing version is refused; a failed publish leaves earlier versions intact.",
    )
    for sub in (export, publish):
        _add_config_options(sub)
        sub.add_argument("--version", required=True, metavar="X", help="semantic version, e.g. 0.1.0")
        sub.add_argument("--repo", metavar="ORG/NAME", help="dataset repository (default: hub.repo)")
        sub.add_argument("--backend", choices=["git", "hf"], help="where to publish (default: hub.backend)")
        sub.add_argument("--run-dir", type=Path, metavar="DIR", help="run folder whose stats.json the card shows")
    publish.add_argument("--dry-run", action="store_true", help="export to a temporary folder, report, write nothing")
    export.set_defaults(handler=cmd_export)
    publish.set_defaults(handler=cmd_publish)

    hub = commands.add_parser("hub", help="the local Hub").add_subparsers(dest="hub_command", required=True)
    serve = hub.add_parser(
        "serve",
        help="serve the local Hub over the Hugging Face Hub API (olah, read-only) until Ctrl-C",
        description="Start olah over hub.root so that HF_ENDPOINT=http://HOST:PORT and "
        'load_dataset("ORG/NAME", "sft", revision="v0.1.0") work as against the real Hub.',
    )
    _add_config_options(serve)
    serve.add_argument("--host", help="address to listen on (default: hub.host)")
    serve.add_argument("--port", type=int, help="port (default: hub.port)")
    serve.set_defaults(handler=cmd_hub_serve)


def cmd_run(args: argparse.Namespace) -> int:
    from builder.pipeline import STAGES, run_pipeline

    config = _config(args)
    run_dir = args.run_dir or config.run.runs_root / f"run-{config_hash(config)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    _log_to_file(run_dir / "builder.log")
    logger.info(
        "builder %s: run folder %s, config %s, profile %s",
        __version__, run_dir, config_hash(config), resolve_profile(args.profile),
    )  # fmt: skip
    print(f"run folder: {run_dir}", file=sys.stderr)
    stats = asyncio.run(run_pipeline(config, run_dir, until=args.until, only=args.only))
    print(render_table(stats))
    print(f"\nstats: {run_dir / 'stats.json'}   log: {run_dir / 'builder.log'}")
    last_stage = STAGES[-1].name
    if config.hub.export_after_run and (args.only or args.until or last_stage) == last_stage:
        from builder.publish.publish import export_after_run
        from builder.publish.release import PublishError

        try:
            out, manifest = export_after_run(config, run_dir / "stats.json")
        except PublishError as error:
            print(f"no release candidate: {error}")
            return EXIT_OK
        logger.info("exported release candidate %s to %s", manifest["version"], out)
        print(f"release candidate {manifest['version']}: {out} ({_counts(manifest)})")
        print(f"publish it with: python -m builder publish --version {manifest['version']} --run-dir {run_dir}")
    return EXIT_OK


def cmd_stats(args: argparse.Namespace) -> int:
    path = args.run_dir / "stats.json"
    if not path.exists():
        raise RunError(f"{args.run_dir} has no stats.json (is it a run folder?)")
    if args.json:
        print(path.read_text(), end="")
    else:
        print(render_table(load_stats(path)))
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    config: BuildConfig = _config(args)
    profile = resolve_profile(args.profile)
    print(f"# builder {__version__}, config hash {config_hash(config)}, profile {profile} (--profile {args.profile})")
    print("# reload with: python -m builder run --profile none --config THIS_FILE\n")
    print(to_toml(config), end="")
    return EXIT_OK


def cmd_serve(args: argparse.Namespace) -> int:
    from builder.llm.connect import serve

    config = _config(args)
    return serve(config.llm, args.run_dir or config.run.runs_root / "serve")


def cmd_bench_llm(args: argparse.Namespace) -> int:
    from builder.llm.bench import bench_llm

    config = _config(args)
    print(bench_llm(config.llm, config.run.runs_root / "bench-llm", as_json=args.json, requests=args.requests))
    return EXIT_OK


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from builder.rollout.bench import main

    config = _config(args)
    run_dir = config.run.runs_root / "bench-rollout"
    print(main(config, run_dir, as_json=args.json, episodes=args.episodes, latency_ms=args.latency_ms, real=args.real))
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from builder.publish.publish import export_version

    config = _config(args)
    out, manifest = export_version(config, args.version, args.repo, args.backend, _stats_path(args))
    print(f"exported {manifest['tag']} to {out}: {_counts(manifest)}")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    from builder.publish.publish import publish

    config = _config(args)
    result = publish(
        config, args.version, repo=args.repo, backend=args.backend, dry_run=args.dry_run, stats_path=_stats_path(args)
    )
    if result.dry_run and result.tag_only:
        print(f"dry run: would tag commit {result.commit}, already on main, as {result.tag}; nothing written")
    elif result.dry_run:
        print(f"dry run: would publish {result.tag} to {result.location} ({len(result.files)} files); nothing written")
    elif result.tag_only:
        print(f"published {result.tag} to {result.location}: tagged commit {result.commit}, already on main")
    else:
        print(f"published {result.tag} to {result.location} (commit {result.commit})")
    print(f"rows: {_counts(result.manifest)}")
    print("changes: " + " ".join(result.manifest["changelog"][0]["changes"]))
    return EXIT_OK


def cmd_hub_serve(args: argparse.Namespace) -> int:
    from builder.publish.server import serve

    config = _config(args)
    host, port = args.host or config.hub.host, args.port or config.hub.port
    signum = serve(config.hub.root, host, port, config.hub.olah_python)
    print(f"stopped the local Hub ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def _config(args: argparse.Namespace) -> BuildConfig:
    return load_config(args.config, args.overrides, args.profile)


def _stats_path(args: argparse.Namespace) -> Path | None:
    if args.run_dir is None:
        return None
    path = args.run_dir / "stats.json"
    if not path.exists():
        raise RunError(f"{args.run_dir} has no stats.json (is it a run folder?)")
    return path


def _counts(manifest: dict) -> str:
    return ", ".join(f"{key}={count}" for key, count in manifest["counts"].items())


def _log_to_file(path: Path) -> None:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)


def _configure_console_logging(verbose: bool) -> None:
    console = logging.StreamHandler(sys.stderr)
    console.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    console.setLevel(logging.INFO if verbose else logging.WARNING)
    logger.addHandler(console)
    logger.setLevel(logging.INFO)


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
