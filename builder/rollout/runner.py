"""The episode loop's tool runner over a sandbox session."""

from __future__ import annotations

import asyncio
import functools
from concurrent.futures import Executor
from typing import Any

from builder.envs.session import Session, ToolResult


class SandboxRunner:
    """`builder.rollout.episode.ToolRunner` over a `Session`. Its blocking calls run in `threads` (the stage's,
    `StageContext.threads`; None: the event loop's default pool)."""

    def __init__(self, session: Session, threads: Executor | None = None) -> None:
        self.session = session
        self.threads = threads

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolResult:
        call = functools.partial(self.session.call, name, arguments)
        return await asyncio.get_running_loop().run_in_executor(self.threads, call)
