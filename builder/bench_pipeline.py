"""`python -m builder bench pipeline --envs N`: the whole pipeline, collect to export, over N environments with a
scripted model, to measure builder's own cost per environment (sandbox, gates, store writes, export) and whether
it grows linearly, its peak memory, the store and release sizes, and what N environments would take on GPUs.

The model is scripted (`builder.bench_teacher`): N seed requests become N lending-desk environments, each with
its own code and id. Every reply waits as a vLLM server would take: prompt tokens / `PREFILL_TOK_S` + completion
tokens / `DECODE_TOK_S`, times `latency_scale` (default 0.001, so a run takes minutes rather than the model's
hours; the figure is printed). Token counts are the client's estimate (4 characters a token) of these replies,
which have a capable model's shape but no reasoning, and pass every gate at the first try.

Each stage's cost is given in wall seconds and in CPU seconds of builder and its sandbox workers (`builder.cpu`):
on a machine other jobs share, wall time stretches with their load and CPU time far less, so the CPU figures are
the ones to compare between sizes (`--envs 100,1000` runs each size in a process of its own and prints the ratios
against the first: `compare`).

The projection to an 8-GPU day uses the measured tokens per environment (prompt tokens not a repeated prefix,
completion tokens) and `GPU_PREFILL_TOK_S` / `GPU_DECODE_TOK_S`, an assumed throughput of one GPU stated with its
source below; it is arithmetic on those two figures, not a measurement. A second projection does the same
arithmetic at the tokens a capable model spent per environment in a recorded run (`CAPABLE_RUN`), since the
scripted replies are far shorter than a real model's.
"""

from __future__ import annotations

import asyncio
import json
import resource
import shutil
import time
from pathlib import Path
from typing import Any
from unittest import mock

from builder.bench_teacher import KINDS, PLACES, teacher
from builder.config import BuildConfig
from builder.cpu import process_tree_cpu_s
from builder.errors import RunError
from builder.llm import ChatRequest, Reply, TokenUsage, text_reply
from builder.pipeline import run_pipeline
from builder.stats import StageStats, prefix_reuse

# One request's latency on a busy vLLM server (per request, many in flight): the figures of one stream.
PREFILL_TOK_S = 5000.0
DECODE_TOK_S = 40.0
LATENCY_SCALE = 0.001
# One GPU's throughput for an 8B model under vLLM with many requests in flight. Decode: ~12,500 output tok/s for
# Llama 3.1 8B (bf16) on one H100 80GB (third-party vLLM benchmarks collected at
# https://www.morphllm.com/vllm-benchmarks, 2026). Prefill: 2 x 8e9 FLOP a token at ~40% of an H100's 989 dense
# bf16 TFLOP/s is ~25,000 tok/s, an estimate (no measured figure in this repository: the runs of
# docs/capable-model-runs.md went through a hand-served endpoint whose GPU was not ours to measure).
GPU_PREFILL_TOK_S = 25_000.0
GPU_DECODE_TOK_S = 12_500.0
GPU_SOURCE = (
    "assumed, per GPU, Qwen3-8B ~ Llama 3.1 8B: decode 12,500 tok/s (vLLM, 1x H100, "
    "https://www.morphllm.com/vllm-benchmarks), prefill 25,000 tok/s (FLOP estimate, 40% of H100 bf16 peak)"
)
GPUS, DAY_S = 8, 86_400
# The same projection at a capable model's tokens: run teacher-13 (docs/capable-model-runs.md, the gpu profile at
# N = 100, 2 environments: 1,930,020 prompt and 102,298 completion tokens, 32 scenario rows), with the 86% of its
# prompt text that repeated a prefix (builder's own figure for that run). The scripted replies here carry no
# reasoning and the scripted scenarios pass their gates at once, so the bench's own tokens are far fewer.
CAPABLE_RUN = {"prompt": 965_010, "completion": 51_149, "prefix_reuse": 0.863, "scenarios": 16.0}
CAPABLE_SOURCE = "run teacher-13, docs/capable-model-runs.md (tokens, scenarios, prefix reuse)"


