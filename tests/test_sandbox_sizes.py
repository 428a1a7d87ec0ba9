"""Real state sizes with the default limits: tens of MB of JSON load, snapshot and diff without a flag; the caps
that remain (state, tool result, frame) still answer with their kinds; a large decode pauses the collector and
always restores it."""

from __future__ import annotations

import gc
import json

import pytest

from builder.config import SandboxConfig
from builder.envs.session import Session, SessionError, diff_states
from builder.sandbox import frames
from builder.sandbox.bench import SIZED_ENV, sized_state
from builder.sandbox.runtime import Sandbox


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig()) as runtime:  # the defaults: no limit raised by hand
        yield runtime


def test_a_20mb_state_loads_changes_snapshots_and_diffs_with_the_defaults(sandbox):
    state = sized_state(20_000_000)
    assert len(json.dumps(state)) > 20_000_000
    with Session(sandbox, SIZED_ENV, state) as session:
        result = session.call("set_status", {"order_id": "o3", "status": "shipped"})
        assert result.ok and result.result["status"] == "shipped"
        after = session.snapshot()
    assert len(after["orders"]) == len(state["orders"])
    assert diff_states(state, after) == [{"path": "orders.o3.status", "before": "pending", "after": "shipped"}]


def test_the_issues_4_5mb_attribute_is_no_longer_refused(sandbox):
    state = sized_state(4_500_000)
    with Session(sandbox, SIZED_ENV, state) as session:
        assert session.snapshot() == state


def test_a_state_above_max_state_bytes_is_too_large_and_a_result_keeps_its_own_cap():
    config = SandboxConfig(max_state_bytes=100_000, max_result_bytes=1024)
    with Sandbox(config) as small, Session(small, SIZED_ENV, sized_state(200_000)) as session:
        with pytest.raises(SessionError) as raised:
            session.snapshot()
        assert raised.value.kind == "too_large" and "state is larger than 100000 bytes" in str(raised.value)
        assert session.call("set_status", {"order_id": "o1", "status": "x" * 2000}).error_kind == "too_large"


def test_a_non_json_attribute_of_a_big_state_is_still_named(sandbox):
    source = SIZED_ENV.replace('        order["status"] = status\n', '        order["status"] = status\n'
                               '        self.seen = {status}\n')  # fmt: skip
    with Session(sandbox, source, sized_state(2_000_000)) as session:
        assert session.call("set_status", {"order_id": "o1", "status": "x"}).ok
        with pytest.raises(SessionError) as raised:
            session.snapshot()
    assert raised.value.kind == "state_not_json" and "state attribute 'seen'" in str(raised.value)


def test_diff_states_sees_type_changes_python_calls_equal():
    before = {"a": 1, "b": [1, {"c": 1}], "d": {"e": None}, "f": "x"}
    after = {"a": True, "b": [1, {"c": 1.0}], "d": {}, "g": 2, "f": "x"}
    assert diff_states(before, after) == [
        {"path": "a", "before": 1, "after": True},
        {"path": "b[1].c", "before": 1, "after": 1.0},
        {"path": "d.e", "before": None},
        {"path": "g", "after": 2},
    ]
    assert diff_states([1, 2], [1, 2, 3]) == [{"path": "", "before": [1, 2], "after": [1, 2, 3]}]
    assert diff_states({"x": {"y": 1}}, {"x": {"y": 2}}, "state") == [{"path": "state.x.y", "before": 1, "after": 2}]
    assert diff_states([{"k": 1}], [{"k": 2}]) == [{"path": "[0].k", "before": 1, "after": 2}]


def test_a_large_decode_pauses_the_collector_and_restores_it():
    body = frames.encode({"json": "x" * (2 << 20)})[frames.HEADER.size :]
    assert gc.isenabled()
    seen = []
    with frames.quiet_collector(len(body)):
        seen.append(gc.isenabled())
    assert seen == [False] and gc.isenabled()
    assert frames.decode(body)["json"] == "x" * (2 << 20) and gc.isenabled()
    with pytest.raises(frames.FrameError):
        frames.decode(b"\xc1" * (2 << 20))  # garbage: the collector is back on after the error too
    assert gc.isenabled()
    gc.disable()
    try:
        with frames.quiet_collector(len(body)):
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()
