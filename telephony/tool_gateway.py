"""The seam between a call and the tool layer. `telephony` defines it; `app` fills it."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class CallContext:
    """Who is on the call, as the tool layer needs to know it."""

    call_id: str
    call_sid: str
    tenant_id: str
    from_number: str | None
    to_number: str | None
    # The leg can brief a person before joining the caller to them (a warm transfer: Twilio's
    # conference, our SIP leg's REFER with Replaces); elsewhere `transfer_call` with mode warm
    # is refused with nothing sent.
    warm_transfer: bool = False


@dataclass(frozen=True, slots=True)
class ConfirmationEvidence:
    """What the call itself observed of the caller's answer to an operation's readback.

    The model saying "the caller said yes" is not evidence: `counts` only when the readback
    was heard to its end (playback position, not audio sent) and the caller spoke (or pressed
    a key) after it ended. `reason` says what was found, or what is missing.
    """

    counts: bool
    reason: str
    readback_item_id: str | None = None
    readback_heard_ms: int = 0
    readback_audio_ms: int = 0
    caller_item_id: str | None = None  # the caller's input item (transcribed or committed)
    digit: str | None = None  # or the keypad digit pressed after the readback

    def record(self) -> dict[str, Any]:
        """The evidence as the ledger keeps it (never a transcript's words)."""
        out: dict[str, Any] = {
            "confirmed_by": "caller" if self.counts else None,
            "reason": self.reason,
            "readback_item_id": self.readback_item_id,
            "readback_heard_ms": self.readback_heard_ms,
            "readback_audio_ms": self.readback_audio_ms,
        }
        if self.caller_item_id is not None:
            out["caller_item_id"] = self.caller_item_id
        if self.digit is not None:
            out["digit"] = self.digit
        return out


class CallerEvidence(Protocol):
    """The port the tool layer asks whether a confirmation rests on the caller's own answer.

    The call side (the bridge) implements it from what it observed: playback positions, the
    caller's speech and keypad. The tool layer never learns about audio.
    """

    def confirmation_evidence(self, operation_id: str) -> ConfirmationEvidence: ...


@dataclass(frozen=True, slots=True)
class FunctionCallRequest:
    """A completed function call from the model (never a cancelled response's arguments)."""

    call_id: str  # the provider's call_id of the function call
    name: str
    arguments: str  # raw JSON text as the model produced it
    item_id: str
    response_id: str
    turn_id: int
    # What the call can attest of the caller (None: nothing, so no confirmation counts).
    evidence: CallerEvidence | None = field(default=None, compare=False, repr=False)
    # The agent talking when the model asked (None: no agents declared, one agent).
    agent: str | None = None
    # The model session that asked (the Realtime session's id, else call id/connection).
    session_id: str | None = None

    @property
    def function_call_id(self) -> str:
        """The model's id of this function call (`call_id` on the wire), by the name the
        tool layer uses: there `call_id` is always our call row's id."""
        return self.call_id


@dataclass(frozen=True, slots=True)
class SessionChange:
    """Another agent takes the call: the session continues with its instructions and tools.

    The call side applies it without dropping the call: a `session.update`, then a note to the
    new agent (`note`: the operations still open, to which the call side adds a summary of the
    conversation so far), then the function output and a response.
    """

    agent: str
    instructions: str
    tools: list[dict[str, Any]]
    from_agent: str | None = None
    reason: str = ""
    note: str = ""
    # The agent's own voice (None: the deployment's). The Realtime API fixes a session's voice
    # once it has spoken, so a handoff keeps the voice until the next session (a reconnect).
    voice: str | None = None


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """The engine admitted a transfer: the call side carries it out on its leg (Twilio
    `<Dial>`, SIP REFER, the interconnect's `refer`), once the agent has said its sentence."""

    target: str  # the target's name (TRANSFER_TARGETS)
    destination: str  # E.164 number or sip: URI
    mode: str  # "cold" | "warm"
    reason: str
    function_call_id: str  # the model's function call (its ledger row gets the outcome)
    # A warm transfer: what the person hears before they are joined (who calls, what they
    # want, the operations still open and what was promised), composed by the engine.
    briefing: str = ""


@dataclass(frozen=True, slots=True)
class TransferOutcome:
    """What the leg made of a transfer: `accepted` when it is under way (the caller leaves the
    agent), else why not, in words the agent can say."""

    accepted: bool
    status: str  # "dialing", "referred", "refused", "unsupported", "failed", ...
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ToolReply:
    """What goes back to the model as `function_call_output`."""

    output: dict[str, Any]
    # Whether a response should follow now (when the turn is still current and nothing is
    # active). A mutation's final outcome arrives later through `LiveCall.deliver_result`.
    wants_response: bool = True
    operation_id: str | None = None
    # The operation waits for the caller's yes: what the model says next is its readback.
    awaiting_confirmation: bool = False
    # A handoff: the agent, instructions and tools the session continues with.
    session_change: SessionChange | None = None
    # A transfer to a person, for the call side to carry out after the agent's sentence.
    transfer: TransferRequest | None = None
    # Keys to press on the line (send_dtmf): the call side sends them, then answers.
    dtmf: str | None = None


@dataclass(frozen=True, slots=True)
class LateResult:
    """An outcome that arrived after the function call was answered."""

    operation_id: str
    text: str  # compact, speakable statement of the outcome
    data: dict[str, Any] = field(default_factory=dict)
    # The durable delivery this announcement carries; its reports name it.
    delivery_id: str | None = None


class AnnouncementStatus(StrEnum):
    """What became of a late result handed to a live call."""

    HELD = "held"  # queued: no safe moment yet (the caller is speaking, a response is active)
    SPOKEN = "spoken"  # a response carrying it was created (`response_id`)
    HEARD = "heard"  # the audio of that response was played out in full (confirmed by marks)
    CUT = "cut"  # its audio was cut (barge-in, hang-up) or never confirmed played
    NOT_SPOKEN = "not_spoken"  # the call ended, or the response failed, before any audio


@dataclass(frozen=True, slots=True)
class AnnouncementReport:
    """One step of a late result's way to the caller's ear."""

    operation_id: str
    delivery_id: str | None
    status: AnnouncementStatus
    response_id: str | None = None
    heard_ms: int = 0
    audio_ms: int = 0
    reason: str = ""
    # The assistant items that spoke it (the acknowledgement the caller heard, or not).
    item_ids: tuple[str, ...] = ()


class AnnouncementSink(Protocol):
    """Where a live call reports its announcements; `report` must not block."""

    def report(self, report: AnnouncementReport) -> None: ...


@dataclass(frozen=True, slots=True)
class KeypadEntry:
    """What one keypad digit was, as far as the timeline may know.

    A digit that is part of a PIN entry is never recorded, logged or shown: only that a PIN
    was entered and how many digits it had.
    """

    pin: bool  # part of a PIN entry
    submitted_digits: int | None = None  # a PIN entry completed, with this many digits
    outcome: str | None = None  # what it achieved (verified, wrong, locked)


class ToolGateway(Protocol):
    """What the bridge asks of the tool layer."""

    def definitions(self) -> list[dict[str, Any]]:
        """Realtime `function` tool definitions for session.update."""
        ...

    async def handle(self, ctx: CallContext, request: FunctionCallRequest) -> ToolReply:
        """Run a function call through policy; answer reads inline, mutations at once."""
        ...

    async def on_dtmf(self, ctx: CallContext, digit: str) -> KeypadEntry | None:
        """A keypad digit from the caller; None: an ordinary digit, recorded as it is."""
        ...

    def redacts_arguments(self, name: str) -> bool:
        """Whether the tool `name`'s arguments must never be stored (a spoken PIN)."""
        ...

    async def on_call_end(self, ctx: CallContext) -> None:
        """The call is over; pending results must now go another way."""
        ...


class LiveCall(Protocol):
    """What the rest of the process may ask of a live call."""

    async def deliver_result(self, result: LateResult) -> bool:
        """Speak a late result at the next safe moment; False if the call cannot take it.

        What becomes of it (held, spoken, heard, cut) is reported to the call's
        `AnnouncementSink`, when it has one.
        """
        ...

    async def end(self, reason: str) -> None:
        """End the call from outside (status callback, shutdown)."""
        ...
