"""`bench sandbox`, `bench llm`, `bench rollout`, `bench scale` and `bench pipeline`: measure the runtime, the model
client, the rollouts, the Ray executor and the whole pipeline on this machine."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from builder.cli.common import EXIT_OK, add_config_options, config_of


def add_commands(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser("bench", help="measure the runtime on this machine")
    bench_commands = bench.add_subparsers(dest="bench_command", metavar="WHAT", required=True)
    sandbox = bench_commands.add_parser(
        "sandbox", help="tool-call, episode-start and check costs, state sizes, a 2 KB vs 20 MB replay"
    )
    sandbox.add_argument("--json", action="store_true", help="print one JSON object")
    add_config_options(sandbox)
    sandbox.set_defaults(handler=cmd_bench_sandbox)

    llm = bench_commands.add_parser(
        "llm",
        help="is the client the bottleneck? (server vs client throughput, client overhead)",
        description="Measure raw server throughput and full-client-path throughput against one server "
        "(see docs/llm.md).",
    )
    add_config_options(llm)
    llm.add_argument("--json", action="store_true", help="print one JSON object")
    llm.add_argument("--requests", type=int, default=64, metavar="N", help="requests per phase (default 64)")
    llm.set_defaults(handler=cmd_bench_llm)

    rollout = bench_commands.add_parser(
        "rollout",
        help="episodes per second and the rollout machinery's share of wall time",
        description="Run many graded episodes against real sandbox sessions (scripted agent, or --real for the "
        "configured model, compared with the server's best on the same requests replayed without waiting "
        "on each other; see docs/rollouts.md).",
    )
    add_config_options(rollout)
    rollout.add_argument("--json", action="store_true", help="print one JSON object")
    rollout.add_argument("--episodes", type=int, default=200, metavar="N", help="episodes (default 200)")
    rollout.add_argument(
        "--latency-ms", type=float, default=20.0, metavar="MS", help="scripted model reply time (default 20)"
    )
    rollout.add_argument("--real", action="store_true", help="use the configured model server")
    rollout.set_defaults(handler=cmd_bench_rollout)

    scale = bench_commands.add_parser(
        "scale",
        help="items/s of a sandbox-heavy stage: local executor against 1 and 2 Ray actors",
        description="Scenario verification of a small environment, after one scripted model call of fixed "
        "latency per item, under the local executor and on 1 and 2 Ray actors (needs builder-envs[ray]; see the "
        "README, Running on a cluster).",
    )
    add_config_options(scale)
    scale.add_argument("--json", action="store_true", help="print one JSON object")
    scale.add_argument("--items", type=int, default=200, metavar="N", help="items per executor (default 200)")
    scale.add_argument(
        "--latency-ms", type=float, default=20.0, metavar="MS", help="scripted model reply time (default 20)"
    )
    scale.add_argument("--ray-address", metavar="ADDR", help="Ray cluster to use (default: executor.ray_address)")
    scale.set_defaults(handler=cmd_bench_scale)

    pipeline = bench_commands.add_parser(
        "pipeline",
        help="the whole pipeline over N environments with a scripted model: builder's own cost per environment",
        description="Collect to export over N environments with a scripted model whose latency is modeled on a "
        "vLLM server: non-model seconds per environment per stage, peak memory, store and release sizes, and a "
        "projection of environments and scenarios per 8-GPU day (see the README, The pipeline at scale).",
    )
    add_config_options(pipeline)
    pipeline.add_argument("--json", action="store_true", help="print one JSON object")
    pipeline.add_argument(
        "--envs",
        type=_sizes,
        default=[10],
        metavar="N[,N...]",
        help="environments (default 10); several sizes, e.g. 100,1000, run one after the other, each in a process of "
        "its own, and each is compared with the first",
    )
    pipeline.add_argument(
        "--latency-scale",
        type=float,
        default=None,
        metavar="X",
        help="the modeled model latency is slept times X (default 0.001)",
    )
    pipeline.set_defaults(handler=cmd_bench_pipeline)


def cmd_bench_sandbox(args: argparse.Namespace) -> int:
    from builder.sandbox.bench import bench_sandbox

    return bench_sandbox(args.json, config_of(args).sandbox)


def cmd_bench_llm(args: argparse.Namespace) -> int:
    from builder.llm.bench import bench_llm

    config = config_of(args)
    print(bench_llm(config.llm, config.run.runs_root / "bench-llm", as_json=args.json, requests=args.requests))
    return EXIT_OK


def cmd_bench_rollout(args: argparse.Namespace) -> int:
    from builder.rollout.bench import main

    config = config_of(args)
    run_dir = config.run.runs_root / "bench-rollout"
    print(main(config, run_dir, as_json=args.json, episodes=args.episodes, latency_ms=args.latency_ms, real=args.real))
    return EXIT_OK


def cmd_bench_scale(args: argparse.Namespace) -> int:
    from builder.bench_scale import bench_scale

    if args.ray_address is not None:
        args.overrides.append(f"executor.ray_address={args.ray_address}")
    config = config_of(args)
    run_dir = config.run.runs_root / "bench-scale"
    print(bench_scale(config, run_dir, items=args.items, latency_ms=args.latency_ms, as_json=args.json))
    return EXIT_OK


def cmd_bench_pipeline(args: argparse.Namespace) -> int:
    from builder.bench_pipeline import compare, render_sizes

    if len(args.envs) == 1:
        return _bench_pipeline_size(args, args.envs[0])
    # Each size in a fresh process: its peak memory and CPU time are its own, not the sum with the sizes before.
    sizes = [json.loads(_run_size(args, envs).splitlines()[-1]) for envs in args.envs]
    comparisons = compare(sizes)
    print(json.dumps({"sizes": sizes, "compared": comparisons}) if args.json else render_sizes(sizes, comparisons))
    return EXIT_OK


def _run_size(args: argparse.Namespace, envs: int) -> str:
    """`bench pipeline --envs <envs> --json` with this invocation's config options, in a process of its own."""
    command = [sys.executable, "-m", "builder", "bench", "pipeline", "--envs", str(envs), "--json"]
    command += ["--profile", args.profile] + (["--config", str(args.config)] if args.config else [])
    command += [part for override in args.overrides for part in ("--set", override)]
    if args.latency_scale is not None:
        command += ["--latency-scale", repr(args.latency_scale)]
    return subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True).stdout


def _bench_pipeline_size(args: argparse.Namespace, envs: int) -> int:
    from builder.bench_pipeline import LATENCY_SCALE, bench_overrides, bench_pipeline, render, write_seeds
    from builder.cli.run import log_to_file

    root = config_of(args).run.runs_root / f"bench-pipeline-{envs}"
    write_seeds(root, envs)  # a fresh folder: every stage runs, nothing resumed
    (root / "run").mkdir()
    log_to_file(root / "run" / "builder.log")  # as `run` logs: part of what the pipeline costs
    args.overrides[:0] = bench_overrides(root, envs)  # the user's own --set come after, and win
    scale = LATENCY_SCALE if args.latency_scale is None else args.latency_scale
    figures = bench_pipeline(config_of(args), root, envs, latency_scale=scale)
    print(json.dumps(figures) if args.json else render(figures))
    return EXIT_OK


def _sizes(text: str) -> list[int]:
    """`N` or `N,M,...`: each at least 1."""
    try:
        return [_at_least_one(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N or N,M,... (whole numbers), got {text!r}") from None


def _at_least_one(text: str) -> int:
    number = int(text)
    if number < 1:
        raise argparse.ArgumentTypeError(f"needs at least 1, got {number}")
    return number
