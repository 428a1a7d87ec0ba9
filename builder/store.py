"""The durable store (`envs_store/`): Parquet tables of environments, scenarios, trajectories and selections (the
select stage's choices, which a release is built from), plus a manifest.

Writes upsert by id under an inter-process lock and replace files atomically (temporary file + rename), keeping
the previous generation as `<table>.prev.parquet`, so a crash or a damaged file never loses accepted work.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

import polars as pl
from filelock import FileLock, Timeout

from builder.errors import StoreError
from builder.records import SCHEMA_VERSION, Environment, Record, Scenario, Selection, Trajectory
from builder.tables import from_frame, schema, to_frame, write_parquet_atomic

logger = logging.getLogger(__name__)

R = TypeVar("R", bound=Record)

TABLES: dict[str, type[Record]] = {
    "environments": Environment,
    "scenarios": Scenario,
    "trajectories": Trajectory,
    "selections": Selection,
}
# Columns older builders wrote that records no longer have: schema 2's `selected` verdicts are schema 3's
# selections table (a store upgraded from 2 gets its selections by rerunning select: `run --only select`).
RETIRED_COLUMNS: dict[str, tuple[str, ...]] = {"scenarios": ("selected",), "trajectories": ("selected",)}
MANIFEST = "manifest.json"


class Store:
    """The Parquet tables under one folder. Cheap to create; every call takes the lock it needs."""

    def __init__(self, root: Path, lock_timeout_s: float = 60.0) -> None:
        self.root = Path(root)
        self.lock_timeout_s = lock_timeout_s

    def path(self, table: str) -> Path:
        return self.root / f"{table}.parquet"

    def _lock(self) -> FileLock:
        self.root.mkdir(parents=True, exist_ok=True)
        return FileLock(self.root / ".lock", timeout=self.lock_timeout_s)

    def _locked(self) -> FileLock:
        lock = self._lock()
        try:
            lock.acquire()
        except Timeout:
            raise StoreError(
                f"{self.root} is locked by another builder process (waited {self.lock_timeout_s:.0f} s); "
                f"if no other process is running, delete {self.root / '.lock'}"
            ) from None
        return lock

    # ------------------------------------------------------------------------------------------------ reading

    def read_frame(self, table: str) -> pl.DataFrame:
        """The whole table as a frame (empty with the right schema when it does not exist yet)."""
        record_type = _record_type(table)
        path = self.path(table)
        if not path.exists():
            return pl.DataFrame(schema=schema(record_type))
        self._check_schema_version()
        try:
            frame = pl.read_parquet(path)
        except Exception as error:  # polars raises several types for truncated or garbled files
            raise self._damaged(path, error) from None
        expected = schema(record_type)
        frame = _upgraded(record_type, frame.drop(RETIRED_COLUMNS.get(table, ()), strict=False), expected)
        if frame.schema != expected:
            raise self._damaged(path, f"columns {dict(frame.schema)} differ from the expected {dict(expected)}")
        return frame

    def read(self, table: str) -> list[Record]:
        return from_frame(_record_type(table), self.read_frame(table))

    def get(self, table: str, record_id: str) -> Record | None:
        frame = self.read_frame(table).filter(pl.col("id") == record_id)
        return from_frame(_record_type(table), frame)[0] if frame.height else None

    def environments(self, status: str | None = None) -> list[Environment]:
        """Environments, optionally only those with the given status (candidate, accepted, rejected)."""
        frame = self.read_frame("environments")
        if status is not None:
            frame = frame.filter(pl.col("status") == status)
        return from_frame(Environment, frame)

    def scenarios(self, env_id: str | None = None) -> list[Scenario]:
        frame = self.read_frame("scenarios")
        if env_id is not None:
            frame = frame.filter(pl.col("env_id") == env_id)
        return from_frame(Scenario, frame)

    def scenario_tasks(self, env_name: str) -> dict[str, str]:
        """The task of every stored scenario of an environment named `env_name` (any run, any version of its code),
        by scenario id: what a new run's tasks for that environment must not repeat. Reads only the three columns
        it needs, so it stays cheap on a store of many thousand scenarios."""
        environments, scenarios = self.path("environments"), self.path("scenarios")
        if not environments.exists() or not scenarios.exists():
            return {}
        self._check_schema_version()
        try:
            named = pl.scan_parquet(environments).filter(pl.col("name") == env_name).select("id").collect()
            ids = named["id"].to_list()
            frame = pl.scan_parquet(scenarios).filter(pl.col("env_id").is_in(ids)).select("id", "task").collect()
        except Exception as error:  # polars raises several types for truncated or garbled files
            raise self._damaged(scenarios, error) from None
        return dict(zip(frame["id"], frame["task"], strict=True))

    def trajectories(self, env_id: str | None = None, scenario_id: str | None = None) -> list[Trajectory]:
        frame = self.read_frame("trajectories")
        if env_id is not None:
            frame = frame.filter(pl.col("env_id") == env_id)
        if scenario_id is not None:
            frame = frame.filter(pl.col("scenario_id") == scenario_id)
        return from_frame(Trajectory, frame)

    def manifest(self) -> dict:
        path = self.root / MANIFEST
        if not path.exists():
            return {"schema_version": SCHEMA_VERSION, "tables": {}}
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as error:
            raise self._damaged(path, error) from None

    # ------------------------------------------------------------------------------------------------ writing

    def upsert(
        self, table: str, records: Iterable[Record] | pl.DataFrame, *, retract_subjects: Iterable[str] = ()
    ) -> int:
        """Insert or replace records by id; returns the table's row count afterwards.

        `records` are records, or a frame of them in the table's schema (`builder.tables.schema`): a stage's kept
        table, its rows checked as records when it was compacted, is merged as columns, not a record per row.
        `retract_subjects` removes the rows whose `subject_id` is listed (a table of verdicts, like selections: a
        subject judged again and dropped loses its earlier verdict). The table stays sorted by id, so the same
        content always gives the same file.
        """
        record_type = _record_type(table)
        incoming = _incoming(table, record_type, records).unique("id", keep="last", maintain_order=True)
        with self._locked():
            existing = self.read_frame(table)
            retracted = sorted(set(retract_subjects))
            if retracted:
                existing = existing.filter(~pl.col("subject_id").is_in(retracted))
            merged = pl.concat([existing.join(incoming.select("id"), on="id", how="anti"), incoming])
            merged = merged.sort("id")
            path = self.path(table)
            if path.exists():
                # A hard link costs nothing and keeps the last good generation if the new one is ever damaged.
                previous = path.with_name(f"{table}.prev.parquet")
                previous.unlink(missing_ok=True)
                os.link(path, previous)
            write_parquet_atomic(merged, path)
            self._write_manifest(table, merged.height)
            logger.info("store: upserted %d into %s (%d rows)", incoming.height, table, merged.height)
            return merged.height

    def _write_manifest(self, table: str, rows: int) -> None:
        manifest = self.manifest()
        manifest["schema_version"] = SCHEMA_VERSION
        manifest.setdefault("tables", {})[table] = {
            "rows": rows,
            "updated_at": datetime.now(UTC).isoformat(timespec="seconds"),
        }
        tmp = self.root / f".{MANIFEST}.tmp"
        tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.root / MANIFEST)

    # -------------------------------------------------------------------------------------------- integrity

    def _check_schema_version(self) -> None:
        version = self.manifest().get("schema_version", SCHEMA_VERSION)
        if version > SCHEMA_VERSION:
            raise StoreError(
                f"{self.root} was written by a newer builder (schema {version}, this one reads {SCHEMA_VERSION}); "
                "upgrade builder"
            )

    def _damaged(self, path: Path, cause: object) -> StoreError:
        previous = path.with_name(path.name.replace(".parquet", ".prev.parquet"))
        hint = (
            f"the previous generation is kept at {previous}; move the damaged file aside and copy it back"
            if previous.exists()
            else "no previous generation exists; restore it from a backup or a published release"
        )
        return StoreError(f"{path} is damaged and was left untouched ({cause}); {hint}")


def _incoming(table: str, record_type: type[Record], records: Iterable[Record] | pl.DataFrame) -> pl.DataFrame:
    if isinstance(records, pl.DataFrame):
        if records.schema != schema(record_type):
            raise TypeError(f"table {table} holds {record_type.__name__}: the frame's columns differ from its schema")
        return records
    records = list(records)
    for record in records:
        if not isinstance(record, record_type):
            raise TypeError(f"table {table} holds {record_type.__name__}, got {type(record).__name__}")
    return to_frame(record_type, records)


def _upgraded(record_type: type[Record], frame: pl.DataFrame, expected: pl.Schema) -> pl.DataFrame:
    """`frame` as an older builder wrote it, brought to `expected` where nothing can be lost: columns added since
    whose field has a default (e.g. `Scenario.now`, `Scenario.method`) and struct fields added since (e.g.
    `reasoning_content` in `messages`, `cached_calls` in `usage`) take their defaults. Anything else that differs
    is left as it is, for the caller to report."""
    if frame.schema == expected:
        return frame
    fields = record_type.model_fields
    missing = [name for name in expected if name not in frame.columns]
    if not all(name in fields and not fields[name].is_required() for name in missing):
        return frame
    for name, dtype in frame.schema.items():
        if name in expected and dtype != expected[name] and not _widens(dtype, expected[name]):
            return frame
    # Through the records, not `cast`: polars casts a struct nested in a list by field position, and fills a
    # struct field it lacks with null where the record has a default (a count an older builder did not keep: 0).
    try:
        records = from_frame(record_type, frame.select([name for name in expected if name in frame.columns]))
    except ValueError:  # a row that no longer validates: damage, for the caller to report
        return frame
    return to_frame(record_type, records)


def _widens(old: pl.DataType, new: pl.DataType) -> bool:
    """Whether `new` is `old` with struct fields added (anywhere inside), and nothing removed or retyped."""
    if isinstance(old, pl.Struct) and isinstance(new, pl.Struct):
        added = {field.name: field.dtype for field in new.fields}
        return all(field.name in added and _widens(field.dtype, added[field.name]) for field in old.fields)
    if isinstance(old, pl.List) and isinstance(new, pl.List):
        return _widens(old.inner, new.inner)
    return old == new


def _record_type(table: str) -> type[Record]:
    try:
        return TABLES[table]
    except KeyError:
        raise StoreError(f"unknown store table {table!r}; tables are: {', '.join(TABLES)}") from None
