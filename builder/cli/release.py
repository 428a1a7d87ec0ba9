"""`export`, `publish` and `hub serve`: the store as a versioned release, published to the local or the real Hub.

With `--run-dir RUN` a release is that run's: its config is the run's own (`RUN/config.json`, so its store,
splits and Hub settings), its folder is `RUN/release/<version>/` (the candidate the run printed), and a config
whose hash differs from the run's is refused unless `--force`.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path

from builder.cli.common import EXIT_OK, add_config_options, config_of, counts, stats_path
from builder.config import BuildConfig, config_hash, load_config
from builder.errors import ConfigError, RunError


def add_commands(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export",
        help="write a release folder (Hub layout, card, manifest) from the store, without publishing",
        description="Export the store to <hub.release_root>/<version>/ (with --run-dir: that run's store and "
        "config, into RUN/release/<version>/): Parquet shards, dataset card, plots, release.json. The changelog "
        "is written against the repository's previous version.",
    )
    publish = commands.add_parser(
        "publish",
        help="export the store and publish it as a new tagged version",
        description="Export the store and publish it as version X (tag vX) to the local Hub (git) or the "
        "Hugging Face Hub (hf). With --run-dir RUN, the run's own config (RUN/config.json) and candidate "
        "(RUN/release/X/). An existing version is refused; a failed publish leaves earlier versions intact.",
    )
    for sub in (export, publish):
        add_config_options(sub)
        sub.add_argument("--version", required=True, metavar="X", help="semantic version, e.g. 0.1.0")
        sub.add_argument("--repo", metavar="ORG/NAME", help="dataset repository (default: hub.repo)")
        sub.add_argument("--backend", choices=["git", "hf"], help="where to publish (default: hub.backend)")
        sub.add_argument(
            "--run-dir",
            type=Path,
            metavar="DIR",
            help="the run whose release this is: its config.json is the config (unless --config), its stats.json "
            "goes into the card, and the release folder is DIR/release/X/",
        )
        sub.add_argument(
            "--force",
            action="store_true",
            help="go on although the config's hash differs from the run's, the release folder holds another run's "
            "or config's release, or (publish) the store changed since the run's candidate was exported",
        )
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
    add_config_options(serve)
    serve.add_argument("--host", help="address to listen on (default: hub.host)")
    serve.add_argument("--port", type=int, help="port (default: hub.port)")
    serve.set_defaults(handler=cmd_hub_serve)


def cmd_export(args: argparse.Namespace) -> int:
    from builder.publish.publish import export_version

    config = release_config(args)
    out, manifest = export_version(
        config, args.version, args.repo, args.backend, _card_stats(args), run_dir=args.run_dir, force=args.force
    )
    print(f"exported {manifest['tag']} to {out}: {counts(manifest)}")
    return EXIT_OK


def cmd_publish(args: argparse.Namespace) -> int:
    from builder.publish.publish import publish

    config = release_config(args)
    result = publish(
        config,
        args.version,
        repo=args.repo,
        backend=args.backend,
        dry_run=args.dry_run,
        stats_path=_card_stats(args),
        run_dir=args.run_dir,
        force=args.force,
    )
    if result.dry_run and result.tag_only:
        print(f"dry run: would tag commit {result.commit}, already on main, as {result.tag}; nothing written")
    elif result.dry_run:
        print(f"dry run: would publish {result.tag} to {result.location} ({len(result.files)} files); nothing written")
    elif result.tag_only:
        print(f"published {result.tag} to {result.location}: tagged commit {result.commit}, already on main")
    else:
        print(f"published {result.tag} to {result.location} (commit {result.commit})")
    print(f"rows: {counts(result.manifest)}")
    print("changes: " + " ".join(result.manifest["changelog"][0]["changes"]))
    return EXIT_OK


def cmd_hub_serve(args: argparse.Namespace) -> int:
    from builder.publish.server import serve

    config = config_of(args)
    host, port = args.host or config.hub.host, args.port or config.hub.port
    signum = serve(config.hub.root, host, port, config.hub.olah_python)
    print(f"stopped the local Hub ({signal.Signals(signum).name})", file=sys.stderr)
    return 128 + signum


def release_config(args: argparse.Namespace) -> BuildConfig:
    """The config of an export or publish: without --run-dir the one the options name; with it the run's own
    (RUN/config.json under --set overrides, no profile: it is complete), or --config if given. A config whose
    hash is not the run's (its store and Hub settings may differ, nothing else) is refused unless --force.

    Raises:
        RunError: --run-dir is not a run folder, or the config's hash differs from the run's.
    """
    if args.run_dir is None:
        return config_of(args)
    run_config = args.run_dir / "config.json"
    try:
        expected = json.loads((args.run_dir / "run.json").read_text())["config_hash"]
    except (OSError, ValueError, KeyError, TypeError):
        raise RunError(f"{args.run_dir} is not a run folder (no readable run.json with a config_hash)") from None
    if args.config is not None:
        config = config_of(args)
    elif run_config.is_file():
        config = load_config(run_config, args.overrides, "none")
    else:
        raise ConfigError(f"{args.run_dir} has no config.json; name the run's config with --config")
    digest = config_hash(config)
    if digest != expected and not args.force:
        raise RunError(
            f"the config has hash {digest} but {args.run_dir} was made with {expected}: the release would not be "
            f"what the run made (its splits, stages or models differ). Drop --config and the --set overrides that "
            f"change it (store and hub settings may change), or pass --force to publish with this config"
        )
    return config


def _card_stats(args: argparse.Namespace) -> Path | None:
    """The stats.json of --run-dir, which the dataset card shows (None: no run folder named)."""
    return None if args.run_dir is None else stats_path(args.run_dir)
