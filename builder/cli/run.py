"""`run`, `stats` and `config`: run the pipeline over a run folder, show its stats, show the config it uses."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from pathlib import Path

from builder import __version__
from builder.cli.common import EXIT_OK, add_config_options, config_of, counts, logger, stats_path
from builder.config import BuildConfig, config_hash, resolve_profile, to_toml
from builder.stats import load_stats, render_table


def add_commands(commands: argparse._SubParsersAction) -> None:
    from builder.pipeline import STAGES

    stage_names = [stage.name for stage in STAGES]
    run = commands.add_parser(
        "run",
        help="run the pipeline (resumes an existing run folder)",
        description=f"Run the pipeline stages in order ({' → '.join(stage_names)}) over a run folder. "
        "Finished work is never redone: rerunning the same command resumes after a crash or Ctrl-C.",
    )
    add_config_options(run)
    run.add_argument(
        "--run-dir",
        type=Path,
        metavar="DIR",
        help="run folder (default: <run.runs_root>/run-<config hash>, so the same config resumes the same run)",
    )
    run.add_argument(
        "--executor",
        choices=("local", "ray"),
        help="where item stages run: local (default, this process) or ray (actors of a Ray cluster; see the "
        "README, Running on a cluster); same as --set executor.kind=KIND",
    )
    run.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="Ray cluster to join, e.g. 10.0.0.5:6379 (same as --set executor.ray_address=ADDR)",
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
    add_config_options(config)
    config.set_defaults(handler=cmd_config)


def cmd_run(args: argparse.Namespace) -> int:
    from builder.pipeline import STAGES, run_pipeline

    for key, value in (("kind", args.executor), ("ray_address", args.ray_address)):
        if value is not None:
            args.overrides.append(f"executor.{key}={value}")
    config = config_of(args)
    run_dir = args.run_dir or config.run.runs_root / f"run-{config_hash(config)}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log_to_file(run_dir / "builder.log")
    logger.info(
        "builder %s: run folder %s, config %s, profile %s",
        __version__, run_dir, config_hash(config), resolve_profile(args.profile),
    )  # fmt: skip
    print(f"run folder: {run_dir}", file=sys.stderr)
    stats = asyncio.run(run_pipeline(config, run_dir, until=args.until, only=args.only))
    print(render_table(stats))
    print(f"\nstats: {run_dir / 'stats.json'}   log: {run_dir / 'builder.log'}")
    if (args.only or args.until or STAGES[-1].name) == STAGES[-1].name:
        export_candidate(config, run_dir)
    return EXIT_OK


def export_candidate(config: BuildConfig, run_dir: Path) -> None:
    """After a run that reached its last stage: export a release candidate (with `hub.export_after_run`)."""
    if not config.hub.export_after_run:
        return
    from builder.publish.publish import export_after_run
    from builder.publish.release import PublishError

    try:
        out, manifest = export_after_run(config, run_dir / "stats.json")
    except PublishError as error:
        print(f"no release candidate: {error}")
        return
    logger.info("exported release candidate %s to %s", manifest["version"], out)
    print(f"release candidate {manifest['version']}: {out} ({counts(manifest)})")
    print(f"publish it with: python -m builder publish --version {manifest['version']} --run-dir {run_dir}")


def cmd_stats(args: argparse.Namespace) -> int:
    path = stats_path(args.run_dir)
    if args.json:
        print(path.read_text(), end="")
    else:
        print(render_table(load_stats(path)))
    return EXIT_OK


def cmd_config(args: argparse.Namespace) -> int:
    config: BuildConfig = config_of(args)
    profile = resolve_profile(args.profile)
    print(f"# builder {__version__}, config hash {config_hash(config)}, profile {profile} (--profile {args.profile})")
    print("# reload with: python -m builder run --profile none --config THIS_FILE\n")
    print(to_toml(config), end="")
    return EXIT_OK


def log_to_file(path: Path) -> None:
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    handler.setLevel(logging.INFO)
    logger.addHandler(handler)
