"""The base of every config section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base of every config section: frozen, and unknown keys are errors rather than silently ignored."""

    model_config = ConfigDict(frozen=True, extra="forbid")
