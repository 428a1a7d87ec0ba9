"""One real SFT step with TRL on a release from `python -m builder run`, running the code its card shows.

The pipeline runs with the scripted teacher (as in tests/test_pipeline_e2e.py), the release is published to the
local Hub and served by a real olah server, and the SFT block of the published card runs as is in a fresh
interpreter with `HF_ENDPOINT` pointing at it; only `MODEL` is swapped for the embedded SmolLM2-135M-Instruct
weights (the card names the Hub id, which cannot be downloaded here), and `max_steps` is set to 1 just before
`trainer.train()` (the card trains whole epochs). Then: the trainer took its steps with a
finite loss, TRL tokenized every row to exactly the length the card reports (so its `max_length` cut none), and
the loss mask (`assistant_only_loss`) covers exactly what the assistant wrote, each turn's `<|im_end|>` included.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast
from transformers.utils.chat_template_utils import render_jinja_template

from builder.config import load_config
from builder.llm.weights import EMBEDDED_MODEL, chatml_tools_template, resolve_model
from builder.publish.publish import publish
from builder.publish.server import LocalHub
from tests.test_pipeline_e2e import RL_FRACTION, model, run  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

# The card trains for whole epochs; CI takes one step (the trainer reads `max_steps` when it starts).
ONE_STEP = "trainer.args.max_steps = 1\ntrainer.train()\n"
# After the card's code: what the trainer did and how TRL tokenized the rows (read, not changed).
REPORT = """
import json as _json
_rows = [{"ids": list(row["input_ids"]), "mask": [int(label != -100) for label in row["labels"]]}
         for row in trainer.train_dataset]
_summary = trainer.state.log_history[-1]
print("REPORT " + _json.dumps({"steps": trainer.state.global_step, "loss": _summary["train_loss"],
                               "train_seconds": _summary["train_runtime"], "rows": _rows,
                               "max_length": args.max_length, "assistant_only_loss": args.assistant_only_loss}))
"""


def card_block(card: str, heading: str) -> str:
    """The first ```python block after `heading` in the card."""
    section = card[card.index(heading) :]
    return re.search(r"```python\n(.*?)\n```", section, re.DOTALL).group(1)


@pytest.fixture
def release(tmp_path, model, restore_logging):  # noqa: F811 (the e2e module's fixtures)
    """A run's release, published to the local Hub: (the run's root, its config)."""
    assert run(tmp_path, "main") == 0
    root = tmp_path / "main"
    folders = {"store.path": root / "store", "hub.root": root / "hub", "hub.release_root": tmp_path / "published"}
    sets = [f"{key}={json.dumps(str(value))}" for key, value in folders.items()]
    sets.append(f"select.rl_env_fraction={RL_FRACTION}")
    config = load_config(None, sets, profile="none")
    publish(config, "0.1.0", stats_path=root / "run" / "stats.json")
    return tmp_path / "published" / "0.1.0", config


def test_the_cards_sft_code_trains_one_step_on_the_assistant_tokens(release, tmp_path):
    folder, config = release
    card = (folder / "README.md").read_text()
    code = card_block(card, "### SFT")
    model_dir, _ = resolve_model(EMBEDDED_MODEL)
    line = next(line for line in code.splitlines() if line.startswith("MODEL = "))
    assert code.count("trainer.train()") == 1
    script = code.replace(line, f"MODEL = {json.dumps(model_dir)}").replace("trainer.train()", ONE_STEP) + REPORT
    work = tmp_path / "trainer"
    work.mkdir()
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(Path(__file__).parents[2])}  # fmt: skip
    env.pop("HF_HUB_OFFLINE", None)
    with LocalHub(config.hub.root) as hub:
        started = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-c", script], env={**env, "HF_ENDPOINT": hub.url}, cwd=work, capture_output=True,
            text=True, timeout=800,
        )  # fmt: skip
        seconds = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("REPORT "))[7:])
    lengths = sorted(len(row["ids"]) for row in report["rows"])
    print(
        f"card SFT code: {seconds:.1f} s in all, {report['train_seconds']:.1f} s training, {report['steps']} step, "
        f"loss {report['loss']:.3f}, rows of {lengths} tokens"
    )

    assert report["steps"] == 1 and report["assistant_only_loss"] is True and 0 < report["loss"] < 100

    # TRL tokenized every row to the length the card reports, within the card's max_length.
    from datasets import load_dataset

    sft = load_dataset(str(folder), "sft", split="train", cache_dir=str(tmp_path / "cache"))
    stats = re.search(r"\| rows \| min \| median \| p90 \| max \| mean \|\n\|[-|]+\|\n\| ([\d,]+) \| ([\d,]+) \|", card)
    assert stats, card
    rows, shortest = (int(group.replace(",", "")) for group in stats.groups())
    assert rows == len(report["rows"]) == sft.num_rows and shortest == lengths[0]
    assert f"| {lengths[-1]:,} |" in card and lengths[-1] <= report["max_length"]
    assert "max_length=" + str(report["max_length"]) in code

    # The loss mask is exactly the assistant's text and end token: the template's generation spans.
    tokenizer = PreTrainedTokenizerFast.from_pretrained(model_dir)
    template = chatml_tools_template().read_text()
    texts = {}
    for row in sft:
        messages = [{key: value for key, value in m.items() if value is not None} for m in row["messages"]]
        (text,), (spans,) = render_jinja_template(
            [messages], tools=json.loads(row["tools"]), chat_template=template, return_assistant_tokens_mask=True
        )
        texts[len(tokenizer(text)["input_ids"])] = "".join(text[start:end] for start, end in spans)
    for row in report["rows"]:
        trained = tokenizer.decode([token for token, keep in zip(row["ids"], row["mask"], strict=True) if keep])
        assert trained == texts[len(row["ids"])] and trained.count("<|im_end|>") >= 2
        assert 0 < sum(row["mask"]) < len(row["ids"]) / 2  # the system prompt with the tools is most of a row
