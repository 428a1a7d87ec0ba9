"""The verifiers adapter (builder/adapters/verifiers.py) against the real `verifiers` package (v1 API): the
release's `rl` split loaded through `vf.load_environment`, one rollout of verifiers' own `null` chat harness in
its subprocess runtime, the environment's tools served by the task's MCP tool server over a builder sandbox,
and the model a scripted OpenAI-compatible endpoint (it streams, as verifiers' interception server asks).

The harness program is a PEP 723 script that verifiers installs with `uv` on first use (from PyPI, cached
after that), so the first run on a machine takes longer.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

vf = pytest.importorskip("verifiers.v1")

from builder.adapters.verifiers import BuilderTaskset, BuilderTasksetConfig, ScenarioData, grade, hub_package  # noqa: E402
from builder.envs.conversation import ENDED  # noqa: E402
from tests.fixtures.e2e_release import OPENING, build_release, user_reply  # noqa: E402
from tests.fixtures.teacher import GOLD  # noqa: E402
from tests.llm_stub import StubServer, completion  # noqa: E402

WRONG_DUE = [*GOLD[:2], {**GOLD[2], "arguments": {**GOLD[2]["arguments"], "due": "2024-07-30"}}]


class StreamingModel:
    """A scripted chat-completions endpoint that answers `stream: true` requests with server-sent events.

    `respond(body) -> message` gives the assistant message (`content`, `tool_calls`); bodies are recorded.
    """

    def __init__(self, respond) -> None:
        self.respond = respond
        self.requests: list[dict[str, Any]] = []
        model = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                model.requests.append(body)
                raw = b"".join(f"data: {json.dumps(event)}\n\n".encode() for event in events(model.respond(body)))
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(raw) + len(b"data: [DONE]\n\n")))
                self.end_headers()
                self.wfile.write(raw + b"data: [DONE]\n\n")

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self) -> StreamingModel:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def events(message: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat.completion.chunk events of one whole message, then the finish and the usage."""
    base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "scripted"}
    delta: dict[str, Any] = {"role": "assistant", "content": message.get("content")}
    calls = message.get("tool_calls") or []
    if calls:
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(calls)]
    finish = "tool_calls" if calls else "stop"
    return [
        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]},
        {**base, "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
        {**base, "choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}},
    ]


def agent(actions: list[dict[str, Any]]):
    """Plays `actions` one call per turn, then reports; the tool results come back as tool messages."""

    def respond(body: dict[str, Any]) -> dict[str, Any]:
        done = sum(message["role"] == "tool" for message in body["messages"])
        if done < len(actions):
            action = actions[done]
            call = {"id": f"call-{done}", "type": "function",
                    "function": {"name": action["name"], "arguments": json.dumps(action["arguments"])}}  # fmt: skip
            return {"content": None, "tool_calls": [call]}
        return {"content": "Done: book b3 is lent to member m2."}

    return respond


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return build_release(tmp_path_factory.mktemp("release"))


@pytest.fixture
def package(release, tmp_path, monkeypatch):
    """The release's Environments Hub package, importable as `lending_envs` (as `pip install` would make it)."""
    module = hub_package(tmp_path / "pkg", "lending_envs", str(release), None)
    monkeypatch.syspath_prepend(str(module.parent))
    yield module
    sys.modules.pop("lending_envs", None)


def env_row(release):
    from datasets import load_dataset

    (row,) = load_dataset(str(release), "environments", split="rl")
    return row


def test_load_environment_and_one_rollout(package, release, monkeypatch):
    monkeypatch.setenv("SCRIPTED_KEY", "local")
    env = vf.load_environment(vf.resolve_env_config({
        "taskset": {"id": "lending_envs"},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": 8},
    }))  # fmt: skip
    assert isinstance(env.taskset, BuilderTaskset) and env.taskset.config.split == "rl"
    (task,) = list(env.taskset)  # the non-conversational scenario of the rl split (no user model configured)
    assert task.data.prompt.startswith("I'm Ada Palmer") and "borrow_book" not in task.data.prompt
    assert "The current date and time is" in task.data.system_prompt

    async def rollout(url: str):
        ctx = vf.ModelContext(model="scripted", client=vf.EvalClientConfig(base_url=url, api_key_var="SCRIPTED_KEY"))
        async with env.serving():
            return await env.run_episode(task, ctx)

    with StreamingModel(agent(GOLD)) as model:
        started = time.monotonic()
        episode = asyncio.run(rollout(model.url))
        print(f"verifiers rollout: {time.monotonic() - started:.1f} s")
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.reward == 1.0
    final = trace.state.final_state
    assert [loan for loan in final["loans"].values() if loan["member_id"] == "m2" and not loan["returned"]]
    # The model saw the environment's tools under their own names, with the published parameters and their
    # descriptions (MCP derives the schemas from the signatures: titles added, Optional as anyOf), and each
    # call's result came back.
    published = {t["function"]["name"]: t["function"]["parameters"] for t in json.loads(env_row(release)["tools"])}
    seen = {t["function"]["name"]: t["function"]["parameters"] for t in model.requests[0]["tools"]}
    assert set(seen) == set(published)
    for name, parameters in published.items():
        assert seen[name]["required"] == parameters["required"]
        assert {key: value.get("description") for key, value in seen[name]["properties"].items()} == {
            key: value.get("description") for key, value in parameters["properties"].items()
        }
    assert [m["role"] for m in model.requests[-1]["messages"]].count("tool") == len(GOLD)


def test_grade_is_the_share_of_checks_passed(release):
    (task,) = list(BuilderTaskset(BuilderTasksetConfig(path=str(release))))
    data: ScenarioData = task.data
    assert grade(data, data.initial_state) == 0.0
    state = json.loads(json.dumps(data.initial_state))
    state["books"]["b3"]["copies"] -= 1  # one of the two checks
    assert grade(data, state) == 0.5


def test_hub_package_pins_its_release(package, release, tmp_path):
    assert (package.parent / "pyproject.toml").read_text().count('"builder-envs[verifiers]"') == 1
    config = vf.resolve_env_config({"taskset": {"id": "lending_envs", "split": "train"}})
    assert type(config.taskset).__name__ == "ReleaseConfig" and config.taskset.path == str(release)
    train = [task.data.env_id for task in vf.load_environment(config).taskset]
    rl = [task.data.env_id for task in BuilderTaskset(BuilderTasksetConfig(path=str(release)))]
    assert len(train) == len(rl) == 1 and train != rl  # the splits never share an environment
    with pytest.raises(ValueError, match="not a Python identifier"):
        hub_package(tmp_path / "bad", "lending-envs", str(release), None)


def reply(message: str) -> dict:
    return {"name": "reply_to_user", "arguments": {"message": message}}


def conversational_episode(release, user_url: str, agent_url: str):
    taskset = BuilderTaskset(BuilderTasksetConfig(path=str(release), task={"tools": {
        "user_model": "user-sim", "user_base_url": user_url}}))  # fmt: skip
    tasks = {task.data.scenario is not None: task for task in taskset}
    assert len(tasks) == 2  # with a user model, both scenarios of the rl split
    task = tasks[True]
    assert task.data.prompt == "" and "reply_to_user" in task.data.system_prompt
    env = vf.load_environment(vf.resolve_env_config({
        "taskset": {"id": "lending_envs", "task": {"tools": {"user_model": "user-sim", "user_base_url": user_url}}},
        "agent": {"harness": {"id": "null"}, "runtime": {"type": "subprocess"}, "max_turns": 10},
    }))  # fmt: skip

    async def rollout():
        ctx = vf.ModelContext(
            model="scripted", client=vf.EvalClientConfig(base_url=agent_url, api_key_var="SCRIPTED_KEY")
        )
        async with env.serving():
            return await env.run_episode(task, ctx)

    return asyncio.run(rollout())


def test_a_conversational_scenario_is_one_episode_with_the_simulated_user(package, release, monkeypatch):
    monkeypatch.setenv("SCRIPTED_KEY", "local")
    question = "Could you give me your member id, the book and when you will bring it back?"
    script = [reply(question), *GOLD, reply("Done: b3 is lent to you.")]
    with (
        StubServer(lambda body: (200, completion(user_reply(body["messages"])))) as user,
        StreamingModel(agent(script)) as model,
    ):
        episode = conversational_episode(release, user.url, model.url)
    assert episode.ok, episode.errors
    (trace,) = episode.traces
    assert trace.reward == 1.0 and trace.state.user_end == "user_stop"
    first = model.requests[0]
    assert [m["content"] for m in first["messages"] if m["role"] == "user"] == [OPENING]  # the user opened
    assert "reply_to_user" in {t["function"]["name"] for t in first["tools"]}
    results = [m["content"] for m in model.requests[-1]["messages"] if m["role"] == "tool"]
    assert len(results) == len(script) and ENDED in results[-1]  # the user stopped after the confirmation
    assert len(user.requests) == 3  # the opening (at setup), the answer to the question, the stop


def test_a_conversational_episode_whose_user_fails_is_void(package, release, monkeypatch):
    monkeypatch.setenv("SCRIPTED_KEY", "local")
    with (
        StubServer(lambda body: (400, {"error": {"message": "bad request"}})) as user,
        StreamingModel(agent(GOLD)) as model,
    ):
        episode = conversational_episode(release, user.url, model.url)
    (trace,) = episode.traces
    assert not episode.ok and "no opening message" in str(trace.errors) and not trace.rewards  # no reward
    assert model.requests == []  # the agent never ran
