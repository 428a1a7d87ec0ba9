"""The code the dataset card shows, written for the configs and splits the release has.

`datasets` cannot load a split without rows, so a block that loads one the release lacks fails with `Unknown
split`; every block here loads only what `published_splits` says exists, and each block imports what it uses, so
it runs on its own, as written (tests/integration/test_card_snippets.py runs every ```python block of generated
cards against a local Hub; tests/test_trainer_grpo.py and tests/integration/test_trl_*.py take a training step
with the SFT and GRPO blocks). Without an `rl` split, the RL examples run on the `train` split's scenarios and the
card says so.
"""

from __future__ import annotations

from string import Template

from builder.envs.guard import GUARD_MARK
from builder.publish.export import CONFIG_SPLITS
from builder.publish.tokens import TokenStats

CHAT_TEMPLATE = "chat_template.jinja"  # the packaged ChatML+tools template, shipped in every release
DISTRIBUTION = "builder-envs"  # builder's name on PyPI (`builder` there is another project); it imports as `builder`

# SFT on the `sft` split with the packaged template (its {% generation %} marks make assistant_only_loss work).
SFT_EXAMPLE = Template(
    """import torch
from datasets import load_dataset
from huggingface_hub import hf_hub_download
from trl import SFTConfig, SFTTrainer

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # any model whose tokenizer has <|im_start|> and <|im_end|>
sft = load_dataset("$repo", "sft", split="train", revision="$tag")
template = hf_hub_download("$repo", "$chat_template", repo_type="dataset", revision="$tag")
args = SFTConfig(
    output_dir="sft-out", chat_template_path=template, assistant_only_loss=True, max_length=$max_length,
    bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),  # TRL's default, bf16, needs a GPU
)
trainer = SFTTrainer(model=MODEL, args=args, train_dataset=sft)
trainer.train()"""
)

# GRPO on one split, both modes: builder's sandboxed environments as TRL's environment_factory, rewarded by the
# published reward; conversational scenarios talk to a simulated user (tests/test_trainer_grpo.py runs it).
GRPO_EXAMPLE = Template(
    """import torch
from datasets import load_dataset
from huggingface_hub import hf_hub_download
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer
from trl.chat_template_utils import qwen3_template
from builder.envs.conversation import SimulatedUser
from builder.envs.trainer import trl_environment_factories, trl_prompt_row, trl_reward

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
environments = load_dataset("$repo", "environments", split="$split", revision="$tag")
by_id = {row["env_id"]: row for row in environments}
rl = load_dataset("$repo", "scenarios", split="$split", revision="$tag")
rl = rl.map(lambda row: trl_prompt_row(row, by_id[row["env_id"]]))
# Conversational scenarios need a model to play the user: any OpenAI-compatible server (vLLM, ...). Without one,
# keep rl.filter(lambda row: row["mode"] == "non_conversational") and drop `user=`.
user = SimulatedUser.endpoint("http://127.0.0.1:8000/v1", "Qwen/Qwen3-8B")
template = hf_hub_download("$repo", "$chat_template", repo_type="dataset", revision="$tag")
tokenizer = AutoTokenizer.from_pretrained(MODEL)
# The packaged template writes tool calls as Qwen3 does; with Qwen3's own tokenizer drop these two lines.
tokenizer.chat_template = open(template).read()
tokenizer.response_template = qwen3_template
args = GRPOConfig(
    output_dir="grpo-out", max_completion_length=2048,  # the whole multi-turn episode: calls, results, replies
    bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
)
trainer = GRPOTrainer(
    model=MODEL, processing_class=tokenizer, args=args, train_dataset=rl, reward_funcs=trl_reward,
    environment_factory=trl_environment_factories(environments, rl, user=user),
)
trainer.train()"""
)

# Without builder: what a row holds and how to run and grade it. The seed is `builder.records.scenario_seed`
# (`builder.sandbox.world.derive_seed(env_id, now)`) and `reward` is `builder.envs.checks.published_reward`'s rule
# over the checks' verdicts (tests/test_card.py holds both to builder's).
ANOTHER_TRAINER_EXAMPLE = Template(
    """import hashlib
import json

from datasets import load_dataset

scenarios = load_dataset("$repo", "scenarios", split="$split", revision="$tag")
environments = load_dataset("$repo", "environments", split="$split", revision="$tag")
by_id = {row["env_id"]: row for row in environments}

row = scenarios[0]
env = by_id[row["env_id"]]                       # env["code"] defines the class env["class_name"]
tools = json.loads(env["tools"])                 # the schemas of its public methods, the agent's tools
initial_state = json.loads(row["initial_state"])  # set each item as an attribute of a fresh instance
prompt = [{"role": "user", "content": row["task"]}]  # conversational rows: a simulated user plays row["user"]
# Run the episode and its checks in a sandbox at the scenario's clock and seed, as builder's rollouts did: the
# clock frozen at `now` (the agent is told it is today), `random` and `uuid` seeded with `seed`.
now = row["now"]
seed = int.from_bytes(hashlib.sha256(f"{row['env_id']}\\x1f{now}".encode()).digest()[:8], "big") >> 1
guard = [check.startswith("$guard_mark") for check in row["checks"]]  # the collateral guard, the last check
facts = row["answer_facts"]  # values the agent's answer must state, when the task asks to be told something


def reward(on_final: list[bool], on_initial: list[bool], answered: bool = False) -> float:
    \"\"\"The published reward from each check's verdict on (initial, final state) and on (initial, initial), and
    whether the agent's answer stated every fact (builder.envs.answer matches them regardless of format).\"\"\"
    tasks = [i for i, is_guard in enumerate(guard) if not is_guard]
    counted = [on_final[i] for i in tasks if not on_initial[i]] + ([answered] if facts else [])
    if (tasks or facts) and all(on_final) and (answered or not facts):
        return 1.0
    broken = any(on_initial[i] and not on_final[i] for i in tasks)  # held before, undone: collateral damage
    if broken or not all(on_final[i] for i, is_guard in enumerate(guard) if is_guard) or not counted:
        return 0.0
    return sum(counted) / len(counted)


print(row["scenario_id"], "at", now, "seed", seed)"""
)


