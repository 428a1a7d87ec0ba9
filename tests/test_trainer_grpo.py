"""One real GRPO step with TRL on a release's `rl` split, both modes, running the GRPO code its card shows.

The release comes from `python -m builder run`; the GRPO block of its card runs as rendered, in this process,
with the test's swaps only: `MODEL` names the first 2 of the embedded SmolLM2's 30 layers (the same weights,
tokenizer and code path at a CPU-sized cost), the simulated user's endpoint is an OpenAI-compatible stub server,
the Hub reads resolve to the release's folder (tests/integration/test_trl_grpo.py runs the same block against a
real local Hub), `GRPOConfig` gets CI budgets (one step of two groups of two rollouts), and `trainer.train()`
runs under a scripted `generate`. Everything else is real: TRL renders the prompts with builder's ChatML+tools
template, parses the tool calls back with its response template, runs them through the
`trl_environment_factories` classes in builder's sandbox, asks the simulated user over HTTP through
`reply_to_user`, scores with `trl_reward` and takes an optimizer step. The 135M model does not make tool
calls, so its `generate` is replaced, as TRL's own tests do, by one that writes scripted completions: per group,
one rollout plays the gold actions and one lends the book with the wrong due date, so each group has a reward
spread and the step a gradient.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from unittest.mock import patch

import pytest

torch = pytest.importorskip("torch")
import datasets  # noqa: E402
import huggingface_hub  # noqa: E402
import trl  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from builder.envs.conversation import ENDED  # noqa: E402
from builder.llm.weights import EMBEDDED_MODEL, resolve_model  # noqa: E402
from tests.fixtures.e2e_release import DUE, build_release, user_reply  # noqa: E402
from tests.fixtures.teacher import GOLD  # noqa: E402
from tests.llm_stub import StubServer, completion  # noqa: E402

LAYERS = 2
QUESTION = "Happy to help. Could you give me your member id, the book and when you will bring it back?"
WRONG_DUE = [*GOLD[:2], {**GOLD[2], "arguments": {**GOLD[2]["arguments"], "due": "2024-07-30"}}]
# CI budgets over the card's GRPOConfig: one step of 2 prompts x 2 rollouts on the CPU, nothing saved or reported.
BUDGET = {
    "max_steps": 1, "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 1024,
    "learning_rate": 1e-3, "beta": 0.0, "logging_steps": 1, "report_to": "none", "use_cpu": True,
    "shuffle_dataset": False, "save_strategy": "no", "max_tool_calling_iterations": 6,
    "gradient_checkpointing": False,
}  # fmt: skip


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("release"))


def card_block(card: str, heading: str) -> str:
    """The first ```python block after `heading` in the card."""
    section = card[card.index(heading) :]
    return re.search(r"```python\n(.*?)\n```", section, re.DOTALL).group(1)


def runnable_grpo_block(card: str, model_dir: str, user_url: str) -> str:
    """The card's GRPO block with `MODEL` and the user's endpoint swapped, up to (without) `trainer.train()`."""
    code = card_block(card, "### GRPO")
    assert code.endswith("\ntrainer.train()") and code.count("trainer.train()") == 1
    lines = code.removesuffix("trainer.train()").splitlines()
    (model_line,) = [i for i, line in enumerate(lines) if line.startswith("MODEL = ")]
    (user_line,) = [i for i, line in enumerate(lines) if line.startswith("user = SimulatedUser.endpoint(")]
    lines[model_line] = f"MODEL = {json.dumps(model_dir)}"
    lines[user_line] = re.sub(r'endpoint\("[^"]+"', f"endpoint({json.dumps(user_url)}", lines[user_line])
    return "\n".join(lines) + "\n"


def budget_config(output_dir: str) -> type:
    """`GRPOConfig` with the CI budgets laid over whatever the card passes."""

    class Budgeted(trl.GRPOConfig):
        def __init__(self, **options):
            super().__init__(**{**options, **BUDGET, "output_dir": output_dir})

    return Budgeted


def small_model(folder: Path) -> str:
    """The embedded SmolLM2's first layers and its tokenizer, saved where `from_pretrained` can read them."""
    model_dir, _ = resolve_model(EMBEDDED_MODEL)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=LAYERS)
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    return str(folder)


def from_release(release: Path, repo: str, tag: str, monkeypatch) -> None:
    """The Hub reads the card makes, answered from the release's folder (checking it names this repo and tag)."""
    load, reads = datasets.load_dataset, []

    def load_dataset(path, name, *, split, revision):
        assert (path, revision) == (repo, tag)
        reads.append((name, split))
        return load(str(release), name, split=split, cache_dir=str(release.parent / "hf-cache"))

    def hf_hub_download(repo_id, filename, *, repo_type, revision):
        assert (repo_id, repo_type, revision) == (repo, "dataset", tag)
        return str(release / filename)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", hf_hub_download)


def tool_calls(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls) + "<|im_end|>"


def reply(message: str) -> str:
    return tool_calls({"name": "reply_to_user", "arguments": {"message": message}})


def policy(prompt: str, row: int, first_call: bool) -> str:
    """The completion for one rendered prompt. Odd rows of the first batch (one per group) play the wrong due
    date; later turns tell the variants apart by what the conversation already holds."""
    turn = prompt.count("<|im_start|>assistant") - 1
    wrong = row % 2 == 1 if first_call else ("2024-07-30" in prompt or QUESTION.replace("?", " ?") in prompt)
    if "reply_to_user" not in prompt.split("<|im_start|>user")[0]:  # non-conversational: tools, then report
        return tool_calls(*(WRONG_DUE if wrong else GOLD)) if turn == 0 else "Done: b3 is lent to m2.<|im_end|>"
    question = QUESTION.replace("?", " ?") if wrong else QUESTION  # both end with "?": the user answers
    script = [reply(question), tool_calls(*(WRONG_DUE if wrong else GOLD)), reply("Done: b3 is lent to you."),
              "All done.<|im_end|>"]  # fmt: skip
    return script[turn]


def scripted_generate(tokenizer):
    calls = []

    def generate(input_ids, **kwargs):
        pad = tokenizer.pad_token_id
        texts = [tokenizer.decode([t for t in row.tolist() if t != pad]) for row in input_ids]
        completions = [tokenizer(policy(text, i, not calls), add_special_tokens=False)["input_ids"]
                       for i, text in enumerate(texts)]  # fmt: skip
        calls.append(texts)
        width = max(len(c) for c in completions)
        padded = [c + [pad] * (width - len(c)) for c in completions]
        return torch.cat([input_ids, torch.tensor(padded, dtype=input_ids.dtype)], dim=-1)

    generate.calls = calls
    return generate


def test_the_cards_grpo_code_takes_one_step_on_both_modes(release, tmp_path, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    card = (release / "README.md").read_text()
    repo = re.search(r'load_dataset\("([^"]+)", "environments", split="rl", revision="([^"]+)"\)', card)
    from_release(release, repo.group(1), repo.group(2), monkeypatch)
    monkeypatch.setattr(trl, "GRPOConfig", budget_config(str(tmp_path / "out")))

    with StubServer(lambda body: (200, completion(user_reply(body["messages"])))) as user_server:
        code = runnable_grpo_block(card, small_model(tmp_path / "model"), user_server.url)
        card_globals: dict = {}
        exec(compile(code, "card-grpo", "exec"), card_globals)  # the card's code, as rendered
        trainer, rl = card_globals["trainer"], card_globals["rl"]
        assert sorted(rl["mode"]) == ["conversational", "non_conversational"]  # the card keeps both
        before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
        generate = scripted_generate(card_globals["tokenizer"])
        started = time.monotonic()
        try:
            with patch.object(trainer.model, "generate", side_effect=generate):
                trainer.train()
        finally:
            sandboxes = {id(env._live.sandbox): env._live.sandbox for env in trainer.environments}
            for sandbox in sandboxes.values():
                sandbox.close()
        print(f"GRPO step: {time.monotonic() - started:.1f} s")

    # Every rollout's tool calls were parsed by TRL and ran in the sandbox: the checks graded the state (the
    # gold due date passes both checks, the wrong one only the copy count), in both modes.
    names = sorted({type(env).__name__ for env in trainer.environments})
    assert len(names) == 2 and names[1] == names[0] + "Conversational"
    assert sorted((type(env).__name__, env._live.reward()) for env in trainer.environments) == [
        (names[0], 0.5), (names[0], 1.0), (names[1], 0.5), (names[1], 1.0),
    ]  # fmt: skip
    dues = sorted(loan["due"] for env in trainer.environments for loan in env._live.state()["loans"].values()
                  if (loan["member_id"], loan["book_id"]) == ("m2", "b3"))  # fmt: skip
    assert dues == [DUE, DUE, "2024-07-30", "2024-07-30"]
    logs = trainer.state.log_history[0]
    assert logs["tools/failure_frequency"] == 0.0
    assert logs["tools/call_frequency"] == (3 + 3 + 5 + 5) / 4  # calls per rollout: 3 tools, plus 2 replies
    assert logs["reward"] == pytest.approx(0.75)
    assert all(logs[f"rewards/{name}/mean"] == pytest.approx(0.75) for name in names)

    # The conversational rollouts' user opened, answered the question and stopped, over HTTP.
    talks = [env for env in trainer.environments if type(env).__name__ == names[1]]
    assert [env._conversation.end_reason for env in talks] == ["user_stop", "user_stop"]
    assert len(user_server.requests) == 2 * 3
    assert sum("Hi, I would like to borrow a novel please." in text for text in generate.calls[0]) == 2
    assert any(ENDED in text for texts in generate.calls for text in texts)
    # The step moved the weights (the groups' reward spread gives a non-zero advantage).
    assert any(not torch.equal(before[name], p) for name, p in trainer.model.named_parameters())
