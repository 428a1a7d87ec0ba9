"""The agent's system prompt: one function for the rollouts, the trainer API and the adapters, so a policy trained
on a release sees the prompt the release's trajectories were made with."""

from __future__ import annotations

from string import Template

from builder.prompts import prompt
from builder.sandbox.world import describe_now


def agent_system_prompt(prompt_name: str, *, name: str, domain: str, description: str, now: str) -> str:
    """`prompts/<prompt_name>.md` for an environment (its name, domain and description) at the date-time `now`."""
    about = f"{name} ({domain}): {description}"
    return Template(prompt(prompt_name)).safe_substitute(environment=about, now=describe_now(now))
