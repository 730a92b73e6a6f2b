"""The services one process wires together, held on `app.state.runtime` for the routes."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import CallRegistry
from app.event_writer import EventWriter
from app.settings import Settings
from app.stream_token import StreamTokens
from telephony.session_config import BridgeConfig
from telephony.tool_gateway import ToolGateway

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """Settings plus the live services of this process."""

    settings: Settings
    engine: AsyncEngine
    events: EventWriter
    registry: CallRegistry
    tokens: StreamTokens
    gateway: ToolGateway
    openai: AsyncOpenAI
    bridge_config: BridgeConfig
    twilio: Any  # twilio.rest.Client from app.twilio_rest.make_twilio_client
    console_password: str
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run a side job (a REST hang-up) owned by the process, awaited at shutdown."""
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def drain_tasks(self, wait_s: float) -> None:
        """Let side jobs finish, cancelling whatever is still running after `wait_s`."""
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=wait_s)
        for task in pending:
            task.cancel()
        for task in pending:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
