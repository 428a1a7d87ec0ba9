"""Length-prefixed msgpack frames between the parent and sandbox processes, with a size cap on every read.

Stdlib + msgpack only (imported by the zygote). Nothing here ever unpickles: msgpack decodes to plain
dicts, lists, strings, numbers and bytes, and `strict_map_key` rejects non-string keys.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import msgpack

HEADER = struct.Struct(">I")


class FrameError(Exception):
    """The peer closed the pipe, sent garbage, or announced a frame larger than the cap."""


def encode(message: dict[str, Any]) -> bytes:
    """One frame: a 4-byte big-endian length, then the msgpack body."""
    body = msgpack.packb(message, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def decode(body: bytes) -> dict[str, Any]:
    """Decode a frame body into a dict; raises FrameError for anything else."""
    try:
        message = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True)
    except Exception as error:  # msgpack raises several unrelated types on bad input
        raise FrameError(f"undecodable frame: {type(error).__name__}") from None
    if not isinstance(message, dict):
        raise FrameError("frame is not a map")
    return message


def write_all(fd: int, data: bytes) -> None:
    """Write every byte (pipes may accept partial writes for large frames)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def read_exact(fd: int, size: int) -> bytes:
    """Read exactly `size` bytes, blocking; raises FrameError on EOF."""
    chunks = []
    while size:
        chunk = os.read(fd, min(size, 1 << 20))
        if not chunk:
            raise FrameError("pipe closed")
        chunks.append(chunk)
        size -= len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, max_bytes: int) -> dict[str, Any]:
    """Blocking read of one frame of at most `max_bytes` body bytes."""
    (size,) = HEADER.unpack(read_exact(fd, HEADER.size))
    if size > max_bytes:
        raise FrameError(f"frame of {size} bytes exceeds the {max_bytes}-byte cap")
    return decode(read_exact(fd, size))
