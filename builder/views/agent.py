"""The agent's system prompt: one function for the rollouts, the trainer API and the adapters, so a policy trained
on a release sees the prompt the release's trajectories were made with."""

from __future__ import annotations

from string import Template

from builder.prompts import prompt
from builder.sandbox.world import describe_now

POLICY_HEADING = (
    "Policy: the rules the system enforces. Follow them; when a request breaks one, do not work around it: say "
    "which rule stops it (and offer what the rules allow, if anything)."
)


def agent_system_prompt(
    prompt_name: str, *, name: str, domain: str, description: str, now: str, policy: str = ""
) -> str:
    """`prompts/<prompt_name>.md` for an environment (its name, domain, description and policy, the numbered rules
    of `builder.views.code.policy_text`) at the date-time `now`. As tau-bench gives its agent the domain policy:
    an agent that must learn the rules from error messages is trained to probe, not to comply."""
    about = f"{name} ({domain}): {description}"
    if policy:
        about += f"\n\n{POLICY_HEADING}\n{policy}"
    return Template(prompt(prompt_name)).safe_substitute(environment=about, now=describe_now(now))
