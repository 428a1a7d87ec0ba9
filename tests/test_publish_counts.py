"""Export's kept and dropped counts (builder/publish/publish.py `export_counts`): every stored trajectory is
accounted for in the card's "export: sft" row."""

from __future__ import annotations

import polars as pl

from builder.publish.publish import export_counts


def test_every_stored_trajectory_is_kept_or_dropped_with_a_reason():
    frames = {
        "environments": pl.DataFrame({"env_id": ["e1", "e2", "e3"], "status": ["accepted", "accepted", "rejected"]}),
        # e1: 2 solved (1 in the sft rows, 1 left out by select) and 1 unsolved; e2 is rl; e3 was not accepted
        "trajectories": pl.DataFrame(
            {"env_id": ["e1", "e1", "e1", "e2", "e3"], "solved": [True, True, False, True, True]}
        ),
    }
    tables = {
        "environments": {"train": pl.DataFrame({"env_id": ["e1"]}), "rl": pl.DataFrame({"env_id": ["e2"]})},
        "sft": {"train": pl.DataFrame({"id": ["t1"]})},
    }
    sft = export_counts(frames, tables)["sft"]
    assert sft["in"] == 5 and sft["kept"] == 1
    assert sft["dropped"] == {
        "environment_not_accepted": 1, "environment_in_rl_split": 1, "unsolved": 1, "not_selected": 1,
    }  # fmt: skip
    assert sft["kept"] + sum(sft["dropped"].values()) == sft["in"]
