"""`import envscaler` and `import classes`: environments written elsewhere, re-verified into a run folder and the
store by the import stages (`builder.pipeline.import_stages`), then rolled out and selected like synthesized work;
the audit is printed and stored as `audit.json`."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import sys
from pathlib import Path

from builder import __version__
from builder.cli.common import EXIT_OK, add_config_options, config_of, logger
from builder.cli.run import export_candidate, log_to_file
from builder.config import config_hash
from builder.errors import RunError
from builder.stats import render_table

SOURCE_FILE = "import.json"  # which source a run folder imports: a rerun must name the same one


def add_commands(commands: argparse._SubParsersAction) -> None:
    parser = commands.add_parser(
        "import",
        help="import existing environments (EnvScaler's release, Python API classes), re-verified in the sandbox",
        description="Read environments written elsewhere, check them in the sandbox like synthesized ones (gates; "
        "imported scenarios re-verified), then roll out and select them. Lint problems are reported, not refused "
        "(the import contract); the sandbox is the boundary. Rerunning the same command resumes.",
    )
    formats = parser.add_subparsers(dest="format", metavar="FORMAT", required=True)
    envscaler = formats.add_parser(
        "envscaler",
        help="EnvScaler's released environments and scenarios",
        description="ENV_FILE: EnvScaler's environment metadata (JSON list, dict keyed by env_id, or JSON Lines), "
        "a folder `datasets` can load, or a Hugging Face dataset id (owner/name[@revision]).",
    )
    envscaler.add_argument("env_file", metavar="ENV_FILE")
    envscaler.add_argument(
        "--scenarios", nargs="+", default=[], metavar="FILE", help="scenario files (same forms as ENV_FILE)"
    )
    classes = formats.add_parser(
        "classes",
        help="Python modules of API classes (BFCL-style), one environment per module",
        description="Each module (or each *.py under a folder) is one environment: its last top-level class with "
        "public methods. NAME.state.json beside NAME.py is its default state.",
    )
    classes.add_argument("paths", nargs="+", metavar="PATH")
    for sub in (envscaler, classes):
        add_config_options(sub)
        sub.add_argument("--run-dir", type=Path, metavar="DIR", help="run folder (default: <run.runs_root>/"
                         "import-<hash of the config and the source revision>)")  # fmt: skip
        sub.add_argument(
            "--until", choices=("import", "vet", "verify", "rollout", "select"), metavar="STAGE",
            help="stop after this stage: import, vet (the gates), verify (the scenarios re-verified), rollout or "
            "select (the default)",
        )  # fmt: skip
        sub.add_argument("--dual-agent", action="store_true", help="also run evaluate's dual-agent check (model)")
        sub.add_argument(
            "--more-scenarios", action="store_true",
            help="also generate scenarios (model) for environments that brought their own",
        )  # fmt: skip
        sub.set_defaults(handler=cmd_import)


def cmd_import(args: argparse.Namespace) -> int:
    from builder.pipeline import import_stages, run_pipeline
    from builder.stages.imports.audit import render_audit, write_audit
    from builder.stages.imports.sources import read_classes, read_envscaler

    config = config_of(args)
    if args.format == "envscaler":
        source = read_envscaler(args.env_file, args.scenarios)
    else:
        source = read_classes(args.paths)
    pinned = {"format": source.kind, "location": source.location, "revision": source.revision}
    digest = hashlib.sha256(f"{config_hash(config)}\0{source.kind}\0{source.revision}".encode()).hexdigest()[:16]
    run_dir = args.run_dir or config.run.runs_root / f"import-{digest}"
    run_dir.mkdir(parents=True, exist_ok=True)
    _pin_source(run_dir / SOURCE_FILE, pinned)
    log_to_file(run_dir / "builder.log")
    logger.info("builder %s: import %s %s (%s) into %s", __version__, source.kind, source.location,
                source.revision, run_dir)  # fmt: skip
    print(f"run folder: {run_dir}", file=sys.stderr)
    stages = import_stages(source, dual_agent=args.dual_agent, more_scenarios=args.more_scenarios)
    try:
        stats = asyncio.run(run_pipeline(config, run_dir, until=args.until, stages=stages))
    finally:
        audit = write_audit(run_dir)  # also after a failure or Ctrl-C: it says what was found so far
        print(render_audit(audit))
        print(f"audit: {run_dir / 'audit.json'}")
    print(render_table(stats))
    print(f"\nstats: {run_dir / 'stats.json'}   log: {run_dir / 'builder.log'}")
    if (args.until or "select") == "select":
        export_candidate(config, run_dir)
    return EXIT_OK


def _pin_source(path: Path, pinned: dict[str, str]) -> None:
    """Record the source a run folder imports; a different source (or revision) there is refused."""
    if path.exists():
        recorded = json.loads(path.read_text())
        if recorded != pinned:
            raise RunError(
                f"{path.parent} imports {recorded['format']} {recorded['location']} at {recorded['revision']}, not "
                f"{pinned['location']} at {pinned['revision']}; use a new --run-dir"
            )
        return
    path.write_text(json.dumps(pinned, indent=2) + "\n")
