"""Batched tester and checker requests (evaluate.calls_per_request) and the sequential acceptance rule."""

import json
import random

import pytest

from builder.sandbox.runtime import Sandbox
from builder.stages.evaluate import evaluate
from builder.stages.evaluate.sequential import settled, wilson
from scripts.evaluate_cost import FIXTURE_SET, measure
from tests.fixtures.teacher import calls_judged
from tests.test_stage_evaluate import (
    FAST,
    GOOD_ARGS,
    PASS,
    calls,
    context,
    environment,
    kind,
    rejection,
    scripted,
)

# Five calls a request, with the context of a model that can judge five at once (the CPU profile's 4096 tokens
# are for one call a request).
BATCHED = ("evaluate.calls_per_request=5", "llm.max_model_len=8192")


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(FAST) as runtime:
        yield runtime


FAIL = {"analysis": "wrong", "verdict": "fail", "reason": "the balance is wrong"}


def rule(passes: int, judged: int, total: int = 100, negatives: int = 99):
    return settled(passes, judged, negatives, total=total, keep_score=0.85, min_calls=30, min_negatives=10,
                   confidence=0.99)  # fmt: skip


def test_the_rule_settles_clear_cases_and_waits_near_the_threshold():
    assert rule(29, 29) is None  # fewer than min_calls
    assert rule(30, 30, negatives=9) is None  # too few negative cases
    assert rule(35, 35) == "accept" and rule(10, 35) == "reject"
    assert rule(30, 35) is None and rule(60, 70) is None  # 0.86 near 0.85: judge on
    assert rule(85, 90) == "accept"  # 85 passes of 100 reached whatever the last 10 say
    assert rule(70, 90) == "reject"  # 70 + 10 < 85: cannot reach it
    lower, upper = wilson(30, 30, 0.99)
    assert 0.84 < lower < 0.85 and upper == 1.0


