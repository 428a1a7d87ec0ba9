"""What every published column means: the card's column tables are rendered from here (a test keeps it complete)."""

from __future__ import annotations

ROW_MEANING = {
    "environments": "an environment class: code, tool schemas, state schema, quality scores",
    "scenarios": "a task in one environment: initial state, checks, gold actions",
    "sft": "a verified trajectory: messages and tools, for supervised fine-tuning",
}

_PROVENANCE = (
    "where the row came from: `builder_version`, `config_hash`, `model`, `sampling`, `prompt_version`, "
    "`parent_ids` (ids of the records it was made from), `origin` (imported rows: the source's format, location, "
    "revision, the row's id there and the split it gave it; null otherwise)"
)

COLUMN_DOCS: dict[str, dict[str, str]] = {
    "environments": {
        "env_id": "`env-<16 hex>`: sha256 of the code; scenarios and trajectories refer to it",
        "name": "snake_case name, e.g. `library_loans`",
        "class_name": "the one class `code` defines",
        "description": "what the environment simulates",
        "domain": "domain label, e.g. `library`",
        "policy": "the rules the environment enforces, in plain language (numbered): what the agent's system prompt "
        'shows under "Policy" in rollouts, the trainer API and the adapters (empty when the code states none)',
        "code": "the whole Python module (**untrusted code**: run it only in a sandbox)",
        "code_sha256": "sha256 of `code`, to check the code you run is the code published",
        "tools": "JSON: OpenAI function schemas of the tools (the public methods), sorted by name: what "
        "`transformers.utils.get_json_schema` derives from the methods, in the order TRL lists them",
        "num_tools": "number of tools",
        "state_schema": "JSON: JSON schema of the state attributes",
        "num_scenarios": "number of scenarios of this environment in this release",
        "scores": 'JSON: quality scores by name, e.g. `{"dual_agent": 0.91}`',
        "evaluation": "JSON: evidence behind the acceptance (gate results, tester/checker summary)",
        "graph": "JSON: the tool dependency graph, `nodes` (each tool's `name`, `parameters`, the state attributes it "
        "`reads` and `writes`) and typed `edges`: `data` (`source`'s result field `output` carries values `target`'s "
        "parameter `input` accepts, with an `example`, found by running the tools in the sandbox) and `state` "
        "(`source` writes attribute `output`, which `target` reads); `truncated`: the probe budget ran out. Extracted "
        "from the first of `evaluation.test_states`; null for environments evaluated before graphs were stored",
        "plan_id": "id of the environment plan the code was written from",
        "schema_version": "version of the record layout",
        "provenance": _PROVENANCE,
    },
    "scenarios": {
        "scenario_id": "`scenario-<16 hex>`: hash of env_id, initial state, now, task and mode",
        "env_id": "the environment this scenario runs in",
        "mode": "`non_conversational` (the whole task up front) or `conversational` (a simulated user)",
        "method": "`llm` (the model wrote state, task, checks and gold) or `graph` (a tool chain sampled along the "
        "environment's tool graph is the gold, the checks are derived from its state diff, the model wrote the task)",
        "wording": "who wrote what the user says (task, user script): `model`, or `template` (graph method: a fixed "
        "template from the chain's calls, under the same leak and sufficiency gates; `scenarios.wording`)",
        "family": "the kind of task: `plain`, `missing_info`, `infeasible`, `policy_trap`, `error_recovery` or "
        "`long_context` (the card's Task families)",
        "task": "what the user wants done",
        "initial_state": "JSON: attribute name → value, applied to a fresh environment instance",
        "now": "the scenario's current date-time, ISO 8601 local time without a zone: the sandbox's clock reads it "
        "(frozen) and the agent and simulated user are told it is today; run episodes at it",
        "user": "conversational mode: the simulated user's `profile`, `known_up_front`, `reveal_when_asked`, "
        "`ending`; null otherwise",
        "checklist": "the task as statements about the final state",
        "checks": "one Python `check(initial_state, final_state) -> bool` per checklist item (untrusted code)",
        "answer_facts": "when the task asks to be told something: the values the agent's answer must state, each "
        "returned by a gold call and, to count, by a tool in the agent's episode (matched regardless of case, "
        "punctuation and number or date format: `builder.envs.answer`); in a `missing_info` task's "
        "non-conversational row, the name of the missing value (named by it or its head word: \"date\" for \"new "
        "end date\"); empty otherwise",
        "gold_actions": "a tool-call sequence that solves the task: `name`, `arguments` (JSON)",
        "difficulty": "`easy`, `medium` or `hard`: from the measured `pass_rate` when at least 2 rollouts were graded "
        "(easy at 0.8 or above, hard below 0.4), else from the size of the gold sequence",
        "difficulty_source": "`pass_rate` or `gold`: where `difficulty` comes from",
        "num_rollouts": "graded agent rollouts of this scenario (infrastructure failures excluded)",
        "pass_rate": "share of those rollouts that passed every check, the collateral guard included (null without "
        'rollouts); played by the model the card names for the split ("Who wrote, judged and played")',
        "verification": "JSON: evidence that the gold actions pass every check and no check is vacuous",
        "schema_version": "version of the record layout",
        "provenance": _PROVENANCE,
    },
    "sft": {
        "trajectory_id": "`traj-<16 hex>`: hash of scenario, model, sampling and sample index",
        "scenario_id": "the scenario that was solved",
        "env_id": "its environment (always in the `train` split)",
        "mode": "as in `scenarios`",
        "messages": "the conversation: `role`, `content`, `tool_calls` (`id`, `type`, `function` with `name` and "
        "`arguments` as JSON text), `tool_call_id`, `name`, `reasoning_content` (the agent's thinking when the "
        "model thought, else null; Qwen3's chat template renders it)",
        "tools": "JSON: the environment's tool schemas, as in `environments` (the agent saw the same tools)",
        "reward": 'the published reward (the card\'s "The reward"; 1.0 here: only solved trajectories are published)',
        "checks_passed": "one verdict per check, in the scenario's `checks` order",
        "num_turns": "assistant messages in the conversation",
        "num_tool_calls": "tool calls the agent made",
        "end_reason": "why the rollout ended, e.g. `answered`, `user_stop`",
        "model": "the agent model",
        "sampling": "the agent's sampling: `temperature`, `top_p`, `max_tokens`, `seed`",
        "usage": "what the rollout's model calls cost: `calls` the server answered with their `prompt_tokens` and "
        "`completion_tokens`, `cached_calls` replayed from the run's cache (no tokens), `failed_calls`, `regrowths`, "
        "`retries` (tries again after transient failures: rate limits, server errors, dropped connections)",
        "schema_version": "version of the record layout",
        "provenance": _PROVENANCE,
    },
}
