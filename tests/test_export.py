"""Export: environment-disjoint splits, column types `datasets` reads back exactly, bounded shards, the card."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import polars as pl
import pytest
import yaml

from builder.config import load_config
from builder.llm.weights import chatml_tools_template
from builder.publish.columns import COLUMN_DOCS
from builder.publish.export import CONFIG_SPLITS, build_tables, features_of, is_rl_environment, write_tables
from builder.publish.publish import export_release
from builder.publish.release import PublishError
from builder.usage import Usage

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from one_schema import assert_one_tool_schema  # noqa: E402
from release_store import fill_store  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"


def assert_golden(name: str, data: object) -> None:
    """Compare with tests/golden/<name>; UPDATE_GOLDEN=1 rewrites it (review the diff)."""
    path = GOLDEN / name
    text = json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    assert path.exists(), f"{path} is missing; run with UPDATE_GOLDEN=1 to create it"
    assert text == path.read_text(encoding="utf-8"), f"{name} differs from its golden; UPDATE_GOLDEN=1 refreshes it"


@pytest.fixture
def release_config(tmp_path):
    fill_store(tmp_path / "store")
    return load_config(
        None,
        [f"store.path={json.dumps(str(tmp_path / 'store'))}", "select.rl_env_fraction=0.3",
         f"hub.root={json.dumps(str(tmp_path / 'hub'))}", f"hub.release_root={json.dumps(str(tmp_path / 'release'))}"],
    )  # fmt: skip


def tables_of(config):
    from builder.store import Store

    store = Store(config.store.path)
    frames = [store.read_frame(name) for name in ("environments", "scenarios", "trajectories", "selections")]
    return build_tables(*frames, rl_fraction=config.select.rl_env_fraction)


def test_split_is_deterministic_monotone_and_covers_the_extremes():
    ids = [f"env-{i:016x}" for i in range(200)]
    assert not any(is_rl_environment(env_id, 0.0) for env_id in ids)
    assert all(is_rl_environment(env_id, 1.0) for env_id in ids)
    low = {env_id for env_id in ids if is_rl_environment(env_id, 0.2)}
    high = {env_id for env_id in ids if is_rl_environment(env_id, 0.5)}
    assert low <= high  # raising the fraction only moves environments from train to rl
    assert 20 <= len(low) <= 60 and 70 <= len(high) <= 130
    assert low == {env_id for env_id in ids if is_rl_environment(env_id, 0.2)}


def test_export_schema_matches_golden(release_config):
    tables = tables_of(release_config)
    schemas = {  # a list per config, so the golden keeps the column order
        config: [[name, feature] for name, feature in features_of(tables[config][splits[0]].schema).to_dict().items()]
        for config, splits in CONFIG_SPLITS.items()
    }
    assert_golden("export_features.json", schemas)
    for config, splits in CONFIG_SPLITS.items():
        assert {tables[config][split].schema == tables[config][splits[0]].schema for split in splits} == {True}


def test_splits_never_share_an_environment_and_sft_is_verified_train_only(release_config):
    tables = tables_of(release_config)
    train = set(tables["environments"]["train"]["env_id"])
    rl = set(tables["environments"]["rl"]["env_id"])
    assert train and rl and not train & rl
    assert len(train | rl) == 3  # the rejected environment is not published
    assert set(tables["scenarios"]["train"]["env_id"]) <= train
    assert set(tables["scenarios"]["rl"]["env_id"]) <= rl
    sft = tables["sft"]["train"]
    assert sft.height == 4 and set(sft["env_id"]) <= train and sft["reward"].to_list() == [1.0] * 4
    assert sft["num_turns"].to_list() == [2] * 4 and sft["num_tool_calls"].to_list() == [1] * 4
    scenarios = pl.concat(list(tables["scenarios"].values()))
    assert scenarios["pass_rate"].to_list() == [0.5] * 6 and scenarios["num_rollouts"].to_list() == [2] * 6


def test_published_tools_are_what_trl_derives_though_the_store_holds_an_older_form(release_config):
    # The fixture store holds hand-written schemas of the old form (no descriptions, no return): the release
    # derives them from the code, for environments and sft rows alike.
    from builder.store import Store

    stored = Store(release_config.store.path).read_frame("environments")
    assert all('"return":' not in text for text in stored["tools"].to_list())
    tables = tables_of(release_config)
    environments = pl.concat(list(tables["environments"].values())).to_dicts()
    assert assert_one_tool_schema(environments, tables["sft"]["train"].to_dicts()) == 9
    assert all('"return":' in row["tools"] for row in environments)


def test_pass_rate_counts_graded_rollouts_only_as_select_does(release_config):
    from builder.store import Store

    store = Store(release_config.store.path)
    failed = [  # the model server fell over mid-episode: no verdict on the scenario
        t.model_copy(update={"sample_index": 9, "end_reason": "llm_error", "solved": False, "reward": 0.0})
        for t in store.trajectories()
        if t.sample_index == 0
    ]
    store.upsert("trajectories", failed)
    scenarios = pl.concat(list(tables_of(release_config)["scenarios"].values()))
    assert scenarios["pass_rate"].to_list() == [0.5] * 6 and scenarios["num_rollouts"].to_list() == [2] * 6


def test_every_published_column_is_documented(release_config):
    tables = tables_of(release_config)
    for config, splits in CONFIG_SPLITS.items():
        assert list(tables[config][splits[0]].columns) == list(COLUMN_DOCS[config])


def test_shards_are_bounded_and_read_back_whole(release_config, tmp_path):
    tables = tables_of(release_config)
    files = write_tables(tables, tmp_path / "out", max_shard_bytes=1500)
    sft = files[("sft", "train")]
    assert len(sft.paths) > 1 and sft.paths[0].endswith(f"-00000-of-{len(sft.paths):05d}.parquet")
    back = pl.concat([pl.read_parquet(tmp_path / "out" / path) for path in sft.paths])
    assert back["trajectory_id"].to_list() == tables["sft"]["train"]["trajectory_id"].to_list()
    assert files[("environments", "rl")].num_examples == 1


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_release_loads_with_datasets_exactly_and_without_warnings(release_config, tmp_path):
    from datasets import load_dataset

    out = tmp_path / "release" / "0.1.0"
    manifest = export_release(release_config, "0.1.0", out)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    infos = {info["config_name"]: info for info in front["dataset_info"]}
    warnings = _Warnings()
    logging.getLogger("datasets").addHandler(warnings)
    try:
        for config, splits in CONFIG_SPLITS.items():
            loaded = load_dataset(str(out), config, cache_dir=str(tmp_path / "cache"))
            assert sorted(loaded) == sorted(splits)
            for split in splits:
                assert loaded[split].num_rows == manifest["counts"][f"{config}/{split}"]
                assert loaded[split].features.to_dict() == _yaml_features(infos[config]["features"])
    finally:
        logging.getLogger("datasets").removeHandler(warnings)
    assert warnings.messages == []
    message = loaded["train"][0]["messages"][2]
    assert message["content"] is None and message["tool_calls"][0]["function"]["arguments"] == '{"item_id": "i0"}'
    assert json.loads(loaded["train"][0]["tools"])[0]["type"] == "function"


def _yaml_features(yaml_features: list[dict]) -> dict:
    from datasets import Features

    return Features._from_yaml_list(yaml_features).to_dict()


def test_card_has_every_section_and_its_plots_exist(release_config, tmp_path):
    out = tmp_path / "release" / "0.1.0"
    export_release(release_config, "0.1.0", out)
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["license"] == "apache-2.0" and "reinforcement-learning" in front["task_categories"]
    assert [c["config_name"] for c in front["configs"]] == ["environments", "scenarios", "sft"]
    assert front["configs"][0]["data_files"][1] == {"split": "rl", "path": "data/environments/rl-*"}
    for heading in ("## Load it", "## Train with TRL", "### SFT", "### GRPO", "### Another trainer", "## Columns",
                    "### Kept and dropped", "### Tool dependency graphs", "### Models and sampling", "### Cost",
                    "## Plots",
                    "## Version and changelog"):  # fmt: skip
        assert heading in card
    assert "Environment code is code" in card and "$" not in card.replace("$ ", "")
    assert 'load_dataset("local/builder-envs", "sft", revision="v0.1.0")' in card
    assert "| export: environments | 4 | 3 | 1 | status_rejected: 1 |" in card
    assert "`agent-model` | temperature=1.0, max_tokens=512 | 4 |" in card
    plots = [line.split("](")[1].rstrip(")") for line in card.splitlines() if line.startswith("![")]
    assert len(plots) == 7 and all((out / plot).read_bytes()[:4] == b"\x89PNG" for plot in plots)
    assert "assets/token_lengths.png" in plots and "assets/tool_graphs.png" in plots
    assert (out / "chat_template.jinja").read_text() == chatml_tools_template().read_text()


def test_the_tool_graph_is_published_with_its_environment_and_summarized_in_the_card(release_config, tmp_path):
    from datasets import load_dataset

    from builder.envs.graph import ToolGraph
    from builder.store import Store

    out = tmp_path / "release" / "0.1.0"
    export_release(release_config, "0.1.0", out)
    stored = {env.id: env.graph for env in Store(release_config.store.path).environments("accepted")}
    published = {}
    for split in ("train", "rl"):
        rows = load_dataset(str(out), "environments", split=split, cache_dir=str(tmp_path / "cache"))
        assert rows.features["graph"].dtype == "string"
        published |= {row["env_id"]: row["graph"] for row in rows}
    assert published.keys() == stored.keys()
    for env_id, text in published.items():  # JSON of nodes and typed edges, as evaluate stored it; null without
        assert (text and ToolGraph.model_validate_json(text)) == stored[env_id]
    rl_graph = json.loads(next(text for env_id, text in published.items() if is_rl_environment(env_id, 0.3)))
    assert list(rl_graph) == ["nodes", "edges", "truncated"] and {e["kind"] for e in rl_graph["edges"]} == {
        "data",
        "state",
    }
    assert list(rl_graph["nodes"][0]) == ["name", "parameters", "reads", "writes"]
    card = (out / "README.md").read_text()
    # train: library_loans (borrow feeds its 2 other tools) and clinic_booking, evaluated before graphs were
    # stored; rl: bank_transfers (transfer feeds 3).
    assert "| split | environments with a graph | tools | feeds and is fed | feeds only | is fed only |" in card
    assert "| `train` | 1 of 2 | 3 | 0 | 1 | 2 | 0 | 2 | 2 |" in card
    assert "| `rl` | 1 of 1 | 4 | 0 | 1 | 3 | 0 | 3 | 3 |" in card


def test_tool_roles_count_each_tool_by_its_data_edges():
    from builder.publish.plots import tool_roles

    graph = {"nodes": [{"name": n} for n in "abcd"], "edges": [
        {"kind": "data", "source": "a", "target": "b"}, {"kind": "data", "source": "b", "target": "c"},
        {"kind": "state", "source": "a", "target": "d"},
    ]}  # fmt: skip
    assert tool_roles(graph) == {"feeds only": 1, "feeds and is fed": 1, "is fed only": 1, "no data edge": 1}
    assert tool_roles({"nodes": [{"name": "a"}], "edges": []}) == {"no data edge": 1}


def test_card_reports_token_lengths_and_the_max_length_that_cuts_none(release_config, tmp_path):
    from builder.publish.tokens import load_tokenizer, row_length

    out = tmp_path / "release" / "0.1.0"
    export_release(release_config, "0.1.0", out)
    card = (out / "README.md").read_text()
    sft = tables_of(release_config)["sft"]["train"]
    tokenizer = load_tokenizer()
    lengths = sorted(row_length(tokenizer, row["messages"], row["tools"]) for row in sft.to_dicts())
    assert len(lengths) == 4 and lengths[0] > 100  # the tools are in the system turn
    assert f"| {len(lengths)} | {lengths[0]:,} | {lengths[1]:,} | {lengths[-1]:,} | {lengths[-1]:,} |" in card
    assert "max_length=256," not in card and "max_length=512," in card  # the rows are ~400 tokens
    assert "SFTConfig(" in card and "GRPOTrainer(" in card and "tokenizer.response_template = qwen3_template" in card


def test_pass_rates_get_one_bar_per_value(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: F401 (the plots' backend)

    from builder.publish.plots import _value_bars, value_label

    figure = _value_bars(pl.Series([0.5, 1.0, 1.0, 1 / 3, 0.33333333, None]), "pass rate")
    axes = figure.axes[0]
    assert [patch.get_height() for patch in axes.patches] == [2, 1, 2]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["0.3333", "0.5", "1"]
    assert value_label(0.25) == "0.25" and value_label(3.0) == "3"


def test_card_shows_the_run_stats_when_given(release_config, tmp_path):
    from builder.stats import StageStats, save_stats

    usage = Usage(calls=5, cached_calls=3, failed_calls=1, prompt_tokens=1000, completion_tokens=200)
    stats = StageStats(stage="evaluate", inputs=10, kept=7, usage=usage)
    stats.dropped.update({"gold_fails": 2, "timeout": 1})
    save_stats(tmp_path / "stats.json", {"evaluate": stats})
    out = tmp_path / "release" / "0.1.0"
    export_release(release_config, "0.1.0", out, stats_path=tmp_path / "stats.json")
    card = (out / "README.md").read_text()
    assert "| evaluate | 10 | 7 | 3 | gold_fails: 2, timeout: 1 |" in card
    assert "5 model calls: 1,000 prompt and 200 completion tokens" in card
    assert "3 more were answered from its response cache and cost nothing, and 1 failed" in card


def test_empty_splits_are_left_out_of_the_card_and_the_rest_loads(release_config, tmp_path):
    from datasets import load_dataset

    config = release_config.model_copy(
        update={"select": release_config.select.model_copy(update={"rl_env_fraction": 0})}
    )
    manifest = export_release(config, "0.0.1", tmp_path / "out")
    shards = sorted(path.name for path in (tmp_path / "out" / "data" / "environments").glob("*.parquet"))
    assert manifest["counts"]["environments/rl"] == 0 and shards
    assert all(name.startswith("train-") for name in shards), shards  # no rl-* file at all
    assert "| `environments` | `rl` | 0 (not in this release) |" in (tmp_path / "out" / "README.md").read_text()
    loaded = load_dataset(str(tmp_path / "out"), "environments", cache_dir=str(tmp_path / "cache"))
    assert list(loaded) == ["train"] and loaded["train"].num_rows == 3
    empty = load_config(None, [f"store.path={json.dumps(str(tmp_path / 'empty'))}"])
    with pytest.raises(PublishError, match="nothing to release"):  # a dataset with no config is not published
        export_release(empty, "0.0.1", tmp_path / "empty-out")
    assert not (tmp_path / "empty-out").exists()


def test_difficulty_is_measured_from_pass_rates_and_the_policy_is_published(release_config):
    from builder.publish.export import EASY_RATE, HARD_RATE, MIN_RATED_ROLLOUTS

    tables = tables_of(release_config)
    scenarios = pl.concat([frame for frame in tables["scenarios"].values()], how="vertical_relaxed")
    assert "pass_rate" in set(scenarios["difficulty_source"])  # the fixture's scenarios were rolled out
    for row in scenarios.iter_rows(named=True):
        if row["num_rollouts"] >= MIN_RATED_ROLLOUTS:
            rate = row["pass_rate"]
            expected = "easy" if rate >= EASY_RATE else "hard" if rate < HARD_RATE else "medium"
            assert (row["difficulty"], row["difficulty_source"]) == (expected, "pass_rate"), row
        else:
            assert row["difficulty_source"] == "gold"
    environments = pl.concat([frame for frame in tables["environments"].values()], how="vertical_relaxed")
    assert environments["policy"].dtype == pl.String and all(p is not None for p in environments["policy"])


def test_a_scenario_rolled_out_too_few_times_keeps_the_difficulty_of_its_gold():
    from builder.publish.export import _measured_difficulty

    frame = pl.DataFrame({"num_rollouts": [0, 1, 2, 4, 4], "pass_rate": [None, 1.0, 1.0, 0.5, 0.25],
                          "difficulty": ["hard", "hard", "hard", "easy", "easy"]})  # fmt: skip
    out = frame.with_columns(_measured_difficulty())
    assert out["difficulty"].to_list() == ["hard", "hard", "easy", "medium", "hard"]
    assert out["difficulty_source"].to_list() == ["gold", "gold", "pass_rate", "pass_rate", "pass_rate"]
