"""The episode loop's tool runner over a sandbox session, and the thread pool its blocking calls run in."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from builder.envs.session import Session, ToolResult

T = TypeVar("T")

# Sandbox calls block on a worker's pipe, not on the CPU: with asyncio's default pool (cores + 4 threads) the
# episodes would queue for threads while the model server idles, so they get a pool of their own.
_SANDBOX_THREADS = ThreadPoolExecutor(max_workers=128, thread_name_prefix="sandbox")


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` in the sandbox thread pool."""
    return await asyncio.get_running_loop().run_in_executor(_SANDBOX_THREADS, functools.partial(fn, *args, **kwargs))


class SandboxRunner:
    """`builder.rollout.episode.ToolRunner` over a `Session`; its blocking calls run in a thread."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return await in_thread(self.session.call, name, arguments)
