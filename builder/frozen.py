"""The base of every record and evidence model, and the mark of fields the table layer stores as JSON text.

Its own module so that `builder.records` and `builder.evidence` share one base without importing each other.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict

STORED_AS_JSON = "json"  # in a field's `Annotated[...]`: one JSON string column in Parquet, whatever the type

# Free-form JSON data (states, tool arguments, tool schemas), stored as a JSON string column.
JSON = Annotated[Any, STORED_AS_JSON]


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
