"""Length-prefixed msgpack frames between the parent and sandbox processes, with a size cap on every read.

Stdlib + msgpack only (imported by the zygote). Nothing here ever unpickles: msgpack decodes to plain
dicts, lists, strings, numbers and bytes, and `strict_map_key` rejects non-string keys.
"""

from __future__ import annotations

import contextlib
import gc
import os
import struct
import threading
from collections.abc import Iterator
from typing import Any

import msgpack

HEADER = struct.Struct(">I")
LARGE = 1 << 20  # bytes from which decoding pauses the cyclic collector
# One reusable Packer per thread: `packb` builds a new one (and its buffer) for every message, which costs about
# as much as the packing. A Packer is not thread-safe, hence one per thread.
_local = threading.local()


class FrameError(Exception):
    """The peer closed the pipe, sent garbage, or announced a frame larger than the cap."""


def encode(message: dict[str, Any]) -> bytes:
    """One frame: a 4-byte big-endian length, then the msgpack body."""
    try:
        packer = _local.packer
    except AttributeError:
        packer = _local.packer = msgpack.Packer(use_bin_type=True)
    body = packer.pack(message)  # autoreset: returns the bytes and empties the buffer, also after an error
    return HEADER.pack(len(body)) + body


def decode(body: bytes | memoryview) -> dict[str, Any]:
    """Decode a frame body into a dict; raises FrameError for anything else."""
    try:
        with quiet_collector(len(body)):
            message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types on bad input
        raise FrameError(f"undecodable frame: {type(error).__name__}") from None
    if not isinstance(message, dict):
        raise FrameError("frame is not a map")
    return message


@contextlib.contextmanager
def quiet_collector(size: int) -> Iterator[None]:
    """No cyclic garbage collection while decoding `size` bytes if they are many: decoding a state of tens of MB
    allocates millions of containers, and the collections they trigger doubled its cost (measured 2.3 -> 1.2 s
    for 50 MB of JSON). Small messages, every tool call, skip the bookkeeping."""
    if size < LARGE or not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def write_all(fd: int, data: bytes) -> None:
    """Write every byte (pipes may accept partial writes for large frames)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


class FrameReader:
    """Blocking reader of capped frames from one descriptor (the worker's request pipe).

    It reads up to a pipe buffer at a time and keeps what follows a frame, so a small frame costs one
    `os.read` instead of one for the header and one for the body.
    """

    def __init__(self, fd: int, max_bytes: int) -> None:
        self.fd, self.max_bytes = fd, max_bytes
        self.buffer = b""
        self.last_size = 0  # body bytes of the last frame read

    def read(self) -> dict[str, Any]:
        """The next frame's message; raises FrameError on EOF, garbage or a frame above the cap."""
        while len(self.buffer) < HEADER.size:
            self.buffer += self._read()
        (size,) = HEADER.unpack_from(self.buffer)
        if size > self.max_bytes:
            raise FrameError(f"frame of {size} bytes exceeds the {self.max_bytes}-byte cap")
        end = HEADER.size + size
        self.last_size = size
        if len(self.buffer) < end:  # a big frame: collect its chunks and join once
            chunks, received = [self.buffer], len(self.buffer)
            while received < end:
                chunks.append(self._read())
                received += len(chunks[-1])
            self.buffer = b"".join(chunks)
        body, self.buffer = self.buffer[HEADER.size : end], self.buffer[end:]
        return decode(body)

    def _read(self) -> bytes:
        # At most one pipe buffer: a larger size makes os.read allocate that much on every call.
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            raise FrameError("pipe closed")
        return chunk
