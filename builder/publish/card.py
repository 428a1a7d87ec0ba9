"""The dataset card: YAML front matter written with `datasets`' own helpers, body from a `dataset_cards/` template.

The front matter has `configs:` (data_files per split), `dataset_info` (features, num_bytes, num_examples),
license, tags and task categories; `datasets` reads it back without warnings and checks the row counts against it.
The body is `string.Template` text with `$placeholders` filled by the small renderers below, by `facts` (how the
release was made: tasks and rows, roles, reward, RL band, decontamination, reward audit) and by `snippets` (the
code the card shows, for the splits the release has; the CI runs every block of generated cards)"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from string import Template

import polars as pl
from datasets import Features, List, Value
from datasets.info import DatasetInfo, DatasetInfosDict
from datasets.splits import SplitDict, SplitInfo
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCardData

from builder.config import BuildConfig, HubConfig
from builder.publish import facts, snippets
from builder.publish.columns import COLUMN_DOCS, ROW_MEANING
from builder.publish.export import CONFIG_SPLITS, SplitFiles, features_of
from builder.publish.plots import TOOL_ROLES, tool_roles, value_label
from builder.publish.release import PublishError
from builder.publish.snippets import CHAT_TEMPLATE, DISTRIBUTION
from builder.publish.tokens import LENGTH_STEP, TokenStats
from builder.stats import StageStats
from builder.usage import Usage

# Package data (pyproject), so the card renders from an installed wheel as from a checkout.
TEMPLATE = Path(__file__).resolve().parents[1] / "dataset_cards" / "README.md.tmpl"
TAGS = ("agents", "tool-use", "environments", "synthetic", "reinforcement-learning", "builder")
TASK_CATEGORIES = ("reinforcement-learning", "text-generation")


@dataclass(frozen=True)
class CardInputs:
    """Everything the card shows, gathered by the publish step."""

    repo: str
    version: str
    previous_version: str | None
    config_hash: str
    builder_version: str
    license: str
    config: BuildConfig  # the run's: who played which role, the RL band, decontamination
    tables: dict[str, dict[str, pl.DataFrame]]
    files: dict[tuple[str, str], SplitFiles]
    plots: dict[str, str]
    history: list[dict]
    stats: dict[str, StageStats] = field(default_factory=dict)
    export_counts: dict[str, dict] = field(default_factory=dict)
    tokens: TokenStats | None = None
    endpoint: str | None = None  # the Hub the release is published to, when not the Hugging Face Hub


def render_card(inputs: CardInputs, template: Path = TEMPLATE) -> str:
    """The whole README.md: front matter, then the template's body with every placeholder filled."""
    tag = f"v{inputs.version}"
    try:
        body = _fill(Template(template.read_text(encoding="utf-8")), inputs, tag)
    except (KeyError, ValueError) as error:
        raise PublishError(f"card template {template}: bad or unknown placeholder {error}") from None
    return f"---\n{front_matter(inputs)}---\n\n{body}"


def _fill(template: Template, inputs: CardInputs, tag: str) -> str:
    present = published_splits(inputs.files)
    split = snippets.scenario_split(present)
    missing_rl = facts.missing_rl(inputs.config, inputs.stats, inputs.tables) if split != "rl" else ""
    repo = inputs.repo
    return template.substitute(
        title=repo.split("/")[-1],
        repo=repo,
        version=inputs.version,
        tag=tag,
        previous=f"`{inputs.previous_version}`" if inputs.previous_version else "none (first release)",
        config_hash=inputs.config_hash,
        builder_version=inputs.builder_version,
        license=inputs.license,
        contents=facts.contents(inputs.tables),
        summary_table=_summary_table(inputs.files),
        load_examples=snippets.load_examples(repo, tag, present),
        pinned_example=snippets.pinned_example(repo, inputs.version, present),
        hub_endpoint=hub_note(inputs.endpoint),
        distribution=DISTRIBUTION,
        columns=_columns(inputs.tables),
        stats=_stats(inputs.stats, inputs.export_counts),
        graphs=_graphs(inputs.tables),
        models=_models(inputs.tables),
        roles=facts.roles(inputs.config, inputs.stats, inputs.tables),
        reward=facts.REWARD,
        rl_band=facts.band(inputs.config, inputs.stats, inputs.tables),
        decontamination=facts.decontamination(inputs.config, inputs.stats),
        audit=facts.audit(inputs.stats),
        families=facts.families(inputs.stats, inputs.tables),
        tokens=_tokens(inputs.stats, inputs.tables),
        token_stats=_token_stats(inputs.tokens),
        sft_section=snippets.sft_section(repo, tag, inputs.tokens, present),
        grpo_section=snippets.grpo_section(repo, tag, split, missing_rl),
        another_trainer_section=snippets.another_trainer_section(repo, tag, split),
        rl_split=split or "rl",
        # The bare code, for templates written before the sections existed.
        sft_example=snippets.sft_example(repo, tag, inputs.tokens),
        grpo_example=snippets.grpo_example(repo, tag, split or "rl"),
        chat_template=CHAT_TEMPLATE,
        plots="\n\n".join(f"**{title}**\n\n![{title}]({path})" for title, path in inputs.plots.items()),
        changelog=_changelog(inputs.history),
    )


