"""The agent talking on a call (agents declared in configuration), as the bridge holds it.

None when no agents are declared: the session runs the bridge's own instructions and every
tool. A handoff (`SessionChange` on a `ToolReply`) replaces it; every (re)connect configures
the session with the active agent's instructions and tools, so a reconnect after a handoff
keeps them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from telephony.tool_gateway import SessionChange

HANDOFF_NOTE = (
    "You now take over this phone call as the {agent} agent{origin}. Reason: {reason}\n"
    "The conversation so far (most recent last):\n{transcript}\n{operations}\n"
    "Carry on naturally; do not greet the caller again."
)


class ActiveAgent:
    """Which agent's instructions and tools the call's session runs with."""

    def __init__(
        self, start: SessionChange | None, all_tools: Callable[[], list[dict[str, Any]]]
    ) -> None:
        self.session = start
        self._all_tools = all_tools

    @property
    def name(self) -> str | None:
        return self.session.agent if self.session is not None else None

    def tools(self) -> list[dict[str, Any]]:
        return list(self.session.tools) if self.session is not None else self._all_tools()

    def voice(self) -> str | None:
        """The active agent's voice (None: the deployment's); a new session speaks with it."""
        return self.session.voice if self.session is not None else None

    def persona(self) -> str | None:
        """The active agent's instructions (None: the bridge's own)."""
        return self.session.instructions if self.session is not None else None

    def take(self, change: SessionChange) -> str | None:
        """Another agent takes the call; returns the one it took it from."""
        before = self.name
        self.session = change
        return before


def handoff_note(change: SessionChange, history: Iterable[str]) -> str:
    """What the new agent is told: the conversation so far and the operations still open."""
    lines = list(history)
    origin = f" (from the {change.from_agent} agent)" if change.from_agent else ""
    return HANDOFF_NOTE.format(
        agent=change.agent,
        origin=origin,
        reason=change.reason or "not given",
        transcript="\n".join(lines) if lines else "(nothing yet)",
        operations=change.note,
    )
