"""The episode loop's tool runner over a sandbox session."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from builder.envs.session import Session, ToolResult


class SandboxRunner:
    """`builder.rollout.episode.ToolRunner` over a `Session`. Its blocking calls run through `blocking` (a stage's
    `StageContext.blocking`, in the threads of the process running it; by default `asyncio.to_thread`)."""

    def __init__(self, session: Session, blocking: Callable[..., Awaitable[Any]] = asyncio.to_thread) -> None:
        self.session = session
        self.blocking = blocking

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        return await self.blocking(self.session.call, name, arguments)