def front_matter(inputs: CardInputs) -> str:
    """The YAML header, shaped exactly like the one `push_to_hub` writes."""
    rows = sum(files.num_examples for files in inputs.files.values())
    card = DatasetCardData(
        license=inputs.license,
        pretty_name=inputs.repo.split("/")[-1],
        tags=list(TAGS),
        task_categories=list(TASK_CATEGORIES),
        size_categories=[_size_category(rows)],
    )
    present = published_splits(inputs.files)
    configs = {
        config: {"data_files": [{"split": split, "path": f"data/{config}/{split}-*"} for split in splits]}
        for config, splits in present.items()
    }
    MetadataConfigs(configs).to_dataset_card_data(card)
    infos = {}
    for config, splits in present.items():
        split_dict = SplitDict()
        for split in splits:
            files = inputs.files[(config, split)]
            split_dict.add(SplitInfo(name=split, num_bytes=files.num_bytes, num_examples=files.num_examples))
        infos[config] = DatasetInfo(
            config_name=config,
            features=features_of(inputs.tables[config][splits[0]].schema),
            splits=split_dict,
            download_size=sum(inputs.files[(config, split)].download_size for split in splits),
            dataset_size=sum(inputs.files[(config, split)].num_bytes for split in splits),
        )
    DatasetInfosDict(infos).to_dataset_card_data(card)
    return card.to_yaml() + "\n"


def published_splits(files: dict[tuple[str, str], SplitFiles]) -> dict[str, list[str]]:
    """`{config: [split, ...]}` of the splits that have rows; empty splits and configs are left out of the card."""
    present: dict[str, list[str]] = {}
    for config, splits in CONFIG_SPLITS.items():
        with_rows = [split for split in splits if files[(config, split)].num_examples]
        if with_rows:
            present[config] = with_rows
    return present


def _size_category(rows: int) -> str:
    for limit, label in ((1_000, "n<1K"), (10_000, "1K<n<10K"), (100_000, "10K<n<100K"), (1_000_000, "100K<n<1M")):
        if rows < limit:
            return label
    return "1M<n<10M" if rows < 10_000_000 else "10M<n<100M"


def _summary_table(files: dict[tuple[str, str], SplitFiles]) -> str:
    return "\n".join(
        f"| `{config}` | `{split}` | {files[(config, split)].num_examples or '0 (not in this release)'} | "
        f"{ROW_MEANING[config]} |"
        for config, splits in CONFIG_SPLITS.items()
        for split in splits
    )


def hub_endpoint(hub: HubConfig, backend: str | None = None) -> str | None:
    """The address `HF_ENDPOINT` must have for a release published with `backend` (default hub.backend): the
    local Hub's (`hub serve` on hub.host:hub.port) for `git`, None (the Hugging Face Hub) for `hf`."""
    return f"http://{hub.host}:{hub.port}" if (backend or hub.backend) == "git" else None


def hub_note(endpoint: str | None) -> str:
    """How to point `datasets` and `huggingface_hub` at the Hub the release is on (`HF_ENDPOINT`)."""
    if endpoint is None:
        return (
            "The examples load from the Hugging Face Hub. To load from another Hub (a mirror, or builder's local "
            "Hub, `python -m builder hub serve`), set `HF_ENDPOINT` to its address before `datasets` or "
            "`huggingface_hub` is imported."
        )
    return (
        f"This release is on a local Hub, served by `python -m builder hub serve` at {endpoint}: point `datasets` "
        f"and `huggingface_hub` at it with `export HF_ENDPOINT={endpoint}` (from another machine, that machine's "
        "address) before either is imported. Without it they ask the Hugging Face Hub, which does not have it."
    )