# ------------------------------------------------------------------------------------------------ the seeds


def seed_requests(envs: int) -> list[str]:
    """N distinct seed requests, each naming its desk by number (the scripted miner reads it back); none near
    the scripted task, which the scenarios stage would drop as `copies_seed`."""
    return [
        f"Track renewals and returns for members of the {PLACES[i % len(PLACES)]} "
        f"{KINDS[i // len(PLACES) % len(KINDS)]}, lending desk number {i}, and list what is overdue"
        for i in range(envs)
    ]


def bench_overrides(root: Path, envs: int) -> list[str]:
    """The config the bench runs with (before the user's own --set): its seeds, folders and a scripted endpoint,
    every topic kept, and one scenario per environment (the scripted writer has one task to give)."""
    values = {
        "llm.url": "http://bench-pipeline.invalid/v1",
        "mine.seeds": root / "seeds.jsonl",
        "mine.max_seeds": envs,
        "mine.max_topics": envs,
        "mine.dedup_threshold": 1.0,  # the desks differ only by number: only a repeated name is a duplicate
        "scenarios.per_environment": 1,
        "rollout.samples_per_scenario": 2,
        "store.path": root / "store",
        "hub.root": root / "hub",
        "hub.release_root": root / "release",
        "hub.export_after_run": True,
    }
    return [f"{key}={value}" for key, value in values.items()]


def write_seeds(root: Path, envs: int) -> None:
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    (root / "seeds.jsonl").write_text("".join(json.dumps({"request": r}) + "\n" for r in seed_requests(envs)))


# --------------------------------------------------------------------------------------------- the model


