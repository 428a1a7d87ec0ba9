import json
import time

import polars as pl
import pytest

from builder.config import load_config
from builder.llm import ChatRequest, LLMRequestError, ScriptedModel
from builder.llm.connect import client_for
from builder.pipeline import STAGES, LazyModel
from builder.records import Rejection, SeedTask, Topic
from builder.run.executor import run_stages
from builder.run.stage import Rejected, StageContext
from builder.stages.dedupe import dedupe
from builder.stages.mine import mine
from builder.stats import StageStats

GOOD_TOPIC = {
    "name": "Hotel Booking",
    "description": "A hotel's reservation desk: rooms, guests and bookings.",
    "domain": "Travel",
    "core_entities": ["Room", "guest", "booking", "Guest"],
    "modelability": 8,
    "usefulness": 9,
}


def schema_name(request: ChatRequest) -> str:
    return request.response_format["json_schema"]["name"] if request.response_format else ""


def scripted(judge="yes", topic=GOOD_TOPIC):
    def answer(request: ChatRequest):
        if schema_name(request) == "Judgement":
            if isinstance(judge, str) and judge in ("yes", "no"):
                return json.dumps({"reason": "needs bookings", "needs_stateful_system": judge == "yes"})
            return judge
        return topic if isinstance(topic, BaseException) else (json.dumps(topic) if isinstance(topic, dict) else topic)

    return ScriptedModel(answer)


def context(tmp_path, model, *overrides):
    config = load_config(None, list(overrides))
    return StageContext(config, "hash", tmp_path, StageStats("mine"), llm=client_for(config.llm, model, model_id="m"))


def seed(text="Cancel booking H-2291 and rebook room 12 for May 4"):
    return SeedTask(provenance={"config_hash": "hash"}, source="builtin", source_ref="0", request=text)


async def test_good_seed_becomes_a_normalised_topic(tmp_path):
    (topic,) = await mine(seed(), context(tmp_path, scripted()))
    assert isinstance(topic, Topic)
    assert (topic.name, topic.domain) == ("hotel_booking", "travel")
    assert topic.entities == ("room", "guest", "booking")
    assert (topic.modelability, topic.usefulness) == (0.8, 0.9)
    assert topic.example_requests == (seed().request,)
    assert topic.provenance.parent_ids == (seed().id,)
    assert topic.provenance.model == "m"
    assert topic.provenance.prompt_version.startswith("mine_judge@")


async def test_not_stateful_is_rejected_with_the_reason(tmp_path):
    with pytest.raises(Rejected) as verdict:
        await mine(seed(), context(tmp_path, scripted(judge="no")))
    assert verdict.value.rejection.reason == "not_stateful"
    assert verdict.value.rejection.detail == "needs bookings"


async def test_malformed_judge_output_keeps_raw_text_after_bounded_retries(tmp_path):
    model = scripted(judge='{"reason": "x", "needs_stateful_system": "maybe"')
    with pytest.raises(Rejected) as verdict:
        await mine(seed(), context(tmp_path, model, "llm.structured_retries=2"))
    rejection = verdict.value.rejection
    assert rejection.reason == "judge_invalid"
    assert rejection.raw_output.startswith('{"reason": "x"')
    assert len(model.requests) == 3  # the first try and two repairs, each with the error fed back
    assert (
        "invalid" in model.requests[-1].messages[-1].content.lower()
        or "error" in model.requests[-1].messages[-1].content.lower()
    )


@pytest.mark.parametrize(
    ("topic", "reason"),
    [
        ({**GOOD_TOPIC, "modelability": 3}, "low_score"),
        ({**GOOD_TOPIC, "modelability": 42}, "topic_invalid"),  # out of the schema's range
        ({**GOOD_TOPIC, "name": "!!!"}, "topic_invalid"),
        ("not json at all", "topic_invalid"),
    ],
)
async def test_bad_topics_are_rejected(tmp_path, topic, reason):
    with pytest.raises(Rejected) as verdict:
        await mine(seed(), context(tmp_path, scripted(topic=topic)))
    assert verdict.value.rejection.reason == reason


async def test_a_refused_request_and_one_failed_after_every_retry_are_rejections(tmp_path):
    with pytest.raises(Rejected) as verdict:
        await mine(seed(), context(tmp_path, scripted(topic=LLMRequestError("400 bad", status_code=400))))
    assert verdict.value.rejection.reason == "llm_request"
    failed = LLMRequestError("failed after 5 attempts: HTTP 429", status_code=429, retryable=True)
    with pytest.raises(Rejected) as verdict:
        await mine(seed(), context(tmp_path, scripted(topic=failed)))
    assert verdict.value.rejection.reason == "llm_request" and "HTTP 429" in verdict.value.rejection.detail


def topic(name, description, domain="travel", score=0.8, examples=("r",)):
    return Topic(
        provenance={"config_hash": "h", "parent_ids": [f"seed-{name}"]},
        name=name,
        description=description,
        domain=domain,
        example_requests=examples,
        modelability=score,
        usefulness=score,
    )


