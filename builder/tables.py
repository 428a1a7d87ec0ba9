"""Records ↔ Parquet rows without loss.

The column layout follows from each record's annotations: scalars stay scalars, tuples become lists, nested
models become structs (so chat messages keep the fixed struct trainers read), and fields marked
`STORED_AS_JSON` (`JSON`, tool schemas, the evidence models) become JSON strings (portable, and no struct
inference over heterogeneous keys); a marked model is validated from the decoded JSON like any other input.
"""

from __future__ import annotations

import json
import os
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

import polars as pl
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from builder.frozen import JSON, STORED_AS_JSON
from builder.records import Record

R = TypeVar("R", bound=Record)

_SCALARS: dict[type, pl.DataType] = {str: pl.String(), int: pl.Int64(), float: pl.Float64(), bool: pl.Boolean()}


def _is_json(annotation: Any) -> bool:
    return typing.get_origin(annotation) is typing.Annotated and STORED_AS_JSON in typing.get_args(annotation)[1:]


def _strip_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"unions other than Optional cannot be stored: {annotation}")
    return annotation


def _dtype(annotation: Any) -> pl.DataType:
    if _is_json(annotation):
        return pl.String()
    annotation = _strip_optional(annotation)
    if _is_json(annotation):
        return pl.String()
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return _SCALARS[type(typing.get_args(annotation)[0])]
    if origin in (tuple, list):
        args = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis]
        return pl.List(_dtype(args[0]))
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return pl.Struct(_fields(annotation))
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    raise TypeError(f"no Parquet column type for {annotation}")


def _annotation(field: FieldInfo) -> Any:
    """The field's annotation; pydantic moves top-level `Annotated` metadata aside, so put the JSON mark back."""
    return JSON if STORED_AS_JSON in field.metadata else field.annotation


def _fields(model: type[BaseModel]) -> dict[str, pl.DataType]:
    return {name: _dtype(_annotation(field)) for name, field in model.model_fields.items()}


def schema(record_type: type[Record]) -> pl.Schema:
    """The Parquet schema of a record type: `id` first, then the fields in declaration order."""
    return pl.Schema({"id": pl.String(), **_fields(record_type)})


def _encode(model: type[BaseModel], data: dict[str, Any]) -> dict[str, Any]:
    """Turn a `model_dump(mode='json')` dict into a row: JSON fields to strings, recursively into structs."""
    row = dict(data)
    for name, field in model.model_fields.items():
        row[name] = _encode_value(_annotation(field), row[name])
    return row


def _encode_value(annotation: Any, value: Any) -> Any:
    if value is None:
        return None
    if _is_json(annotation) or _is_json(_strip_optional(annotation)):
        return json.dumps(value, ensure_ascii=False)
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        item = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis][0]
        return [_encode_value(item, element) for element in value]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _encode(annotation, value)
    return value


def _decode(model: type[BaseModel], row: dict[str, Any]) -> dict[str, Any]:
    data = dict(row)
    for name, field in model.model_fields.items():
        if name in data:
            data[name] = _decode_value(_annotation(field), data[name])
    return data


def _decode_value(annotation: Any, value: Any) -> Any:
    if value is None:
        return None
    if _is_json(annotation) or _is_json(_strip_optional(annotation)):
        return json.loads(value)
    annotation = _strip_optional(annotation)
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        item = [arg for arg in typing.get_args(annotation) if arg is not Ellipsis][0]
        return [_decode_value(item, element) for element in value]
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return _decode(annotation, value)
    return value


def to_row(record: Record) -> dict[str, Any]:
    """One Parquet row (a plain dict) for a record."""
    return _encode(type(record), record.model_dump(mode="json"))


def from_row(record_type: type[R], row: dict[str, Any]) -> R:
    """Rebuild a record from its row, checking that the stored id still matches the content."""
    data = _decode(record_type, row)
    stored_id = data.pop("id", None)
    record = record_type.model_validate(data)
    if stored_id is not None and stored_id != record.id:
        raise ValueError(f"row id {stored_id} does not match its content (recomputed {record.id})")
    return record


def to_frame(record_type: type[Record], records: typing.Iterable[Record]) -> pl.DataFrame:
    """A frame with the record type's exact schema (also for zero records)."""
    return pl.DataFrame([to_row(record) for record in records], schema=schema(record_type), orient="row")


def from_frame(record_type: type[R], frame: pl.DataFrame) -> list[R]:
    return list(iter_records(record_type, frame))


# Rows turned into Python objects at once when a frame is walked: a whole table of them (and the allocator's arenas
# they leave behind) is what made builder's memory grow with the number of environments.
ROWS_PER_SLICE = 256


def iter_records(record_type: type[R], frame: pl.DataFrame) -> Iterator[R]:
    """The records of `frame` in its order, built a slice of rows at a time."""
    for part in frame.iter_slices(ROWS_PER_SLICE):
        for row in part.to_dicts():
            yield from_row(record_type, row)


class RecordsById(Mapping[str, R]):
    """The records of a table by id, kept as the frame (columnar, compact) with an index of its ids: a record is
    built when it is looked up, so holding a whole table costs its Arrow columns, not a Python object per value."""

    def __init__(self, record_type: type[R], frame: pl.DataFrame) -> None:
        self.record_type = record_type
        self.frame = frame
        self.rows = {record_id: index for index, record_id in enumerate(frame["id"])}

    def __getitem__(self, record_id: str) -> R:
        return from_row(self.record_type, self.frame.row(self.rows[record_id], named=True))

    def __contains__(self, record_id: object) -> bool:
        return record_id in self.rows

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def write_parquet_atomic(frame: pl.DataFrame, path: Path) -> None:
    """Write to a temporary file beside `path`, fsync, then rename: readers see the old file or the new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    frame.write_parquet(tmp, statistics=True)
    with open(tmp, "rb") as handle:
        os.fsync(handle.fileno())
    tmp.replace(path)
