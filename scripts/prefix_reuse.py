"""Prefix reuse by request kind, offline: the real requests of a whole scripted pipeline run, measured as
`stats.json` measures them (`builder/llm/prefix.py`, one server), without a model server.

`python -m builder run` goes from seeds to a release candidate with the scripted teacher of
tests/fixtures/teacher.py behind `llm.url` (as tests/test_pipeline_e2e.py does), at `evaluate.calls` calls per
environment; every request the teacher gets is kept in the order it arrived and then read through one
`PrefixIndex`. The kind of a request is the prompt file whose text it carries.

    python -m scripts.prefix_reuse [--calls 40] [--json]

Run from a checkout's root: the checkout's `builder` is measured (for a before/after, run it in both).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from collections import defaultdict
from pathlib import Path
from unittest import mock

import builder.prompts as prompts_package
from builder.cli import main as builder_main
from builder.llm import ChatRequest, ScriptedModel
from builder.llm.prefix import PrefixIndex, prompt_text
from builder.prompts import prompt
from builder.stages.evaluate.agents import VERDICTS_PART
from tests.fixtures.teacher import SEEDS, teacher

PROMPTS = sorted(path.stem for path in Path(prompts_package.__file__).parent.glob("*.md"))


def request_kind(request: ChatRequest) -> str:
    """The prompt file whose opening line the request carries (the longest such opening wins), else "other"; a
    scenario writer's, test-state writer's or checker's request (each carries two parts' prompts) by the part it
    asks for."""
    text = "\n".join(message.content or "" for message in request.messages)
    if prompt("evaluate_roles") in text:
        return "evaluate_checker" if VERDICTS_PART in text else "evaluate_state"
    if prompt("scenario_writer") in text:
        return "scenario_gold" if "## Write\nThe part `solution`" in text else "scenario_task"
    found = [name for name in PROMPTS if prompt(name).split("\n", 1)[0] in text]
    return max(found, key=lambda name: len(prompt(name).split("\n", 1)[0])) if found else "other"


def scripted_run(root: Path, calls: int) -> list[ChatRequest]:
    """Every request of one `python -m builder run` with the scripted teacher, in the order they came."""
    scripted = ScriptedModel(teacher)
    seeds = root / "seeds.jsonl"
    seeds.write_text("".join(json.dumps({"request": seed}) + "\n" for seed in SEEDS))
    overrides = {
        "llm.url": "http://teacher.invalid/v1",
        "mine.seeds": seeds,
        "evaluate.calls": calls,
        "scenarios.per_environment": 1,
        "rollout.samples_per_scenario": 2,
        "store.path": root / "store",
        "hub.root": root / "hub",
        "hub.release_root": root / "release",
    }
    args = [arg for key, value in overrides.items() for arg in ("--set", f"{key}={value}")]
    with mock.patch("builder.llm.connect.OpenAIChatModel", lambda *a, **k: scripted):
        code = builder_main(["run", "--profile", "none", "--run-dir", str(root / "run"), *args])
    if code != 0:
        raise SystemExit(f"the scripted run failed ({code})")
    return scripted.requests


def reuse_by_kind(requests: list[ChatRequest]) -> dict[str, dict[str, float]]:
    """Per kind and overall: requests, prompt characters, reused characters and their share."""
    index, sums = PrefixIndex(), defaultdict(lambda: [0, 0, 0])
    for request in requests:
        reused, chars = index.observe(prompt_text(request))
        for kind in (request_kind(request), "overall"):
            sums[kind][0] += 1
            sums[kind][1] += chars
            sums[kind][2] += reused
    return {
        kind: {"requests": n, "prompt_chars": chars, "prefix_chars": reused, "prefix_reuse": round(reused / chars, 3)}
        for kind, (n, chars, reused) in sorted(sums.items(), key=lambda item: item[0] == "overall")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=40, help="evaluate.calls per environment")
    parser.add_argument("--json", action="store_true")
    options = parser.parse_args()
    logging.disable(logging.WARNING)
    with tempfile.TemporaryDirectory() as folder:
        figures = reuse_by_kind(scripted_run(Path(folder), options.calls))
    if options.json:
        print(json.dumps(figures, indent=1))
        return
    print(f"{'request kind':<28}{'requests':>9}{'prompt chars':>14}{'prefix reuse':>14}")
    for kind, row in figures.items():
        print(f"{kind:<28}{row['requests']:>9}{row['prompt_chars']:>14}{row['prefix_reuse']:>14.2f}")


if __name__ == "__main__":
    sys.exit(main())