def simulate(true_rate: float, trials: int, seed: int = 7) -> tuple[float, float]:
    """(share of environments whose early verdict differs from the verdict over all 100, mean calls judged)."""
    rng, differ, judged_total = random.Random(seed), 0, 0
    for _ in range(trials):
        outcomes = [rng.random() < true_rate for _ in range(100)]
        full = "accept" if sum(outcomes) >= 85 else "reject"
        decision, judged = None, 0
        while decision is None and judged < 100:
            judged = min(100, judged + 10)  # two states x 5 calls a round
            decision = rule(sum(outcomes[:judged]), judged, negatives=judged // 2)
        decision = decision or full
        differ += decision != full
        judged_total += judged
    return differ / trials, judged_total / trials


@pytest.mark.parametrize(
    ("rate", "max_error", "max_calls"),
    [(1.0, 0.0, 40), (0.97, 0.01, 70), (0.85, 0.05, 100), (0.75, 0.03, 100), (0.5, 0.0, 40)],
)
def test_the_rules_error_rate_and_cost_by_true_pass_rate(rate, max_error, max_calls):
    """The figures docs/synthesis.md states: early verdicts rarely differ from the full-N verdict, clear
    environments stop at the minimum, environments near keep_score are judged to (nearly) all N."""
    error, mean_calls = simulate(rate, 2000)
    assert error <= max_error and mean_calls <= max_calls, (error, mean_calls)


async def test_a_clear_good_environment_stops_at_the_minimum_with_k_calls_per_request(tmp_path, sandbox):
    model = scripted()
    ctx = context(tmp_path, model, sandbox, "evaluate.calls=100", "llm.max_model_len=32768", *BATCHED)
    (accepted,) = await evaluate(environment("bank"), ctx)
    evidence = accepted.evaluation
    # 30 passes of 30 put the Wilson bound at 0.849: the round after (2 states x 5 calls) settles it.
    assert evidence.settled_early == "accept" and evidence.counts.judged == 40 and evidence.score == 1.0
    testers = [r for r in model.requests if kind(r) == "tester"]
    checkers = [r for r in model.requests if kind(r) == "checker"]
    assert len(testers) == len(checkers) == 8  # 40 calls, 5 per request
    assert all(len(calls_judged(r)) == 5 for r in checkers)
    assert checkers[0].sampling.max_tokens == 5 * ctx.config.evaluate.checker_max_tokens  # K verdicts' budget
    assert sum(call.case == "negative" for call in evidence.calls) == 20


async def test_a_clear_bad_environment_is_rejected_early(tmp_path, sandbox):
    model = scripted(checker=FAIL)
    rejected = await rejection(environment("bank"), context(tmp_path, model, sandbox, "evaluate.calls=100", *BATCHED))
    assert rejected.reason == "low_score" and "over 30 judged calls" in rejected.detail


async def test_an_environment_near_the_threshold_is_judged_to_n(tmp_path, sandbox):
    count = {"n": 0}

    def one_in_seven(request):  # 6 passes in 7: a pass share of 0.857, just above keep_score
        out = []
        for n in calls_judged(request):
            count["n"] += 1
            out.append({"call": n, **(FAIL if count["n"] % 7 == 0 else PASS)})
        return json.dumps({"verdicts": out})

    ctx = context(tmp_path, scripted(checker=one_in_seven), sandbox, "evaluate.calls=100", *BATCHED)
    (accepted,) = await evaluate(environment("bank"), ctx)
    assert accepted.evaluation.counts.judged >= 90 and accepted.evaluation.settled_early in (None, "accept")


async def test_fewer_verdicts_and_unknown_call_numbers_are_counted_not_judged(tmp_path, sandbox):
    def partial(request):  # the last call of a batch of several gets no verdict; a verdict for call 9 names no call
        numbers = calls_judged(request)
        items = [{"call": n, **PASS} for n in (numbers[:-1] if len(numbers) > 1 else numbers)] + [{"call": 9, **PASS}]
        return json.dumps({"verdicts": items})

    ctx = context(tmp_path, scripted(checker=partial), sandbox, "evaluate.calls=8", "evaluate.test_states=1",
                  "evaluate.max_invalid_replies=6", *BATCHED)  # fmt: skip
    (accepted,) = await evaluate(environment("bank"), ctx)
    evidence = accepted.evaluation
    assert evidence.counts.judged == 8 and evidence.counts.invalid_replies >= 2
    assert {item.kind for item in evidence.invalid_replies} == {"checker_invalid"}
    assert all("no verdict for call" in item.detail for item in evidence.invalid_replies)


async def test_bad_checker_json_is_re_asked_then_the_reply_counted_once(tmp_path, sandbox):
    """An unusable reply is one unusable reply, however many calls its batch held: the bound counts replies, as
    before batches (else a fifth of faulty replies would give up on every state)."""
    model = scripted(checker='{"verdicts": [{"call": 1, "verdict": "maybe"')
    ctx = context(tmp_path, model, sandbox, "evaluate.calls=10", "evaluate.max_invalid_replies=4",
                  "llm.structured_retries=1", *BATCHED)  # fmt: skip
    rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "checker_invalid" and "checker_invalid=10" in rejected.detail  # 5 replies per state
    assert sum(kind(r) == "checker" for r in model.requests) == 2 * 5 * 2  # 5 batches per state, each asked twice


async def test_tester_items_for_unknown_slots_are_counted_and_their_slots_asked_again(tmp_path, sandbox):
    def tester(request):
        reply = json.loads(calls(lambda tool, case, r: (tool, GOOD_ARGS[tool]))(request))
        reply["calls"].append({"call": 42, "tool": "transfer", "arguments": {}})
        if "unknown_call" not in request.messages[1].content:
            reply["calls"] = reply["calls"][1:]  # the first slot left out: asked again next batch
        return json.dumps(reply)

    ctx = context(tmp_path, scripted(tester=tester), sandbox, "evaluate.calls=10", "evaluate.test_states=1",
                  "evaluate.max_invalid_replies=5", *BATCHED)  # fmt: skip
    (accepted,) = await evaluate(environment("bank"), ctx)
    evidence = accepted.evaluation
    assert evidence.counts.judged == 10 and {i.kind for i in evidence.invalid_replies} == {"unknown_call"}
    assert evidence.tool_coverage == 1.0


async def test_a_call_to_another_tool_than_its_slot_is_a_wrong_tool_item(tmp_path, sandbox):
    model = scripted(tester=calls(lambda tool, case, request: ("get_account", GOOD_ARGS["get_account"])))
    ctx = context(tmp_path, model, sandbox, "evaluate.calls=4", "evaluate.max_invalid_replies=1", *BATCHED)
    rejected = await rejection(environment("bank"), ctx)
    assert rejected.reason == "tester_invalid" and "wrong_tool" in rejected.detail


@pytest.mark.parametrize("name", sorted(FIXTURE_SET))
async def test_decisions_on_the_fixture_set_equal_those_of_single_call_requests(tmp_path, sandbox, name):
    """The good and broken banks of scripts/evaluate_cost.py with a checker that rules from the facts each call's
    section shows: at K = 5 with the sequential rule the keep/reject decision is the one of K = 1 over all N
    calls (builder before batches asked one call per request), and the expected one."""
    code, expected = FIXTURE_SET[name]
    single = await measure(name, code, 100, sandbox, tmp_path / "single", "evaluate.calls_per_request=1",
                           "evaluate.min_calls=100")  # fmt: skip
    batched = await measure(name, code, 100, sandbox, tmp_path / "batched", "evaluate.calls_per_request=5")
    assert single["decision"] == batched["decision"] == expected
    assert single["judged"] == 100 and batched["check_prompt_tokens"] < 0.45 * single["check_prompt_tokens"]


async def test_the_tester_reply_is_constrained_to_each_slots_tool_and_its_parameters(tmp_path, sandbox):
    model = scripted()
    ctx = context(tmp_path, model, sandbox, "evaluate.calls=10", "evaluate.test_states=1", *BATCHED)
    await evaluate(environment("bank"), ctx)
    first = next(r for r in model.requests if kind(r) == "tester")
    items = first.response_format["json_schema"]["schema"]["properties"]["calls"]["items"]["anyOf"]
    slots = [(item["properties"]["call"]["enum"][0], item["properties"]["tool"]["enum"][0]) for item in items]
    assert slots == [(1, "get_account"), (2, "list_accounts"), (3, "transfer"), (4, "freeze_account"),
                     (5, "get_account")]  # fmt: skip
    transfer = items[2]["properties"]["arguments"]
    assert set(transfer["properties"]) == {"source", "target", "amount", "memo"} and "amount" in transfer["required"]
