"""The seam between the bridge and a speech model: a link that connects, reconnects and reads,
and the session (one connection) that the other parts send through.

`RealtimeLink` (telephony.bridge.realtime_link) implements both for the OpenAI Realtime API, on
its own socket or attached to OpenAI's SIP interconnect call (the sideband). A second model
protocol (GPT-Live) implements the same two Protocols; the parts above never see the SDK.
Every send answers True when it went out; a dead or stuck socket is closed so that the reader
ends and the bridge reconnects, and the send answers False.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from telephony.bridge.slot import ResponseSlot
from telephony.realtime_wire import AudioDelta


class ModelSession(Protocol):
    """One connection to the model; its state is lost when it drops."""

    generation: int  # counts connections: a tool answer knows which one asked
    slot: ResponseSlot
    items: set[str]  # assistant items this connection created (truncate only those)
    # The voice this connection speaks with (None: set by someone else, the interconnect's
    # accept); fixed once it has spoken, so a handoff keeps it until the next connection.
    voice: str | None
    # The model's id of this session (`sess_…`) where the server says it, else call/generation.
    session_id: str
    # True where the server starts its own turns (GPT-Live): a create is not answered by a
    # `response.created`, so a late result is told by the utterance that says it.
    server_turns: bool

    async def append(self, payload: str) -> bool:
        """Caller audio (the leg's base64) appended to the input buffer: the hot path."""
        ...

    def append_now(self, payload: str) -> bool:
        """The same from a socket callback: False when it cannot go out without waiting."""
        ...

    async def truncate(self, item_id: str, audio_end_ms: int) -> bool: ...

    async def cancel_response(self, response_id: str) -> bool:
        """Stop the response `response_id` (named, so a response that began meanwhile is not
        the one stopped)."""
        ...

    async def clear_output(self) -> bool:
        """Stop the server's own playout (server playout only)."""
        ...

    async def add_function_output(self, function_call_id: str, output: str) -> bool: ...

    async def add_note(self, text: str) -> bool:
        """A system message in the conversation (a late result, an earlier tool answer)."""
        ...

    async def create_response(self, event_id: str, instructions: str | None) -> bool: ...

    async def update_session(self, persona: str, tools: list[dict[str, Any]]) -> bool:
        """Another agent's instructions and tools on the same connection (a handoff)."""
        ...


# Handlers the read loop calls: an audio delta, and any other (parsed) server event, which
# answers a reason when the session must be given up.
DeltaHandler = Callable[[Any, AudioDelta], Awaitable[None]]
EventHandler = Callable[[Any, Any], Awaitable[str | None]]
# An audio delta taken in the model socket's own callback:
# (session, response_id, item_id, base64).
DeltaLane = Callable[[Any, str, str, str], None]


class ModelLink(Protocol):
    """Connects (and reconnects) to the model and reads its events."""

    # A reconnected session continues the same conversation (so a function call's output
    # still answers its call), as a re-attached sideband does.
    keeps_conversation: bool
    ended_remotely: bool  # the model's side refused us: the call is over there
    deltas_by_lane: int  # audio deltas taken in the socket's callback (benchmarks)

    async def connect(self, *, resumed: bool) -> tuple[ModelSession | None, int, str | None]:
        """A configured session (or None), the attempts it took, and the last error."""
        ...

    async def read(
        self,
        session: ModelSession,
        on_delta: DeltaHandler,
        on_event: EventHandler,
        handles: frozenset[str] | None = None,
    ) -> str:
        """Handle the session's events until it drops; returns why it dropped. A link may
        drop, unparsed, an event whose type is not in `handles` (None: all go to `on_event`)."""
        ...

    def open_lane(self, session: ModelSession, lane: DeltaLane) -> bool:
        """Take audio deltas in the socket's callback while `read` waits; False if it cannot."""
        ...

    async def close(self, session: ModelSession) -> None: ...
