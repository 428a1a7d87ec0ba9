"""The request layout the task writer and the gold writer share, for a model server's prefix cache: one system
message holding the instructions of both, then the environment, the clock and the scenario's state, and only then
which part to write and what it needs (the family's note, the task to solve).

Both requests of a scenario repeat everything up to the part asked for, so the gold request reuses the state the
task request sent (before, each had its own instructions first, so the state was computed twice), and every
request of an environment reuses its description, rules and tool schemas.
"""

from __future__ import annotations

from typing import Any

from builder.prompts import prompt
from builder.records import ChatMessage, Environment
from builder.stages._llm import system_user
from builder.views.budget import PromptBudget
from builder.views.code import interface_text, now_text
from builder.views.state import state_text

WRITERS = ("scenario_writer", "scenario_task", "scenario_gold")  # the prompts of the system message, in order


def writer_system() -> str:
    """The instructions of both parts, under the part's name as `## Write` asks for it."""
    return (
        f"{prompt('scenario_writer')}\n\n# The part `task`\n\n{prompt('scenario_task')}\n\n"
        f"# The part `solution`\n\n{prompt('scenario_gold')}"
    )


def writer_messages(
    env: Environment, budget: PromptBudget, now: str, state: dict[str, Any], part: str, needs: str
) -> list[ChatMessage]:
    """A writer's request: the shared start (instructions, environment, `now`, `state`), then `## Write` naming
    `part` ("task" or "solution") and `needs`, the sections only that part has."""
    user = (
        f"{interface_text(env, budget)}\n\n## Now\n{now_text(now)}\n\n## Current state\n{state_text(state, budget)}"
        f"\n\n## Write\nThe part `{part}`.{needs}"
    )
    return system_user(writer_system(), user)