async def test_dedupe_merges_near_duplicates_and_caps(tmp_path):
    topics = [
        topic(
            "hotel_booking",
            "A hotel's reservation desk managing rooms, guests and bookings.",
            score=0.9,
            examples=("a",),
        ),
        topic(
            "hotel_reservations",
            "A hotel reservation desk that manages rooms, guests and their bookings.",
            score=0.7,
            examples=("b",),
        ),
        topic("hotel_booking", "Another text for the same name.", score=0.6, examples=("c",)),
        topic("library_loans", "A public library's lending desk: members, books and loans.", domain="library"),
        topic("flight_booking", "An airline booking system with flights, seats and passengers.", score=0.85),
        topic("pharmacy_orders", "A pharmacy's prescription and refill ordering system.", domain="health", score=0.75),
    ]
    ctx = StageContext(
        load_config(None, ["mine.max_per_domain=1", "mine.max_topics=2"]), "h", tmp_path, StageStats("dedupe")
    )
    results = await dedupe(topics, ctx)
    kept = [r for r in results if isinstance(r, Topic)]
    reasons = {r.subject_id: r.reason for r in results if isinstance(r, Rejection)}
    assert [t.name for t in kept] == ["hotel_booking", "library_loans"]
    assert set(kept[0].example_requests) == {"a", "b", "c"}  # the best topic keeps its twins' requests
    assert reasons[topics[1].id] == "near_duplicate"
    assert reasons[topics[2].id] == "duplicate"
    assert reasons[topics[4].id] == "domain_cap"  # travel already has hotel_booking
    assert reasons[topics[5].id] == "max_topics"


async def test_pipeline_collect_mine_dedupe_with_scripted_model(tmp_path):
    seeds = tmp_path / "seeds.jsonl"
    rows = [
        "Cancel booking H-2291 and rebook room 12",
        "Write me a poem about the sea please",
        "Renew loan L-77 for member M-3 at the library",
        "Draw an image of a cat",
    ]
    seeds.write_text("\n".join(json.dumps({"request": r}) for r in rows) + "\n")

    def answer(request: ChatRequest):
        text = request.messages[1].content
        if schema_name(request) == "Judgement":
            return json.dumps({"reason": "r", "needs_stateful_system": "poem" not in text})
        name = "hotel_booking" if "H-2291" in text else "library_loans"
        return json.dumps({**GOOD_TOPIC, "name": name, "description": f"The {name} system."})

    config = load_config(None, [f"mine.seeds={seeds}"])
    model = ScriptedModel(answer)
    lazy = LazyModel(config.llm, lambda on_call: client_for(config.llm, model, model_id="m", on_call=on_call))
    stats = await run_stages(STAGES, config, tmp_path / "run", llm=lazy.for_stage, until="dedupe")
    assert stats["collect"].kept == 3 and dict(stats["collect"].dropped) == {"media": 1}
    assert stats["mine"].kept == 2 and dict(stats["mine"].dropped) == {"not_stateful": 1}
    assert stats["mine"].usage.calls == 5 and stats["mine"].usage.prompt_tokens > 0
    assert stats["collect"].usage.calls == 0
    assert sorted(pl.read_parquet(tmp_path / "run" / "dedupe.parquet")["name"]) == ["hotel_booking", "library_loans"]
    # A rerun answers from nothing: the stage tables say everything is done.
    calls = len(model.requests)
    await run_stages(STAGES, config, tmp_path / "run", llm=lazy.for_stage, until="dedupe")
    assert len(model.requests) == calls


def test_signal_during_model_start_up_interrupts_at_once(tmp_path):
    import os
    import signal
    import threading
    import time

    from builder.run.executor import Interrupted

    def slow_start(on_call):
        time.sleep(30)  # a vLLM server booting; the event loop cannot see signals meanwhile

    lazy = LazyModel(load_config().llm, slow_start)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    started = time.monotonic()
    with pytest.raises(Interrupted) as stop:
        lazy._started()
    assert stop.value.signum == signal.SIGTERM
    assert time.monotonic() - started < 5
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the previous handler is back


@pytest.mark.parametrize("failure", ["signal", "server_error"])
async def test_a_failed_model_start_is_not_retried_by_the_other_items(tmp_path, failure):
    import os
    import signal

    from builder.llm.errors import ServerError
    from builder.run.executor import Interrupted

    starts = []

    def failing_start(on_call):
        starts.append(1)
        if failure == "signal":
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the (blocking) start-up runs
            time.sleep(5)
        raise ServerError("vLLM exited with code 1 during start-up")

    config = load_config(None, ["mine.max_seeds=6", "llm.max_concurrency=6"])
    lazy = LazyModel(config.llm, failing_start)
    with pytest.raises(Interrupted if failure == "signal" else ServerError):
        await run_stages(STAGES, config, tmp_path / "run", llm=lazy.for_stage, until="mine")
    assert len(starts) == 1  # six items were in flight; one start-up, not six


def test_free_text_in_model_facing_schemas_is_bounded():
    """A constrained decoder closes a string at maxLength, so a looping small model still ends its JSON."""
    from builder.stages.evaluate.agents import CheckerVerdicts, TesterCalls
    from builder.stages.mine import Judgement, TopicDraft
    from builder.stages.plan.rules import OperationsDraft, StateDraft
    from builder.stages.scenarios.requests import CheckCode, CheckCodes, GoldSolution, TaskDraft, checks_model

    def unbounded(schema: dict, path: str = "") -> list[str]:
        if schema.get("type") == "string" and "enum" not in schema:
            return [] if "maxLength" in schema else [path]
        found = []
        for name, sub in schema.get("properties", {}).items():
            found += unbounded(sub, f"{path}.{name}")
        if isinstance(schema.get("items"), dict):
            found += unbounded(schema["items"], f"{path}[]")
        if "$ref" in schema:
            found += unbounded(defs[schema["$ref"].rsplit("/", 1)[-1]], path)
        return found

    for model in (
        Judgement,
        TopicDraft,
        CheckerVerdicts,
        TesterCalls,
        StateDraft,
        OperationsDraft,
        TaskDraft,
        GoldSolution,
        CheckCode,
        CheckCodes,
        checks_model(3),
    ):
        schema = model.model_json_schema()
        defs = schema.get("$defs", {})
        assert unbounded(schema) == [], model.__name__
