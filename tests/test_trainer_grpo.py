"""One real GRPO step with TRL on a release's `rl` split, both modes, with the embedded SmolLM2 on CPU.

Everything but the policy's sampling is real: the release comes from `python -m builder run`, TRL renders the
prompts with builder's ChatML+tools template, parses the tool calls back with its response template, runs
them through the `trl_environment_factories` classes in builder's sandbox, asks the simulated user (an
OpenAI-compatible HTTP server) through `reply_to_user`, scores with `get_reward()` and takes an optimizer
step. The 135M model does not make tool calls, so its `generate` is replaced, as TRL's own tests do, by one
that writes scripted completions: per group, one rollout plays the gold actions and one lends the book with the
wrong due date, so the group has a reward spread and the step a gradient.
"""

from __future__ import annotations

import json
import time
from unittest.mock import patch

import pytest

torch = pytest.importorskip("torch")
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402
from trl.chat_template_utils import qwen3_template  # noqa: E402

from builder.envs.conversation import ENDED, SimulatedUser  # noqa: E402
from builder.envs.trainer import trl_environment_factories, trl_prompt_row  # noqa: E402
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template, resolve_model  # noqa: E402
from builder.sandbox.runtime import Sandbox  # noqa: E402
from tests.fixtures.e2e_release import DUE, build_release, load_split, user_reply  # noqa: E402
from tests.fixtures.teacher import GOLD  # noqa: E402
from tests.llm_stub import StubServer, completion  # noqa: E402

LAYERS = 2
QUESTION = "Happy to help. Could you give me your member id, the book and when you will bring it back?"
WRONG_DUE = [*GOLD[:2], {**GOLD[2], "arguments": {**GOLD[2]["arguments"], "due": "2024-07-30"}}]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("release"))


def tool_calls(*calls: dict) -> str:
    return "".join(f"<tool_call>\n{json.dumps(call)}\n</tool_call>" for call in calls) + "<|im_end|>"


def reply(message: str) -> str:
    return tool_calls({"name": "reply_to_user", "arguments": {"message": message}})


def policy(prompt: str, row: int, first_call: bool) -> str:
    """The completion for one rendered prompt. Odd rows of the first batch play the wrong due date; later turns
    tell the variants apart by what the conversation already holds."""
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


@pytest.mark.parametrize("mode", ["non_conversational", "conversational"])
def test_one_grpo_step_on_the_rl_split(release, tmp_path, mode, monkeypatch):
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    envs = load_split(release, "environments", "rl", tmp_path / "hf")
    rl = load_split(release, "scenarios", "rl", tmp_path / "hf")
    assert sorted(rl["mode"]) == ["conversational", "non_conversational"]
    by_id = {row["env_id"]: row for row in envs}
    # One group of two rollouts per step (a step costs about 15 s of CPU per group); both classes are built.
    dataset = rl.filter(lambda row: row["mode"] == mode).map(lambda row: trl_prompt_row(row, by_id[row["env_id"]]))
    conversational = mode == "conversational"

    model_dir, _ = resolve_model(EMBEDDED_MODEL)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = chatml_tools_template().read_text()
    tokenizer.response_template = qwen3_template  # Hermes <tool_call> JSON inside ChatML, as the template writes
    # The first 2 of SmolLM2's 30 layers: the same weights, tokenizer and code path at a CPU-sized cost.
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=LAYERS)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}

    def respond(body):
        return 200, completion(user_reply(body["messages"]))

    args = GRPOConfig(
        output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
        max_completion_length=1024, learning_rate=1e-3, beta=0.0, logging_steps=1, report_to="none",
        use_cpu=True, shuffle_dataset=False, save_strategy="no", max_tool_calling_iterations=6,
        gradient_checkpointing=False,
    )  # fmt: skip
    with StubServer(respond) as user_server, Sandbox() as sandbox:
        user = SimulatedUser.endpoint(user_server.url, "user-sim")
        factories = trl_environment_factories(envs, rl, sandbox, user=user)
        trainer = GRPOTrainer(
            model=model, args=args, processing_class=tokenizer, train_dataset=dataset,
            environment_factory=factories,
        )  # fmt: skip
        generate = scripted_generate(tokenizer)
        started = time.monotonic()
        with patch.object(trainer.model, "generate", side_effect=generate):
            trainer.train()
        print(f"GRPO step: {time.monotonic() - started:.1f} s")

        # Every rollout's tool calls were parsed by TRL and ran in the sandbox: the checks graded the state
        # (the gold due date passes both checks, the wrong one only the copy count).
        name = next(iter(factories.values())).__name__ + ("Conversational" if conversational else "")
        assert sorted((type(env).__name__, env.get_reward()) for env in trainer.environments) == [
            (name, 0.5),
            (name, 1.0),
        ]
        dues = sorted(loan["due"] for env in trainer.environments for loan in env._live.state()["loans"].values()
                      if (loan["member_id"], loan["book_id"]) == ("m2", "b3"))  # fmt: skip
        assert dues == [DUE, "2024-07-30"]
        logs = trainer.state.log_history[0]
        assert logs["tools/failure_frequency"] == 0.0
        assert logs["tools/call_frequency"] == (5 if conversational else 3)  # calls per rollout
        assert logs["reward"] == pytest.approx(0.75) and logs[f"rewards/{name}/mean"] == pytest.approx(0.75)

    if conversational:  # the user opened, answered the question and stopped, over HTTP
        assert [env._conversation.end_reason for env in trainer.environments] == ["user_stop", "user_stop"]
        assert len(user_server.requests) == 2 * 3
        assert all("Hi, I would like to borrow a novel please." in text for text in generate.calls[0])
        assert any(ENDED in text for texts in generate.calls for text in texts)
    else:
        assert user_server.requests == []
    # The step moved the weights (the groups' reward spread gives a non-zero advantage).
    assert any(not torch.equal(before[name], p) for name, p in model.named_parameters())
