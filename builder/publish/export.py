"""Store → release tables: the three published configs, split by environment, written as bounded Parquet shards.

Configs and splits: `environments` and `scenarios` with `train` and `rl` (never sharing an environment), `sft`
with `train` only (verified trajectories of `train` environments). Column types are declared as `datasets`
features and the Arrow data is cast to them before writing, so `load_dataset` reads back exactly these types:
messages as structs, free-form JSON as strings, plain `string`/`list` rather than polars' large variants.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
from datasets import Features, List, Value

from builder.envs.lint import ContractError
from builder.envs.schema import inspect_source
from builder.envs.trainer import environment_contract
from builder.rollout.episode import INFRA_END_REASONS
from builder.splits import declared_split, is_rl_environment
from builder.views.code import policy_text

CONFIG_SPLITS: dict[str, tuple[str, ...]] = {
    "environments": ("train", "rl"),
    "scenarios": ("train", "rl"),
    "sft": ("train",),
}

ENVIRONMENT_COLUMNS = (
    "env_id", "name", "class_name", "description", "domain", "policy", "code", "code_sha256", "tools", "num_tools",
    "state_schema", "num_scenarios", "scores", "evaluation", "graph", "plan_id", "schema_version", "provenance",
)  # fmt: skip
SCENARIO_COLUMNS = (
    "scenario_id", "env_id", "mode", "method", "wording", "family", "task", "initial_state", "now", "user", "checklist",
    "checks", "answer_facts", "gold_actions", "difficulty", "difficulty_source", "num_rollouts", "pass_rate",
    "verification", "schema_version", "provenance",
)  # fmt: skip
# The published difficulty, from a scenario's measured pass rate when it has MIN_RATED_ROLLOUTS graded rollouts:
# easy at EASY_RATE or above, hard below HARD_RATE, else medium. Without them, the size of its gold sequence.
MIN_RATED_ROLLOUTS, EASY_RATE, HARD_RATE = 2, 0.8, 0.4
SFT_COLUMNS = (
    "trajectory_id", "scenario_id", "env_id", "mode", "messages", "tools", "reward", "checks_passed",
    "num_turns", "num_tool_calls", "end_reason", "model", "sampling", "usage", "schema_version", "provenance",
)  # fmt: skip


@dataclass(frozen=True)
class SplitFiles:
    """What was written for one config and split: shard paths relative to the release root, and sizes."""

    config: str
    split: str
    paths: tuple[str, ...]
    num_examples: int
    num_bytes: int
    download_size: int


def build_tables(
    environments: pl.DataFrame,
    scenarios: pl.DataFrame,
    trajectories: pl.DataFrame,
    selections: pl.DataFrame,
    rl_fraction: float,
) -> dict[str, dict[str, pl.DataFrame]]:
    """Release tables `{config: {split: frame}}` from the store's frames (schemas of `builder.tables.schema`).

    Only accepted environments are published, with their scenarios. What select chose is the release: `sft`
    holds the trajectories of the `sft` selections, the `rl` split of `scenarios` the scenarios of the `rl`
    selections (in the pass-rate band); a trajectory or an rl scenario select never chose is not published.
    A scenario's `pass_rate` is the one select measured for it, else (never judged) its graded rollouts'. The
    `tools` of environments and `sft` rows are derived from the environment's code (one convention, whatever
    the stored rows hold). Rows are sorted by id, so the same store always gives the same files.
    """
    envs = environments.filter(pl.col("status") == "accepted")
    envs = envs.with_columns(
        pl.struct("code", "tools").map_elements(_derived_tools, return_dtype=pl.String).alias("tools")
    )
    rl_ids = {
        env_id
        for env_id, provenance in zip(envs["id"].to_list(), envs["provenance"].to_list(), strict=True)
        if is_rl_environment(env_id, rl_fraction, declared_split(provenance))
    }
    scen = _scenario_table(scenarios.filter(pl.col("env_id").is_in(envs["id"].implode())), trajectories, selections)
    env = _environment_table(envs, scen)
    chosen = selections.filter(pl.col("kind") == "sft")["subject_id"].implode()
    published = trajectories.filter(pl.col("env_id").is_in(env["env_id"].implode()) & pl.col("id").is_in(chosen))
    sft = _sft_table(published.drop("tools").join(env.select("env_id", "tools"), on="env_id", how="left"))
    in_rl = pl.col("env_id").is_in(list(rl_ids))
    in_band = pl.col("scenario_id").is_in(selections.filter(pl.col("kind") == "rl")["subject_id"].implode())
    return {
        "environments": {"train": env.filter(~in_rl), "rl": env.filter(in_rl)},
        "scenarios": {"train": scen.filter(~in_rl), "rl": scen.filter(in_rl & in_band)},
        "sft": {"train": sft.filter(~in_rl)},
    }


def _environment_table(envs: pl.DataFrame, scenarios: pl.DataFrame) -> pl.DataFrame:
    counts = scenarios.group_by("env_id").agg(pl.len().cast(pl.Int64).alias("num_scenarios"))
    return (
        envs.rename({"id": "env_id"})
        .with_columns(
            pl.col("code").map_elements(_sha256, return_dtype=pl.String).alias("code_sha256"),
            pl.col("tools").map_elements(lambda text: len(json.loads(text)), return_dtype=pl.Int64).alias("num_tools"),
            # The rules the environment enforces, in plain language: what the agent's system prompt shows.
            pl.col("code").map_elements(policy_text, return_dtype=pl.String).alias("policy"),
        )
        .join(counts, on="env_id", how="left")
        .with_columns(pl.col("num_scenarios").fill_null(0))
        .select(ENVIRONMENT_COLUMNS)
        .sort("env_id")
    )


def _scenario_table(scenarios: pl.DataFrame, trajectories: pl.DataFrame, selections: pl.DataFrame) -> pl.DataFrame:
    # Graded rollouts only, as select counts them: an infrastructure end (LLM or sandbox failure, a leaking user
    # simulator) says nothing about the scenario's difficulty.
    graded = trajectories.filter(~pl.col("end_reason").is_in(sorted(INFRA_END_REASONS)))
    rates = graded.group_by("scenario_id").agg(
        pl.len().cast(pl.Int64).alias("num_rollouts"), pl.col("solved").cast(pl.Float64).mean().alias("pass_rate")
    )
    # Select's figures, where it judged the scenario: the rollouts of the run it judged, by the model that played
    # them (a store can hold a scenario's rollouts from several runs and models).
    judged = (
        selections.sort("id")
        .unique("scenario_id", keep="first")
        .select(
            "scenario_id",
            pl.col("num_rollouts").cast(pl.Int64).alias("judged_n"),
            pl.col("pass_rate").alias("judged_rate"),
        )
    )
    return (
        scenarios.rename({"id": "scenario_id"})
        .join(rates, on="scenario_id", how="left")
        .join(judged, on="scenario_id", how="left")
        .with_columns(
            pl.coalesce("judged_n", "num_rollouts", pl.lit(0, dtype=pl.Int64)).alias("num_rollouts"),
            pl.coalesce("judged_rate", "pass_rate").alias("pass_rate"),
        )
        .with_columns(_measured_difficulty())
        .select(SCENARIO_COLUMNS)
        .sort("scenario_id")
    )


def _measured_difficulty() -> list[pl.Expr]:
    """`difficulty` from the pass rate where enough rollouts measured it (`difficulty_source` "pass_rate"), else
    the one the scenario was made with, from its gold sequence's size (`difficulty_source` "gold")."""
    rated = pl.col("num_rollouts") >= MIN_RATED_ROLLOUTS
    rate = pl.col("pass_rate")
    measured = (
        pl.when(rate >= EASY_RATE)
        .then(pl.lit("easy"))
        .when(rate < HARD_RATE)
        .then(pl.lit("hard"))
        .otherwise(pl.lit("medium"))
    )
    return [
        pl.when(rated).then(measured).otherwise(pl.col("difficulty")).alias("difficulty"),
        pl.when(rated).then(pl.lit("pass_rate")).otherwise(pl.lit("gold")).alias("difficulty_source"),
    ]