def _columns(tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    sections = []
    for config, splits in CONFIG_SPLITS.items():
        features = features_of(tables[config][splits[0]].schema)
        rows = [
            f"| `{name}` | {type_name(feature)} | {COLUMN_DOCS[config][name]} |" for name, feature in features.items()
        ]
        sections.append(f"### `{config}`\n\n| column | type | meaning |\n|---|---|---|\n" + "\n".join(rows))
    return "\n\n".join(sections)


def type_name(feature: object) -> str:
    """A short type for the columns table: `string`, `list<string>`, `struct`, `list<struct>`."""
    if isinstance(feature, Value):
        return feature.dtype
    if isinstance(feature, List):
        return f"list<{type_name(feature.feature)}>"
    if isinstance(feature, dict | Features):
        return "struct"
    return type(feature).__name__


def _stats(stats: dict[str, StageStats], export_counts: dict[str, dict]) -> str:
    rows = ["| stage | in | kept | dropped | dropped by reason |", "|---|---|---|---|---|"]
    for item in stats.values():
        rows.append(f"| {item.stage} | {item.inputs} | {item.kept} | {item.dropped_total} | {_reasons(item.dropped)} |")
    for name, counts in export_counts.items():
        dropped = counts["dropped"]
        rows.append(
            f"| export: {name} | {counts['in']} | {counts['kept']} | {sum(dropped.values())} | {_reasons(dropped)} |"
        )
    note = (
        "\n\nThe stage rows are the run that exported this release; the export rows count the store it was built "
        "from, which also holds what earlier runs kept."
        if stats
        else "\n\nThe pipeline's own stage statistics were not given to this release (no `stats.json`)."
    )
    return "\n".join(rows) + note


def _reasons(dropped: dict[str, int]) -> str:
    return ", ".join(f"{reason}: {count}" for reason, count in sorted(dropped.items()) if count) or "–"


def _graphs(tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """Per split: environments with a tool graph, their tools by data edges, and edges by kind."""
    rows = ["| split | environments with a graph | tools | " + " | ".join(TOOL_ROLES) + " | data edges | state edges |",
            "|---|---|---|" + "---|" * len(TOOL_ROLES) + "---|---|"]  # fmt: skip
    for split, frame in tables["environments"].items():
        graphs = [json.loads(text) for text in frame["graph"].drop_nulls().to_list()]
        roles = sum((tool_roles(graph) for graph in graphs), Counter())
        kinds = Counter(edge["kind"] for graph in graphs for edge in graph["edges"])
        cells = [f"`{split}`", f"{len(graphs)} of {frame.height}", sum(roles.values())]
        cells += [roles[role] for role in TOOL_ROLES] + [kinds["data"], kinds["state"]]
        rows.append("| " + " | ".join(str(cell) for cell in cells) + " |")
    return "\n".join(rows)


def _models(tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    uses: Counter[tuple[str, str, str]] = Counter()
    for config in ("environments", "scenarios"):
        for frame in tables[config].values():
            for provenance in frame["provenance"].to_list():
                uses[(config, provenance["model"] or "–", _sampling(provenance["sampling"]))] += 1
    for row in tables["sft"]["train"].select("model", "sampling").to_dicts():
        uses[("sft (agent)", row["model"], _sampling(row["sampling"]))] += 1
    if not uses:
        return "No rows, so no models."
    lines = ["| rows of | model | sampling | rows |", "|---|---|---|---|"]
    lines += [
        f"| {kind} | `{model}` | {sampling} | {count} |" for (kind, model, sampling), count in sorted(uses.items())
    ]
    return "\n".join(lines)


def _sampling(sampling: dict | None) -> str:
    if not sampling:
        return "server default"
    return ", ".join(f"{key}={value}" for key, value in sampling.items() if value is not None) or "server default"


def _tokens(stats: dict[str, StageStats], tables: dict[str, dict[str, pl.DataFrame]]) -> str:
    """The cost figures, by the one ledger rule of `usage.Usage`: calls and tokens are what the server answered
    in the run; replies its cache replayed (an interrupted attempt's) count as cached calls only."""
    published = sum((Usage.model_validate(item) for item in tables["sft"]["train"]["usage"].to_list()), Usage())
    lines = [
        f"The published `sft` trajectories took {published.calls:,} model calls: {published.prompt_tokens:,} "
        f"prompt and {published.completion_tokens:,} completion tokens."
    ]
    if stats:
        run = sum((item.usage for item in stats.values()), Usage())
        lines.append(
            f"The whole run made {run.calls:,} model calls: {run.prompt_tokens:,} prompt and "
            f"{run.completion_tokens:,} completion tokens (failed and dropped work included); "
            f"{run.cached_calls:,} more were answered from its response cache and cost nothing, "
            f"and {run.failed_calls:,} failed."
        )
    return " ".join(lines)


def _token_stats(tokens: TokenStats | None) -> str:
    if tokens is None:
        return (
            "Token lengths were not measured for this release (the embedded tokenizer was not available where it was "
            "exported); the SFT example below uses `max_length=4096`."
        )
    if not tokens.lengths:
        return "This release has no `sft` rows."
    figures = [("rows", len(tokens.lengths)), ("min", min(tokens.lengths)), ("median", tokens.quantile(0.5)),
               ("p90", tokens.quantile(0.9)), ("max", max(tokens.lengths)),
               ("mean", value_label(sum(tokens.lengths) / len(tokens.lengths)))]  # fmt: skip
    header = "| " + " | ".join(name for name, _ in figures) + " |"
    rule = "|" + "---|" * len(figures)
    values = "| " + " | ".join(f"{value:,}" if isinstance(value, int) else value for _, value in figures) + " |"
    return (
        f"Tokens per `sft` row (messages and tools rendered by the packaged template `{CHAT_TEMPLATE}`, counted "
        f"by the {tokens.tokenizer} tokenizer, as SFTTrainer tokenizes them):\n\n{header}\n{rule}\n{values}\n\n"
        f"`max_length={tokens.max_length}` (the longest row rounded up to a multiple of {LENGTH_STEP}) cuts no row; "
        "other tokenizers count differently, so recount with yours if it is not this one."
    )


def _changelog(history: list[dict]) -> str:
    return "\n\n".join(
        f"### {entry['version']}\n\n" + "\n".join(f"- {line}" for line in entry["changes"]) for entry in history
    )