def scenario_split(present: dict[str, list[str]]) -> str | None:
    """The split the RL examples load: `rl` when the release has its scenarios and environments, else `train`
    when it has those, else None (no scenarios at all)."""
    for split in ("rl", "train"):
        if split in present.get("scenarios", []) and split in present.get("environments", []):
            return split
    return None


def load_examples(repo: str, tag: str, present: dict[str, list[str]]) -> str:
    """One `load_dataset` line per config the release has (a config without rows cannot be loaded)."""
    return "\n".join(
        f'{config} = load_dataset("{repo}", "{config}", revision="{tag}")  # splits: {", ".join(present[config])}'
        if config in present
        else f"# {config}: no rows in this release"
        for config in CONFIG_SPLITS
    )


def pinned_example(repo: str, version: str, present: dict[str, list[str]]) -> str:
    """Loading a snapshot of exactly the tag: the `sft` split when there is one, else the first split there is."""
    config, split = ("sft", "train") if "sft" in present else next((c, s[0]) for c, s in present.items())
    return (
        "```python\nfrom huggingface_hub import snapshot_download\nfrom datasets import load_dataset\n\n"
        f'path = snapshot_download("{repo}", repo_type="dataset", revision="v{version}")\n'
        f'{config} = load_dataset(path, "{config}", split="{split}")\n```\n\n'
        f'or, with builder installed, `builder.publish.loading.load_pinned("{repo}", "{config}", "{version}", '
        f'split="{split}")`.'
    )


def sft_example(repo: str, tag: str, tokens: TokenStats | None) -> str:
    """The SFT code of the card; `max_length` fits the longest row (TRL's default, 1024, would cut longer ones)."""
    max_length = tokens.max_length if tokens is not None and tokens.lengths else 4096
    return SFT_EXAMPLE.substitute(repo=repo, tag=tag, chat_template=CHAT_TEMPLATE, max_length=max_length)


def sft_section(repo: str, tag: str, tokens: TokenStats | None, present: dict[str, list[str]]) -> str:
    if "sft" not in present:
        return "This release has no `sft` rows (no trajectory of a `train` environment was selected), so there is "\
            "nothing to fine-tune on."  # fmt: skip
    return (
        f"```python\n{sft_example(repo, tag, tokens)}\n```\n\n"
        "`sft` rows are conversational (`messages` and `tools`), so SFTTrainer needs no formatting function. With a "
        "model whose own template renders tools and `content: null` (Qwen3), drop `chat_template_path`: TRL swaps "
        "in its training variant of the model's template for `assistant_only_loss`."
    )


def grpo_example(repo: str, tag: str, split: str) -> str:
    return GRPO_EXAMPLE.substitute(repo=repo, tag=tag, split=split, chat_template=CHAT_TEMPLATE)


def split_note(split: str | None, missing_rl: str) -> str:
    """What the RL examples run on, when it is not the `rl` split."""
    if split == "rl":
        return ""
    if split is None:
        return f"This release has no scenarios ({missing_rl}), so there is no RL example.\n\n"
    return (
        f"> [!NOTE]\n> This release has no `rl` split: {missing_rl}. The examples below run on the `train` "
        "split's scenarios instead: the environments the `sft` trajectories were made in, so not held out from "
        "SFT.\n\n"
    )


def grpo_section(repo: str, tag: str, split: str | None, missing_rl: str) -> str:
    note = split_note(split, missing_rl)
    if split is None:
        return note.rstrip()
    return (
        f"{note}```python\n{grpo_example(repo, tag, split)}\n```\n\n"
        "TRL must parse the policy's tool calls back: for the packaged template set `response_template` as above "
        "(its tool-call format is Qwen3's); for a template TRL knows, such as Qwen3's own, TRL sets it itself."
    )


def another_trainer_section(repo: str, tag: str, split: str | None) -> str:
    if split is None:
        return "This release has no scenarios to run."
    code = ANOTHER_TRAINER_EXAMPLE.substitute(repo=repo, tag=tag, split=split, guard_mark=GUARD_MARK)
    return f"```python\n{code}\n```"
