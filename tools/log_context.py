"""The ids a log line is about, carried by the task that writes it.

A call's session sets `call_id` in the task that runs the call (every task it spawns inherits
it); a worker sets `operation_id` (and the operation's `call_id`) in the task that runs a job.
`LOG_FORMAT=json` writes them into each line, so a line about a call or an operation can be
found by its id without parsing messages.
"""

from __future__ import annotations

from contextvars import ContextVar

call_id: ContextVar[str | None] = ContextVar("call_id", default=None)
operation_id: ContextVar[str | None] = ContextVar("operation_id", default=None)