class VLLMLike:
    """The scripted teacher behind a latency modeled on a vLLM server; it adds up the modeled seconds. It keeps
    no request (a `ScriptedModel` keeps them all, which would count in the peak memory)."""

    def __init__(self, latency_scale: float) -> None:
        self.latency_scale = latency_scale
        self.model_s = 0.0  # unscaled: what the requests would have taken on the server

    async def count_prompt_tokens(self, request: ChatRequest) -> int | None:
        return None  # the client estimates, as it does for a server that cannot count

    async def chat(self, request: ChatRequest) -> Reply:
        answer = teacher(request)
        reply = text_reply(answer) if isinstance(answer, str) else answer
        prompt_chars = sum(len(message.content or "") for message in request.messages)
        completion_chars = len(reply.content or "") + sum(len(c.function.arguments) for c in reply.tool_calls)
        usage = TokenUsage(prompt_tokens=max(1, prompt_chars // 4), completion_tokens=max(1, completion_chars // 4))
        seconds = usage.prompt_tokens / PREFILL_TOK_S + usage.completion_tokens / DECODE_TOK_S
        self.model_s += seconds
        await asyncio.sleep(seconds * self.latency_scale)
        return reply.model_copy(update={"usage": usage})


# ------------------------------------------------------------------------------------------------ the run


def _size(path: Path) -> int:
    return sum(file.stat().st_size for file in path.rglob("*") if file.is_file()) if path.exists() else 0


def _run(config: BuildConfig, run_dir: Path, model: VLLMLike) -> dict[str, StageStats]:
    """`run_pipeline` as `python -m builder run` calls it, the model behind `llm.url` being `model`: the client,
    the endpoint pool (pacing, prefix accounting) and the response cache are the real ones."""
    with mock.patch("builder.llm.connect.OpenAIChatModel", lambda *args, **kwargs: model):
        return asyncio.run(run_pipeline(config, run_dir))


def bench_pipeline(config: BuildConfig, root: Path, envs: int, *, latency_scale: float = LATENCY_SCALE) -> dict:
    """Run the pipeline and export over `root` (the folders of `bench_overrides(root, envs)`, seeds written by
    `write_seeds`) and return the figures."""
    from builder.publish.publish import export_after_run

    model = VLLMLike(latency_scale)
    run_dir = root / "run"
    started, started_cpu = time.monotonic(), process_tree_cpu_s()
    stats = _run(config, run_dir, model)
    export_started, export_started_cpu = time.monotonic(), process_tree_cpu_s()
    out, manifest = export_after_run(config, run_dir / "stats.json")
    export_s, export_cpu_s = time.monotonic() - export_started, process_tree_cpu_s() - export_started_cpu
    wall_s, cpu_s = time.monotonic() - started, process_tree_cpu_s() - started_cpu
    kept = stats["evaluate"].kept
    if kept == 0:
        raise RunError("bench pipeline: no environment was accepted; see the run folder's builder.log")
    per_env = {name: round(stage.wall_s / envs, 4) for name, stage in stats.items()}
    per_env["export"] = round(export_s / envs, 4)
    cpu_per_env = {name: round(stage.cpu_s / envs, 4) for name, stage in stats.items()}
    cpu_per_env["export"] = round(export_cpu_s / envs, 4)
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    slept_s = model.model_s * latency_scale
    usage = [stage.usage for stage in stats.values()]
    prompt_tokens = sum(u.prompt_tokens for u in usage)
    completion_tokens = sum(u.completion_tokens for u in usage)
    reuse = prefix_reuse(server for stage in stats.values() for server in stage.servers.values()) or 0.0
    scenarios = stats["scenarios"].kept
    measured = {"prompt": prompt_tokens / kept, "completion": completion_tokens / kept, "prefix_reuse": reuse,
                "scenarios": scenarios / kept}  # fmt: skip
    return {
        "envs": envs,
        "accepted_envs": kept,
        "scenarios": scenarios,
        "trajectories": stats["rollout"].kept,
        "latency_scale": latency_scale,
        "model_latency": {"prefill_tok_s": PREFILL_TOK_S, "decode_tok_s": DECODE_TOK_S},
        "wall_s": round(wall_s, 2),
        "model_s_modeled": round(model.model_s, 1),
        "model_s_slept": round(slept_s, 2),
        # A lower bound: the slept time is summed over requests in flight together.
        "non_model_s_per_env": round((wall_s - slept_s) / envs, 4),
        "stage_s_per_env": per_env,
        # CPU seconds of builder and its sandbox workers (builder/cpu.py), which other jobs on a shared machine
        # do not inflate as they do wall time; the scripted model's own work (answering a request) is in it.
        "cpu_s": round(cpu_s, 2),
        "cpu_s_per_env": round(cpu_s / envs, 4),
        "stage_cpu_s_per_env": cpu_per_env,
        "peak_rss_mb": {
            "builder": round(peak_mb, 1),
            "largest_child": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024, 1),
        },
        "peak_rss_mb_per_env": round(peak_mb / envs, 3),
        "store_bytes": _size(Path(config.store.path)),
        "release_bytes": _size(out),
        "release_version": manifest["version"],
        "tokens_per_env": {
            "prompt": round(prompt_tokens / kept),
            "completion": round(completion_tokens / kept),
            "prefix_reuse": round(reuse, 3),
        },
        "projection": {**_projection(measured), "throughput_source": GPU_SOURCE},
        "projection_capable_model": {**_projection(CAPABLE_RUN), "tokens_source": CAPABLE_SOURCE},
    }


def _projection(per_env: dict[str, float]) -> dict[str, Any]:
    """Environments and scenarios a day on `GPUS` GPUs at `per_env` tokens (prompt, completion, the prompt's share
    a repeated prefix, which the server's prefix cache does not prefill again) and scenarios per environment."""
    fresh_prompt = per_env["prompt"] * (1 - per_env["prefix_reuse"])
    gpu_s_per_env = fresh_prompt / GPU_PREFILL_TOK_S + per_env["completion"] / GPU_DECODE_TOK_S
    envs_per_day = GPUS * DAY_S / gpu_s_per_env
    return {
        "gpus": GPUS,
        "gpu_s_per_env": round(gpu_s_per_env, 2),
        "envs_per_day": round(envs_per_day),
        "scenarios_per_day": round(envs_per_day * per_env["scenarios"]),
    }


def render(figures: dict) -> str:
    """The figures as lines of text."""
    tokens, projection, rss = figures["tokens_per_env"], figures["projection"], figures["peak_rss_mb"]
    capable = figures["projection_capable_model"]
    lines = [
        f"{figures['envs']} environments ({figures['accepted_envs']} accepted, {figures['scenarios']} scenarios, "
        f"{figures['trajectories']} trajectories) in {figures['wall_s']:.1f} s; model latency scaled by "
        f"{figures['latency_scale']:g} ({figures['model_s_modeled']:.0f} s modeled, {figures['model_s_slept']:.1f} s "
        "slept)",
        f"non-model seconds per environment: {figures['non_model_s_per_env']:.3f} wall, "
        f"{figures['cpu_s_per_env']:.3f} CPU (builder and its sandbox workers)",
        "stage seconds per environment:      wall       CPU",
        *(
            f"  {name:<10} {seconds:>22.3f} {figures['stage_cpu_s_per_env'][name]:9.3f}"
            for name, seconds in figures["stage_s_per_env"].items()
        ),
        f"peak memory: builder {rss['builder']:.0f} MB ({figures['peak_rss_mb_per_env']:.2f} MB per environment), "
        f"largest child process {rss['largest_child']:.0f} MB",
        f"store {figures['store_bytes'] / 1e6:.2f} MB, release {figures['release_version']} "
        f"{figures['release_bytes'] / 1e6:.2f} MB",
        f"tokens per accepted environment: {tokens['prompt']} prompt ({tokens['prefix_reuse']:.0%} a repeated "
        f"prefix), {tokens['completion']} completion",
        f"projection on {projection['gpus']} GPUs: {projection['gpu_s_per_env']:.1f} GPU-s per environment, "
        f"{projection['envs_per_day']} environments and {projection['scenarios_per_day']} scenarios a day",
        f"  at a capable model's tokens: {capable['gpu_s_per_env']:.1f} GPU-s per environment, "
        f"{capable['envs_per_day']} environments and {capable['scenarios_per_day']} scenarios a day "
        f"({capable['tokens_source']})",
        f"  throughput: {projection['throughput_source']}",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------- several sizes at once


def compare(sizes: list[dict]) -> list[dict]:
    """Each size's cost per environment against the first's (the baseline): CPU and non-model wall seconds per
    environment, each stage's CPU, and the peak memory each environment past the baseline's adds."""
    base = sizes[0]
    rows = []
    for figures in sizes[1:]:
        extra_envs = figures["envs"] - base["envs"]
        extra_mb = figures["peak_rss_mb"]["builder"] - base["peak_rss_mb"]["builder"]
        rows.append({
            "envs": figures["envs"],
            "baseline_envs": base["envs"],
            "cpu_s_per_env_ratio": _ratio(figures["cpu_s_per_env"], base["cpu_s_per_env"]),
            "non_model_s_per_env_ratio": _ratio(figures["non_model_s_per_env"], base["non_model_s_per_env"]),
            "stage_cpu_ratio": {
                name: _ratio(seconds, base["stage_cpu_s_per_env"][name])
                for name, seconds in figures["stage_cpu_s_per_env"].items()
            },
            "peak_mb_per_extra_env": round(extra_mb / extra_envs, 3) if extra_envs else None,
        })  # fmt: skip
    return rows


def _ratio(value: float, base: float) -> float | None:
    return round(value / base, 3) if base else None


def render_sizes(sizes: list[dict], comparisons: list[dict]) -> str:
    """Every size's figures, then each against the first."""
    lines = [part for figures in sizes for part in (render(figures), "")]
    for row in comparisons:
        lines.append(
            f"{row['envs']} against {row['baseline_envs']} environments, cost per environment: "
            f"CPU {_times(row['cpu_s_per_env_ratio'])}, non-model wall {_times(row['non_model_s_per_env_ratio'])}; "
            f"peak memory {row['peak_mb_per_extra_env']:.2f} MB per extra environment"
        )
        lines.append(
            "  CPU per stage: " + ", ".join(f"{name} {_times(ratio)}" for name, ratio in row["stage_cpu_ratio"].items())
        )
    return "\n".join(lines)


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"
