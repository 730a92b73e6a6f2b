"""Call events: what the bridge reports for the timeline, without knowing where it goes."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any, Protocol


class CallEventKind(StrEnum):
    """Every kind of call event the timeline can draw."""

    CALL_STARTED = "call_started"
    CALL_REJECTED = "call_rejected"
    STREAM_STARTED = "stream_started"
    STREAM_STOPPED = "stream_stopped"
    STREAM_LOST = "stream_lost"  # the media socket dropped without `stop`: released to resume
    # The replica stopped (its drain limit, a second signal) and let the call go for a resume
    # on another replica, in place of ending it: `stream_lost` done on purpose.
    RELEASED_FOR_DRAIN = "released_for_drain"
    STREAM_RESUMED = "stream_resumed"  # a new stream took the call over (another replica, maybe)
    CALL_ENDED = "call_ended"
    REALTIME_CONNECTED = "realtime_connected"
    REALTIME_DROPPED = "realtime_dropped"
    REALTIME_RECONNECTED = "realtime_reconnected"
    REALTIME_FAILED = "realtime_failed"
    REALTIME_ERROR = "realtime_error"
    SPEECH_STARTED = "speech_started"
    SPEECH_STOPPED = "speech_stopped"
    BARGE_IN = "barge_in"
    RESPONSE_CREATED = "response_created"
    RESPONSE_DONE = "response_done"
    CALLER_TRANSCRIPT = "caller_transcript"
    AGENT_TRANSCRIPT = "agent_transcript"
    FUNCTION_CALL = "function_call"
    FUNCTION_OUTPUT = "function_output"
    RESULT_ANNOUNCED = "result_announced"
    RESULT_HELD = "result_held"
    RESULT_HEARD = "result_heard"
    RESULT_CUT = "result_cut"
    RESULT_NOT_SPOKEN = "result_not_spoken"
    DTMF = "dtmf"
    CALL_TRANSFERRED = "call_transferred"  # refer sent (OpenAI's SIP interconnect)
    # transfer_call: asked of the leg, under way (the caller left the agent), failed (the caller
    # stays), answered by the person, or ended without them (busy, no answer: the caller is back)
    DTMF_SENT = "dtmf_sent"  # keys the agent pressed on the line (send_dtmf)
    TRANSFER_REQUESTED = "transfer_requested"
    TRANSFER_STARTED = "transfer_started"
    TRANSFER_FAILED = "transfer_failed"
    TRANSFER_ANSWERED = "transfer_answered"
    # A warm transfer: the person is being called and briefed; the caller stays with the agent.
    TRANSFER_BRIEFING = "transfer_briefing"
    CALL_HANGUP = "call_hangup"  # hangup sent through the call-control API
    # An outbound call (POST /api/calls): asked for, picked up, who picked up (Twilio's
    # answering-machine detection), the message left on a machine, or never answered.
    OUTBOUND_REQUESTED = "outbound_requested"
    OUTBOUND_ANSWERED = "outbound_answered"
    AMD_RESULT = "amd_result"
    VOICEMAIL_LEFT = "voicemail_left"
    OUTBOUND_UNANSWERED = "outbound_unanswered"
    MALFORMED_FRAME = "malformed_frame"
    APOLOGY_PLAYED = "apology_played"
    ERROR = "error"
    # A media stream over one of its budgets (telephony.legs.twilio.budget), ended as abusive.
    STREAM_ABUSIVE = "stream_abusive"
    # RTP from a source the signalling did not name (strict RTP), once a call.
    FOREIGN_MEDIA_DROPPED = "foreign_media_dropped"
    # Caller verification locked for the account or number (tools.verification).
    VERIFICATION_LOCKED = "verification_locked"
    # A keypad PIN entry: how many digits, never which.
    PIN_ENTERED = "pin_entered"
    # Another agent took the call (from, to, reason); the session went on with its tools.
    AGENT_HANDOFF = "agent_handoff"


@dataclass(frozen=True, slots=True)
class CallEvent:
    """One event of one call, stamped with a monotonic and a wall-clock time."""

    call_id: str
    kind: CallEventKind
    data: dict[str, Any] = field(default_factory=dict)
    mono_ns: int = field(default_factory=time.monotonic_ns)
    at: datetime = field(default_factory=lambda: datetime.now(UTC))


class CallEventSink(Protocol):
    """Where call events go. `emit` must never block the audio path."""

    def emit(self, event: CallEvent) -> None: ...


class MemorySink:
    """Keeps events in a list: for the simulator-only runs, benchmarks and tests."""

    def __init__(self) -> None:
        self.events: list[CallEvent] = []

    def emit(self, event: CallEvent) -> None:
        self.events.append(event)

    def kinds(self) -> list[CallEventKind]:
        return [e.kind for e in self.events]
