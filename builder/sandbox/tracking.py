"""Which records of a big state a tool may have changed, so a snapshot ships only those (worker side, stdlib only).

A state of tens of MB is mostly a few attributes holding many records (`self.orders = {id: {...}}`). At load the
worker gives every such attribute (a dict or list of at least `WRAP_MIN` entries) to the environment as a
`TrackedDict` / `TrackedList`: a real dict or list whose accessors note each key (index) whose value they hand
out or replace. A record no accessor handed out since the last snapshot cannot have changed, with one way round
it: a reference to a record (or to anything inside it) kept somewhere else, a second path in the state, a
class attribute, a global. So at every snapshot each handed-out record is checked to be referenced only by its
container (`sys.getrefcount`); if one is not, incremental snapshots stop for the session and every snapshot is
whole again, as before. Everything else is what it was: the containers are subclasses, the records plain.
"""

from __future__ import annotations

import gc
import sys
from typing import Any

WRAP_MIN = 16  # smaller containers are cheaper to re-encode than to track
ALL = None  # `touched` value meaning: every entry may have changed (iteration, copy, clear, sort, ...)
_SCALARS = (str, int, float, bool, type(None))


class TrackedDict(dict):
    """A dict that records the keys whose values it hands out or changes (`touched`, or ALL)."""

    __slots__ = ("touched",)

    def __new__(cls, *args: Any, **kwargs: Any) -> TrackedDict:
        # copy and deepcopy build an instance with __new__ alone: the slot must exist before any __setitem__.
        self = dict.__new__(cls)
        self.touched = set()
        return self

    def _mark(self, key: Any) -> None:
        if self.touched is not ALL:
            self.touched.add(key)

    def _mark_all(self) -> None:
        self.touched = ALL

    def __getitem__(self, key: Any) -> Any:
        value = dict.__getitem__(self, key)
        if type(value) not in _SCALARS:
            self._mark(key)
        return value

    def get(self, key: Any, default: Any = None) -> Any:
        value = dict.get(self, key, default)
        if type(value) not in _SCALARS:
            self._mark(key)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._mark(key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key: Any) -> None:
        self._mark(key)
        dict.__delitem__(self, key)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self._mark(key)
        return dict.setdefault(self, key, default)

    def pop(self, key: Any, *default: Any) -> Any:
        self._mark(key)
        return dict.pop(self, key, *default)

    def popitem(self) -> tuple[Any, Any]:
        key, value = dict.popitem(self)
        self._mark(key)
        return key, value

    # Everything that hands out or replaces values in bulk marks the whole container.
    def values(self) -> Any:
        self._mark_all()
        return dict.values(self)

    def items(self) -> Any:
        self._mark_all()
        return dict.items(self)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._mark_all()
        dict.update(self, *args, **kwargs)

    def clear(self) -> None:
        self._mark_all()
        dict.clear(self)

    def copy(self) -> dict[Any, Any]:
        self._mark_all()
        return dict.copy(self)

    def __or__(self, other: Any) -> Any:
        self._mark_all()
        return dict.__or__(self, other)

    def __ror__(self, other: Any) -> Any:
        self._mark_all()
        return dict.__ror__(self, other)

    def __ior__(self, other: Any) -> Any:
        self._mark_all()
        return dict.__ior__(self, other)

    def __iter__(self) -> Any:
        # Keys only, so nothing to mark; defined so that dict(d), {**d} and f(**d) leave C's fast copy (which
        # reads the values behind the accessors) and go through keys() and __getitem__.
        return dict.__iter__(self)


class TrackedList(list):
    """A list that records the indexes whose values it hands out or sets; anything that moves items marks ALL."""

    __slots__ = ("touched",)

    def __new__(cls, *args: Any, **kwargs: Any) -> TrackedList:
        self = list.__new__(cls)
        self.touched = set()
        return self

    def _mark(self, index: Any) -> None:
        if self.touched is ALL:
            return
        if type(index) is not int:  # a slice: its items are handed out or replaced
            self.touched = ALL
            return
        self.touched.add(index + len(self) if index < 0 else index)

    def _mark_all(self) -> None:
        self.touched = ALL

    def __getitem__(self, index: Any) -> Any:
        value = list.__getitem__(self, index)
        if type(value) not in _SCALARS:
            self._mark(index)
        return value

    def __setitem__(self, index: Any, value: Any) -> None:
        self._mark(index)
        list.__setitem__(self, index, value)

    def append(self, value: Any) -> None:
        self._mark(len(self))
        list.append(self, value)

    def __iter__(self) -> Any:
        self._mark_all()
        return list.__iter__(self)

    def __reversed__(self) -> Any:
        self._mark_all()
        return list.__reversed__(self)


def _marks_all(name: str) -> Any:
    method = getattr(list, name)

    def marking(self: TrackedList, *args: Any, **kwargs: Any) -> Any:
        self.touched = ALL
        return method(self, *args, **kwargs)

    marking.__name__ = name
    return marking


# Every other list method that reads, moves or removes items, or builds a list sharing them.
for _name in ("__delitem__", "extend", "insert", "pop", "remove", "clear", "sort", "reverse", "copy", "__add__",
              "__radd__", "__iadd__", "__mul__", "__rmul__", "__imul__"):  # fmt: skip
    if hasattr(list, _name):
        setattr(TrackedList, _name, _marks_all(_name))


def install() -> None:
    """Make heapq mark a tracked list it changes: its C functions move a list's items without its methods.
    Called by the zygote before any environment module binds them (`from heapq import heappush`)."""
    import heapq

    for name in ("heappush", "heappop", "heapify", "heapreplace", "heappushpop"):
        setattr(heapq, name, _marking_heap_function(getattr(heapq, name)))


