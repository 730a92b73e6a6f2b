"""TwiML answers, built with the twilio library."""

from __future__ import annotations

from twilio.twiml.voice_response import Connect, Stream, VoiceResponse

BUSY_MESSAGE = "Sorry, all our lines are busy right now. Please call again in a few minutes."


def connect_stream(
    stream_url: str, parameters: dict[str, str], action_url: str | None = None
) -> str:
    """`<Connect action=…><Stream url=…>` with `<Parameter>`s: the call's audio goes to our
    socket; when the stream ends with the call still up, Twilio asks `action_url` what next."""
    response = VoiceResponse()
    connect = Connect(action=action_url) if action_url else Connect()
    stream = Stream(url=stream_url)
    for name, value in parameters.items():
        stream.parameter(name=name, value=value)
    connect.append(stream)
    response.append(connect)
    return str(response)


def hangup() -> str:
    """End the call (the stream ended because the call is over)."""
    response = VoiceResponse()
    response.hangup()
    return str(response)


def busy(message: str = BUSY_MESSAGE) -> str:
    """Tell the caller the line is busy and hang up."""
    response = VoiceResponse()
    response.say(message)
    response.hangup()
    return str(response)