def _sft_table(trajectories: pl.DataFrame) -> pl.DataFrame:
    messages = pl.col("messages")
    return (
        trajectories.rename({"id": "trajectory_id"})
        .with_columns(
            messages.list.eval(pl.element().struct.field("role") == "assistant")
            .list.sum()
            .cast(pl.Int64)
            .alias("num_turns"),
            messages.list.eval(pl.element().struct.field("tool_calls").list.len().fill_null(0))
            .list.sum()
            .cast(pl.Int64)
            .alias("num_tool_calls"),
        )
        .select(SFT_COLUMNS)
        .sort("trajectory_id")
    )


def _derived_tools(row: dict) -> str:
    """The tools as derived from the code now, sorted by name: rows stored under an older schema convention are
    published in the current one, and in the order TRL lists an environment's methods (`inspect.getmembers`), so
    the `tools` render into the same prompt as TRL's GRPO prompt (`builder.envs.schema`)."""
    try:
        tools = list(inspect_source(row["code"], environment_contract(row)).tools)
    except ContractError:  # accepted under an older contract: publish what was stored
        tools = json.loads(row["tools"])
    return json.dumps(sorted(tools, key=lambda tool: tool["function"]["name"]), ensure_ascii=False)


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ------------------------------------------------------------------------------------------------ features


