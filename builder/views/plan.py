"""What prompts show of an environment's plan."""

from __future__ import annotations

from builder.records import EntityPlan


def describe_entity(entity: EntityPlan) -> str:
    """`member (key member_id; self.members): member_id: str, name: str` — shared by the plan and code stages."""
    attributes = ", ".join(f"{a.name}: {a.type}" for a in entity.attributes)
    return f"{entity.name} (key {entity.key}; stored in self.{entity.collection}): {attributes}"
