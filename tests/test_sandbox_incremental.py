"""Incremental snapshots: after every call the snapshot built from the worker's patches equals a whole snapshot
of the same worker, and its diff equals the diff of independent copies, whatever the tools do to the state
(records changed by key or index, scans, appends, removals, reassigned, new and deleted attributes, and records
also kept elsewhere, which must turn incremental snapshots off rather than go stale)."""

from __future__ import annotations

import json

import pytest

from builder.config import SandboxConfig
from builder.envs.session import Session, diff_states
from builder.sandbox.bench import SIZED_ENV, sized_state
from builder.sandbox.runtime import Sandbox

ENV = '''
class Store:
    """Records in a dict and a list, and a few small attributes."""

    archive = {}

    def __init__(self):
        self.orders = {}
        self.events = []
        self.count = 0

    def set_field(self, order_id: str, field: str, value: str) -> dict:
        """Set a field.

        Args:
            order_id: Order.
            field: Field.
            value: Value.

        Returns:
            The order.
        """
        order = self.orders.get(order_id)
        if order is None:
            return {"success": False}
        order[field] = value
        return order

    def nested(self, order_id: str, value: int) -> bool:
        """Change a nested item.

        Args:
            order_id: Order.
            value: Quantity.

        Returns:
            True.
        """
        self.orders[order_id]["items"][0]["quantity"] = value
        return True

    def add(self, order_id: str) -> bool:
        """Add or replace an order, and log it.

        Args:
            order_id: Order.

        Returns:
            True.
        """
        self.orders[order_id] = {"id": order_id, "status": "new", "items": []}
        self.events.append({"kind": "add", "order": order_id})
        self.count += 1
        return True

    def remove(self, order_id: str) -> bool:
        """Remove an order.

        Args:
            order_id: Order.

        Returns:
            True.
        """
        self.orders.pop(order_id, None)
        return True

    def scan(self, status: str) -> int:
        """Set every pending order's status.

        Args:
            status: New status.

        Returns:
            How many changed.
        """
        changed = 0
        for order in self.orders.values():
            if order.get("status") == "pending":
                order["status"] = status
                changed += 1
        return changed

    def touch_events(self, index: int, note: str) -> bool:
        """Annotate an event, then move the first to the end.

        Args:
            index: Event.
            note: Note.

        Returns:
            True.
        """
        self.events[index]["note"] = note
        if note == "rotate":
            self.events.append(self.events.pop(0))
        return True

    def alias(self, order_id: str) -> bool:
        """Keep an order in a second place too.

        Args:
            order_id: Order.

        Returns:
            True.
        """
        self.orders["copy-" + order_id] = self.orders[order_id]
        return True

    def stash(self, order_id: str) -> bool:
        """Keep an order outside the state.

        Args:
            order_id: Order.

        Returns:
            True.
        """
        Store.archive[order_id] = self.orders[order_id]
        return True

    def from_stash(self, order_id: str, status: str) -> bool:
        """Change an order through the outside copy.

        Args:
            order_id: Order.
            status: Status.

        Returns:
            True.
        """
        Store.archive[order_id]["status"] = status
        return True

    def reshape(self, name: str) -> bool:
        """Replace, add or delete attributes.

        Args:
            name: What to do.

        Returns:
            True.
        """
        if name == "replace":
            self.orders = {key: dict(value) for key, value in self.orders.items()}
        elif name == "add":
            self.extra = [1, 2]
        elif name == "delete":
            del self.extra
        return True
'''


def _state() -> dict:
    orders = {f"o{i}": {"id": f"o{i}", "status": "pending", "items": [{"sku": "a", "quantity": 1}]} for i in range(40)}
    return {"orders": orders, "events": [{"kind": "seed", "order": f"o{i}"} for i in range(30)], "count": 0}


CALLS = [
    ("set_field", {"order_id": "o1", "field": "status", "value": "paid"}),
    ("set_field", {"order_id": "o1", "field": "note", "value": "x"}),
    ("nested", {"order_id": "o2", "value": 5}),
    ("add", {"order_id": "o99"}),
    ("add", {"order_id": "o3"}),
    ("remove", {"order_id": "o4"}),
    ("remove", {"order_id": "missing"}),
    ("touch_events", {"index": 3, "note": "seen"}),
    ("touch_events", {"index": -1, "note": "last"}),
    ("scan", {"status": "shipped"}),
    ("set_field", {"order_id": "o5", "field": "status", "value": "refunded"}),
    ("touch_events", {"index": 0, "note": "rotate"}),
    ("reshape", {"name": "add"}),
    ("set_field", {"order_id": "o6", "field": "status", "value": "lost"}),
    ("reshape", {"name": "delete"}),
    ("reshape", {"name": "replace"}),
    ("set_field", {"order_id": "o7", "field": "status", "value": "after-replace"}),
]


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox(SandboxConfig()) as runtime:
        yield runtime


def _whole(session: Session) -> dict:
    """A whole snapshot straight from the worker (no `since`), decoded independently. The worker's baseline is
    then that state again, which the session's last snapshot must equal: the next one is patched from it."""
    reply = session._worker.request({"op": "snapshot"})
    assert reply["ok"] and "json" in reply
    session._generation = reply["generation"]
    return json.loads(reply["json"])


def _replay(sandbox, calls, check_whole=True):
    with Session(sandbox, ENV, _state()) as session:
        before = session.snapshot()
        copy_before = json.loads(json.dumps(before))
        patched = 0
        for name, arguments in calls:
            assert session.call(name, arguments).ok, name
            after = session.snapshot()
            patched += session.lineage is not None and session.lineage.new is after
            copy_after = json.loads(json.dumps(after))
            assert diff_states(before, after) == diff_states(copy_before, copy_after), name
            if check_whole:
                assert after == _whole(session), name
            before, copy_before = after, copy_after
        return before, patched