def _marking_heap_function(function: Any) -> Any:
    def marking(heap: Any, *args: Any) -> Any:
        if type(heap) is TrackedList:
            heap.touched = ALL
        return function(heap, *args)

    marking.__name__ = marking.__qualname__ = function.__name__
    marking.__doc__ = function.__doc__
    return marking


def wrap(value: Any) -> Any:
    """`value` as a tracked container if it is a plain dict or list big enough to be worth it, else itself."""
    if type(value) is dict and len(value) >= WRAP_MIN:
        tracked = TrackedDict()
        dict.update(tracked, value)
        return tracked
    if type(value) is list and len(value) >= WRAP_MIN:
        tracked = TrackedList()
        list.extend(tracked, value)
        return tracked
    return value


def _refcount_of_sole_child() -> int:
    """What `_walk` counts for a container held by nothing but its parent (depends on the interpreter)."""
    parent = {"child": {}}
    level = [dict.get(parent, "child")]
    return max(map(sys.getrefcount, level))


def _walk(level: list[Any], expected: int) -> bool:
    # Level by level, in C: each container is held by its parent, the level list and getrefcount's argument,
    # so any further reference means it is also held somewhere else. (A container reached twice is in the
    # level list twice, which counts as shared too.)
    while level:
        if max(map(sys.getrefcount, level)) > expected:
            return True
        level = [item for item in gc.get_referents(*level) if type(item) not in _SCALARS]
    return False


def shared(container: Any, keys: Any) -> bool:
    """Whether a value at one of `keys` of `container`, or a container inside it, is referenced from elsewhere
    than its place in the state (only then could it change later without being handed out again)."""
    if type(container) is TrackedDict:
        values = (dict.get(container, key) for key in keys)
    else:
        values = (list.__getitem__(container, key) for key in keys if key < len(container))
    # One list and no other holder of the values: `_walk` must see them referenced by their container only.
    return _walk([value for value in values if type(value) not in _SCALARS], expected=_SOLE)


_SOLE = _refcount_of_sole_child()


class Baseline:
    """What the parent's copy of the state is: the attributes as of the last snapshot, by identity, and the
    tracked containers. `patches` answers a snapshot with only what changed since, or None when it cannot."""

    def __init__(self, tracked: dict[str, Any]) -> None:
        self.tracked = tracked  # attribute -> the TrackedDict/TrackedList it held at load
        self.attributes: dict[str, Any] | None = None  # None: the parent has no copy yet
        self.lengths: dict[str, int] = {}
        self.generation = 0
        self.size = 0  # JSON bytes of the last whole snapshot plus those of every patch since: an upper bound
        self.enabled = True

    def verify(self, state: dict[str, Any]) -> None:
        """Stop incremental snapshots if a handed-out record is now also referenced from elsewhere."""
        # The marks are the container's own, whatever path reached it, and are cleared only when a snapshot
        # covered it (`_reset`): records never marked since then were handed out before and checked then.
        if not self.enabled:
            return
        for name, container in self.tracked.items():
            if container.touched == set() or state.get(name) is not container:
                continue  # untouched, or no longer in the state (all marked when it comes back: see _reset)
            keys: Any = container.touched
            if keys is ALL:
                keys = range(len(container)) if type(container) is TrackedList else list(dict.keys(container))
            if shared(container, keys):
                self.enabled = False

    def adopt(self, state: dict[str, Any], size: int) -> int:
        """The parent now holds `state` as it is (a whole snapshot of `size` bytes was sent); the new generation."""
        self.attributes = dict(state)
        self._reset(state)
        self.size = size
        return self.generation

    def patches(self, state: dict[str, Any], encode: Any, limit: int) -> list[list[Any]] | None:
        """[attribute, key or None, JSON text or None (deleted)] for everything that may have changed, or None:
        no copy in the parent, tracking stopped, a value that is not JSON (the whole snapshot names it) or a
        total that may pass `limit`."""
        if not self.enabled or self.attributes is None:
            return None
        patches: list[list[Any]] = [[name, None, None] for name in self.attributes if name not in state]
        try:
            for name, value in state.items():
                if self.attributes.get(name, _MISSING) is value and type(value) in _SCALARS:
                    continue
                if self.tracked.get(name) is value and self.attributes.get(name) is value and value.touched is not ALL:
                    entries = self._entries(name, value, encode)
                    if entries is None:
                        return None
                    patches.extend(entries)
                else:
                    patches.append([name, None, encode(value)])
        except (TypeError, ValueError):
            return None
        added = sum(len(text) for _name, _key, text in patches if text is not None)
        if self.size + added > limit:
            return None
        self.attributes = dict(state)
        self._reset(state)
        self.size += added
        return patches

    def _entries(self, name: str, container: Any, encode: Any) -> list[list[Any]] | None:
        entries: list[list[Any]] = []
        if type(container) is TrackedDict:
            for key in container.touched:
                if type(key) is not str:  # JSON turns other keys into strings: the whole snapshot decides
                    return None
                value = dict.get(container, key, _MISSING)
                entries.append([name, key, None if value is _MISSING else encode(value)])
            return entries
        if len(container) < self.lengths.get(name, 0):
            return None
        for index in sorted(container.touched):
            if index < len(container):
                entries.append([name, index, encode(list.__getitem__(container, index))])
        return entries

    def _reset(self, state: dict[str, Any]) -> None:
        self.generation += 1
        for name, container in self.tracked.items():
            # A container a tool took out of the state may come back changed through any path: then it is sent
            # whole and all its records are checked, as if every one had been handed out.
            container.touched = set() if state.get(name) is container else ALL
            if type(container) is TrackedList:
                self.lengths[name] = len(container)


_MISSING = object()
