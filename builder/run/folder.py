"""The run folder `runs/<run-id>/`: per stage a journal and two Parquet tables, plus run.json and stats.json.

The journal (`<stage>.journal.jsonl`) is the record of truth: a line per finished input, flushed at once, so
`kill -9` loses at most the inputs in flight. The tables (`<stage>.parquet`, kept; `<stage>.rejected.parquet`,
rejections) are its compaction, sorted by id, so reruns give identical files. Because the journal is kept, a
damaged table (a full disk, a copy cut short) is rebuilt from it; run folders made before journals were kept
(no `journals: whole` in run.json) say how to redo the stage instead.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import polars as pl

from builder import __version__
from builder.config import BuildConfig, config_hash
from builder.errors import RunError
from builder.records import Record, Rejection
from builder.tables import ROWS_PER_SLICE, from_frame, from_row, schema, to_row, write_parquet_atomic

logger = logging.getLogger(__name__)

INPUT_ID = "input_id"  # bookkeeping column of run-folder tables: which input a row came from
R = TypeVar("R", bound=Record)


@dataclass
class RunFolder:
    """Paths and state of `runs/<run-id>/`."""

    root: Path

    def table(self, stage: str) -> Path:
        return self.root / f"{stage}.parquet"

    def rejected(self, stage: str) -> Path:
        return self.root / f"{stage}.rejected.parquet"

    def journal(self, stage: str) -> Path:
        return self.root / f"{stage}.journal.jsonl"

    @property
    def state_path(self) -> Path:
        return self.root / "run.json"

    @property
    def stats_path(self) -> Path:
        return self.root / "stats.json"

    def state(self) -> dict:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {}

    def save_state(self, state: dict) -> None:
        tmp = self.root / ".run.json.tmp"
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.state_path)

    def open(self, config: BuildConfig) -> dict:
        """Create the folder, or check that an existing one was made with an equivalent config."""
        self.root.mkdir(parents=True, exist_ok=True)
        state = self.state()
        digest = config_hash(config)
        if state and state.get("config_hash") != digest:
            raise RunError(
                f"{self.root} was made with config {state.get('config_hash')}, this config is {digest}; "
                "resume with the same config (operational keys such as llm.url may change) or use a new --run-dir"
            )
        if not state:
            state = {
                "run_id": self.root.name,
                "config_hash": digest,
                "builder_version": __version__,
                "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                "journals": "whole",  # every journal holds all of its stage's records (see the module docstring)
                "stages": {},
            }
            (self.root / "config.json").write_text(config.model_dump_json(indent=2) + "\n")
            self.save_state(state)
        return state

    # ------------------------------------------------------------------------------------------------ reading

    def read(self, stage: str, record_type: type[R]) -> list[R]:
        """The records `stage` kept, in id order."""
        return from_frame(record_type, self.kept(stage, record_type))

    def kept(self, stage: str, record_type: type[Record]) -> pl.DataFrame:
        """The records `stage` kept as a frame of the record type's schema (a table an older builder wrote is
        brought up to it), in id order: what a stage end or a lookup holds instead of a record per row."""
        self.require(stage)
        return _current(record_type, self.frame(stage, record_type)).drop(INPUT_ID)

    def require(self, stage: str) -> None:
        """Raises RunError when `stage` has no output here."""
        if not self.table(stage).exists():
            raise RunError(f"stage {stage!r} has no output in {self.root}; run it first")

    def frame(
        self, stage: str, record_type: type[Record], *, rejected: bool = False, columns: Sequence[str] | None = None
    ) -> pl.DataFrame:
        """A table of `stage` (kept, or its rejections), or just its `columns`, rebuilt from the journal first if
        it is damaged."""
        path = self.rejected(stage) if rejected else self.table(stage)
        if not path.exists():
            empty = pl.DataFrame(schema=_table_schema(Rejection if rejected else record_type))
            return empty if columns is None else empty.select(columns)
        try:
            return pl.read_parquet(path, columns=columns)
        except Exception as error:  # polars raises several types for truncated or garbled files
            self._rebuild(stage, record_type, path, error)
            return pl.read_parquet(path, columns=columns)

    def done_inputs(self, stage: str, record_type: type[Record]) -> set[str]:
        """The inputs `stage` has finished (kept something, or rejected it)."""
        done: set[str] = set()
        for rejected in (False, True):
            done.update(self.frame(stage, record_type, rejected=rejected, columns=[INPUT_ID])[INPUT_ID].to_list())
        done.update(entry["input"] for entry in _journal_entries(self.journal(stage)))
        return done

    # ------------------------------------------------------------------------------------------------ writing

    @contextmanager
    def appending(self, stage: str, *, fresh: bool = False) -> Iterator[Any]:
        """The journal of `stage`, open for `append`; `fresh` starts it over (a batch stage rerun whole)."""
        path = self.journal(stage)
        if fresh:
            for table in (self.table(stage), self.rejected(stage), path):
                table.unlink(missing_ok=True)
        _drop_torn_tail(path)
        with path.open("a", encoding="utf-8") as journal:
            yield journal

    @staticmethod
    def append(journal: Any, input_id: str, results: Sequence[Record]) -> None:
        line = {
            "input": input_id,
            "kept": [to_row(r) for r in results if not isinstance(r, Rejection)],
            "rejected": [to_row(r) for r in results if isinstance(r, Rejection)],
        }
        # One line per finished input, flushed at once: after kill -9 only a torn last line can be lost.
        journal.write(json.dumps(line, ensure_ascii=False) + "\n")
        journal.flush()

    def compact(self, stage: str, record_type: type[Record]) -> None:
        """Fold the journal into the stage's two tables (sorted by id, so reruns give identical files).

        Rows already in a table are kept as they are: a run folder from before journals were kept has records
        only there. The journal is read a line at a time and its rows are checked and framed a slice at a time,
        so the table is held as columns, never as a Python object per value."""
        for rejected, row_type, key in ((False, record_type, "kept"), (True, Rejection, "rejected")):
            frames = [_current(row_type, self.frame(stage, record_type, rejected=rejected))]
            frames.extend(_journal_frames(self.journal(stage), row_type, key))
            merged = pl.concat(frames).unique("id", keep="first", maintain_order=True).sort("id")
            write_parquet_atomic(merged, self.rejected(stage) if rejected else self.table(stage))

    def _rebuild(self, stage: str, record_type: type[Record], path: Path, error: Exception) -> None:
        if self.state().get("journals") != "whole" or not self.journal(stage).exists():
            raise RunError(
                f"{path} is damaged ({str(error)[:200]}) and {self.root} holds no whole journal to rebuild it from; "
                f"move {self.table(stage).name} and {self.rejected(stage).name} aside and rerun the same command: "
                f"stage {stage!r} then redoes its inputs (the stages after it redo what changes)"
            ) from None
        logger.warning("%s is damaged (%s); rebuilding it from %s", path, str(error)[:200], self.journal(stage).name)
        for table in (self.table(stage), self.rejected(stage)):
            table.unlink(missing_ok=True)
        self.compact(stage, record_type)


def _table_schema(record_type: type[Record]) -> pl.Schema:
    return pl.Schema({**schema(record_type), INPUT_ID: pl.String()})


def _current(record_type: type[Record], frame: pl.DataFrame) -> pl.DataFrame:
    """A stage table as this builder writes it: one an older builder wrote (e.g. a `usage` struct without the
    counts added since) is rebuilt through its records, which fill in the defaults."""
    expected = _table_schema(record_type)
    if frame.schema == expected:
        return frame
    rows = [
        {**_checked(record_type, {k: v for k, v in row.items() if k != INPUT_ID}), INPUT_ID: row[INPUT_ID]}
        for row in frame.to_dicts()
    ]
    return pl.DataFrame(rows, schema=expected, orient="row")


def _drop_torn_tail(path: Path) -> None:
    """Cut a last line left unfinished by a killed process, so new lines do not get glued onto it. The last newline
    is looked for back from the end a block at a time (a journal is not read in whole: it can be gigabytes)."""
    if not path.exists():
        return
    with path.open("r+b") as handle:
        end = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, end - 1))
        if end == 0 or handle.read(1) == b"\n":
            return
        while end > 0:
            start = max(0, end - 65536)
            handle.seek(start)
            newline = handle.read(end - start).rfind(b"\n")
            if newline >= 0:
                handle.truncate(start + newline + 1)
                return
            end = start
        handle.truncate(0)


def _journal_entries(path: Path) -> Iterator[dict]:
    """The journal's entries, a line at a time."""
    if not path.exists():
        return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                logger.warning("%s:%d is torn (the process died mid-write); that input will be redone", path, number)


def _journal_frames(path: Path, row_type: type[Record], key: str) -> Iterator[pl.DataFrame]:
    """The journal's `key` rows ("kept" or "rejected"), each checked and with its input id, as frames of about
    `ROWS_PER_SLICE` rows (the last one possibly empty, so there is always one)."""
    rows: list[dict] = []
    for entry in _journal_entries(path):
        rows.extend({**_checked(row_type, row), INPUT_ID: entry["input"]} for row in entry[key])
        if len(rows) >= ROWS_PER_SLICE:
            yield pl.DataFrame(rows, schema=_table_schema(row_type), orient="row")
            rows = []
    yield pl.DataFrame(rows, schema=_table_schema(row_type), orient="row")


def _checked(record_type: type[Record], row: dict) -> dict:
    """Validate a journal row by rebuilding its record, and return it as a row again."""
    return to_row(from_row(record_type, row))
