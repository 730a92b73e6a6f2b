"""The Realtime session a call runs with: bridge configuration and the GA `session.update`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

from openai.types.realtime import RealtimeSessionCreateRequestParam
from openai.types.realtime.realtime_audio_formats_param import (
    AudioPCMA,
    AudioPCMU,
    RealtimeAudioFormatsParam,
)

from telephony.legs.leg import AudioFormat

Eagerness = Literal["low", "medium", "high", "auto"]

# The persona when a deployment's catalog brings none (the catalog's `instructions`).
BASE_INSTRUCTIONS = (
    "You are a friendly, efficient phone assistant. You are speaking with a caller on the "
    "telephone, so keep every answer short and natural, one or two sentences, and never read "
    "out lists, markup or long numbers unless asked."
)

# Rules that hold whatever persona a deployment configures; always appended.
CALL_RULES = (
    "Rules for this phone call:\n"
    "- Before an action that may take a moment (looking something up, booking, changing or "
    "cancelling), first say one short, natural sentence that describes what you are doing, "
    "for example 'Let me check that for you.' or 'One moment, I'm making that booking.' Vary "
    "the wording; never repeat the same sentence twice in a call.\n"
    "- Never mention tools, functions, systems, APIs or internal identifiers to the caller.\n"
    "- Never claim an action is done (booked, cancelled, changed, sent) unless the result you "
    "received says it was done. If the result is pending or unknown, say so plainly and tell "
    "the caller they will be informed.\n"
    "- If the caller interrupts you, stop and listen; do not repeat what you were saying unless "
    "they ask.\n"
    "- If a request is refused, explain the reason you were given in simple words."
)

RESUMED_NOTE = (
    "The connection to this call was interrupted for a moment and has been restored. The "
    "conversation so far (most recent last) was:\n{transcript}\n"
    "Continue naturally from there; do not greet the caller again."
)


@dataclass(frozen=True, slots=True)
class BridgeConfig:
    """Per-deployment settings of the call bridge."""

    model: str = "gpt-realtime"
    voice: str = "marin"
    instructions: str = BASE_INSTRUCTIONS
    vad_eagerness: Eagerness = "auto"
    transcription_model: str = "gpt-4o-mini-transcribe"
    # How long a dropped Realtime session may take to come back before the call is given up.
    reconnect_budget_s: float = 8.0
    # Timeout of one connection attempt (handshake); also bounded by the remaining budget.
    connect_timeout_s: float = 5.0
    # response.create requests waiting for the active response to finish; older ones drop.
    max_queued_response_creates: int = 4
    # Whether the agent speaks first (a response.create right after the session is set up).
    greeting: bool = True
    # What this call's session knows from before it (a resumed call's summary and the
    # operations still open); added to the instructions, reconnects included.
    context_note: str = ""
    # The agent that starts this call's session (None: the first declared one); a resumed
    # call goes on with the agent that was talking when its stream was lost.
    start_agent: str | None = None
    greeting_instructions: str = "Greet the caller briefly and ask how you can help."
    # Whether the caller's audio reaches the model from the start. An outbound call's agent is
    # deaf (and silent: no greeting) until it is known who answered (Bridge.open_line).
    listen_at_start: bool = True
    # Text of the apology played (as a short audible clip) when the session cannot be restored.
    apology_text: str = (
        "Sorry, we are having technical difficulties. Please call again in a few minutes."
    )
    # Timeout of one send to the Realtime socket; a stuck socket is treated as dropped.
    send_timeout_s: float = 5.0
    # Function calls one model response may make, and calls of one call running at once;
    # beyond either, a call is answered with a speakable refusal and reaches no provider.
    max_tool_calls_per_response: int = 8
    max_tool_calls_in_flight: int = 4
    # Which model protocol the call talks: the Realtime API, or GPT-Live (`live_model`, its
    # tools delegated to a Responses backend, `live_delegation_model`, whose function calls
    # come back to our engine).
    model_api: Literal["realtime", "live"] = "realtime"
    live_model: str = "gpt-live-1"
    live_delegation_model: str = "gpt-5-mini"
    # Who runs GPT-Live's delegated work: OpenAI's Responses delegation (its function calls
    # come to us), or `client`: our own backend agent (telephony/bridge/live_backend.py) over
    # the Responses API at `live_backend_base_url` (None: the client's, OpenAI's).
    live_delegation: Literal["responses", "client"] = "responses"
    live_backend_base_url: str | None = None


def instructions_text(
    config: BridgeConfig, resumed_transcript: Sequence[str] = (), persona: str | None = None
) -> str:
    """The full instructions: persona (the active agent's, when agents are declared), the
    call rules, and a resume note after a reconnect."""
    parts = [(persona or config.instructions).strip(), CALL_RULES]
    if config.context_note:
        parts.append(config.context_note)
    if resumed_transcript:
        parts.append(RESUMED_NOTE.format(transcript="\n".join(resumed_transcript)))
    return "\n\n".join(parts)


def _format(audio_format: AudioFormat) -> RealtimeAudioFormatsParam:
    if audio_format == "audio/pcma":
        return AudioPCMA(type="audio/pcma")
    return AudioPCMU(type="audio/pcmu")


def session_update(
    config: BridgeConfig,
    audio_format: AudioFormat,
    tools: Sequence[dict[str, Any]],
    resumed_transcript: Sequence[str] = (),
    persona: str | None = None,
    voice: str | None = None,
) -> RealtimeSessionCreateRequestParam:
    """The `session` of the one GA `session.update` a call sends (again after a reconnect);
    `voice` is the active agent's (None: the deployment's)."""
    session: RealtimeSessionCreateRequestParam = {
        "type": "realtime",
        "output_modalities": ["audio"],
        "instructions": instructions_text(config, resumed_transcript, persona),
        "audio": {
            "input": {
                # Same G.711 codec as the leg: no transcoding on the audio path.
                "format": _format(audio_format),
                "transcription": {"model": config.transcription_model},
                "turn_detection": {
                    "type": "semantic_vad",
                    "eagerness": config.vad_eagerness,
                    "create_response": True,
                    "interrupt_response": True,
                },
            },
            "output": {"format": _format(audio_format), "voice": voice or config.voice},
        },
        "tools": cast(Any, list(tools)),
        "tool_choice": "auto",
    }
    return session


def agent_update(
    config: BridgeConfig, persona: str, tools: Sequence[dict[str, Any]]
) -> RealtimeSessionCreateRequestParam:
    """The `session` of a handoff's `session.update`: the new agent's instructions and tools
    (audio, voice and turn detection stay as they are)."""
    return {
        "type": "realtime",
        "instructions": instructions_text(config, (), persona),
        "tools": cast(Any, list(tools)),
        "tool_choice": "auto",
    }
