"""What every command shares: exit codes, the config options and loading the config they name."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from builder.config import PROFILES, BuildConfig, load_config
from builder.errors import RunError

logger = logging.getLogger("builder")

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2


def add_config_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="config file, layered over the profile: TOML, or a run folder's config.json (default: none)",
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


def config_of(args: argparse.Namespace) -> BuildConfig:
    """The config the command's --profile, --config, --set and --llm-url options name."""
    return load_config(args.config, args.overrides, args.profile)


def stats_path(run_dir: Path) -> Path:
    """The stats.json of a run folder; raises RunError if the folder has none."""
    path = run_dir / "stats.json"
    if not path.exists():
        raise RunError(f"{run_dir} has no stats.json (is it a run folder?)")
    return path


def counts(manifest: dict) -> str:
    """The row counts of a release manifest, as `sft=4, rl=2, ...`."""
    return ", ".join(f"{key}={count}" for key, count in manifest["counts"].items())