_VALUES = {pl.String: "string", pl.Int64: "int64", pl.Float64: "float64", pl.Boolean: "bool"}


def features_of(schema: pl.Schema) -> Features:
    """The `datasets` features of a frame: what `load_dataset` will report for the published Parquet."""
    return Features({name: _feature(dtype) for name, dtype in schema.items()})


def _feature(dtype: pl.DataType) -> object:
    if isinstance(dtype, pl.List):
        return List(_feature(dtype.inner))
    if isinstance(dtype, pl.Struct):
        return {field.name: _feature(field.dtype) for field in dtype.fields}
    for polars_type, name in _VALUES.items():
        if dtype == polars_type:
            return Value(name)
    raise TypeError(f"no datasets feature for polars type {dtype}")


# ------------------------------------------------------------------------------------------------- writing


def write_split(frame: pl.DataFrame, root: Path, config: str, split: str, max_shard_bytes: int) -> SplitFiles:
    """Write one split as `data/<config>/<split>-NNNNN-of-NNNNN.parquet` shards of at most ~`max_shard_bytes`.

    An empty split writes nothing: `datasets` cannot load a split without rows ("corresponds to no data"), so
    the card leaves it out.
    """
    if frame.height == 0:
        return SplitFiles(config=config, split=split, paths=(), num_examples=0, num_bytes=0, download_size=0)
    features = features_of(frame.schema)
    table = frame.to_arrow().cast(features.arrow_schema)
    shards = max(1, math.ceil(table.nbytes / max_shard_bytes))
    rows_per_shard = max(1, math.ceil(table.num_rows / shards))
    folder = root / "data" / config
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(shards):
        relative = f"data/{config}/{split}-{index:05d}-of-{shards:05d}.parquet"
        pq.write_table(table.slice(index * rows_per_shard, rows_per_shard), root / relative)
        paths.append(relative)
    return SplitFiles(
        config=config,
        split=split,
        paths=tuple(paths),
        num_examples=table.num_rows,
        num_bytes=table.nbytes,
        download_size=sum((root / path).stat().st_size for path in paths),
    )


def write_tables(
    tables: dict[str, dict[str, pl.DataFrame]], root: Path, max_shard_bytes: int
) -> dict[tuple[str, str], SplitFiles]:
    """Write every config and split under `root`; returns what was written, keyed by (config, split)."""
    return {
        (config, split): write_split(frame, root, config, split, max_shard_bytes)
        for config, splits in tables.items()
        for split, frame in splits.items()
    }