def test_every_incremental_snapshot_equals_a_whole_one(sandbox):
    _final, patched = _replay(sandbox, CALLS)
    assert patched >= len(CALLS) - 2  # only the snapshot after the scan of every order is whole


def test_a_replay_with_incremental_snapshots_ends_in_the_same_state_as_without(sandbox):
    final, _patched = _replay(sandbox, CALLS, check_whole=False)
    with Session(sandbox, ENV, _state()) as session:
        for name, arguments in CALLS:
            session.call(name, arguments)
        assert session.snapshot() == final


def test_a_record_kept_in_two_places_is_seen_changed_in_both(sandbox):
    calls = [("alias", {"order_id": "o1"}), ("set_field", {"order_id": "o1", "field": "status", "value": "a"}),
             ("set_field", {"order_id": "copy-o1", "field": "status", "value": "b"})]  # fmt: skip
    final, _patched = _replay(sandbox, calls)
    assert final["orders"]["o1"]["status"] == final["orders"]["copy-o1"]["status"] == "b"


def test_a_record_kept_outside_the_state_is_seen_changed(sandbox):
    calls = [("stash", {"order_id": "o8"}), ("set_field", {"order_id": "o9", "field": "status", "value": "x"}),
             ("from_stash", {"order_id": "o8", "status": "changed-outside"})]  # fmt: skip
    final, _patched = _replay(sandbox, calls)
    assert final["orders"]["o8"]["status"] == "changed-outside"


def test_snapshots_share_unchanged_records_and_leave_earlier_ones_as_they_were(sandbox):
    with Session(sandbox, SIZED_ENV, sized_state(100_000)) as session:
        first = session.snapshot()
        session.call("set_status", {"order_id": "o3", "status": "shipped"})
        second = session.snapshot()
    assert first["orders"]["o3"]["status"] == "pending" and second["orders"]["o3"]["status"] == "shipped"
    assert second["orders"]["o4"] is first["orders"]["o4"]
    assert diff_states(first, second) == [{"path": "orders.o3.status", "before": "pending", "after": "shipped"}]


def test_a_crash_after_incremental_snapshots_restores_the_same_state(sandbox):
    source = (
        SIZED_ENV
        + '''
    def crash(self) -> bool:
        """Crash.

        Returns:
            Never.
        """
        import os
        os._exit(3)
'''
    )
    with Session(sandbox, source, sized_state(20_000), contract="import") as session:
        session.snapshot()
        session.call("set_status", {"order_id": "o1", "status": "a"})
        kept = session.snapshot()
        assert session.call("crash", {}).error_kind == "crashed"
        session.call("set_status", {"order_id": "o2", "status": "b"})
        final = session.snapshot()
    assert final["orders"]["o1"]["status"] == "a" and final["orders"]["o2"]["status"] == "b"
    assert kept["orders"]["o2"]["status"] == "pending"


def test_a_json_state_is_the_first_snapshot_when_the_instance_holds_exactly_it(sandbox):
    state = sized_state(50_000)
    with Session(sandbox, SIZED_ENV, state, json_state=True) as session:
        first = session.snapshot()
        assert first == state and first["orders"] is state["orders"]  # taken as given, not read back
        assert first == _whole(session)
        session.call("set_status", {"order_id": "o2", "status": "x"})
        assert session.snapshot()["orders"]["o2"]["status"] == "x" and state["orders"]["o2"]["status"] == "pending"


def test_a_json_state_is_read_back_when_init_adds_attributes_or_after_a_restart(sandbox):
    source = SIZED_ENV.replace("        self.orders = {}\n", "        self.orders = {}\n        self.opened = 1\n")
    state = sized_state(20_000)
    with Session(sandbox, source, state, json_state=True) as session:
        first = session.snapshot()
    assert first["opened"] == 1 and first["orders"] == state["orders"]
    hung = (
        SIZED_ENV
        + '''
    def hang(self) -> bool:
        """Hang.

        Returns:
            Never.
        """
        while True:
            pass
'''
    )
    config = SandboxConfig(call_timeout_s=0.5, kill_grace_s=0.5)
    with Sandbox(config) as small, Session(small, hung, sized_state(20_000), json_state=True) as session:
        session.call("set_status", {"order_id": "o1", "status": "a"})
        assert session.call("hang", {}).error_kind == "timeout"
        session._worker.kill()  # the next request starts a worker that replays the calls: not the given state
        assert session.snapshot()["orders"]["o1"]["status"] == "a"


def test_a_heap_changed_by_heapq_is_seen(sandbox):
    source = '''
import heapq
from heapq import heappop


class Queue:
    """A priority queue."""

    def __init__(self):
        self.heap = []

    def push(self, priority: int) -> bool:
        """Push.

        Args:
            priority: Priority.

        Returns:
            True.
        """
        heapq.heappush(self.heap, [priority, "task"])
        return True

    def pop(self) -> list:
        """Pop the first.

        Returns:
            It.
        """
        return heappop(self.heap)
'''
    with Session(sandbox, source, {"heap": [[n, "task"] for n in range(10, 40)]}) as session:
        session.snapshot()
        for name, arguments in [("push", {"priority": 1}), ("pop", {}), ("pop", {}), ("push", {"priority": 5})]:
            assert session.call(name, arguments).ok
            assert session.snapshot() == _whole(session)
