"""TwiML answers, built with the twilio library."""

from __future__ import annotations

from twilio.twiml.voice_response import Connect, Dial, Stream, VoiceResponse

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


def dial(destination: str, *, action_url: str, answered_url: str, timeout_s: int) -> str:
    """`<Dial action timeout><Number|Sip statusCallback>`: put the caller through to a person;
    Twilio tells `answered_url` when they pick up and asks `action_url` what next when the dial
    ends (answered and over, busy, no answer). The person sees the caller's own number."""
    response = VoiceResponse()
    dial_el = Dial(action=action_url, method="POST", timeout=timeout_s)
    noun = dial_el.sip if destination.startswith(("sip:", "sips:")) else dial_el.number
    noun(
        destination,
        status_callback_event="answered",
        status_callback=answered_url,
        status_callback_method="POST",
    )
    response.append(dial_el)
    return str(response)


def conference(name: str) -> str:
    """`<Dial><Conference>`: join the named conference (a warm transfer's room). It starts when
    either side enters and ends when either leaves, so nobody is left alone in it; no beep."""
    response = VoiceResponse()
    dial_el = Dial()
    dial_el.conference(
        name,
        start_conference_on_enter=True,
        end_conference_on_exit=True,
        beep=False,
        wait_url="",
    )
    response.append(dial_el)
    return str(response)


def briefing(text: str, then_url: str) -> str:
    """A warm transfer's person: hear the briefing, then Twilio asks `then_url` what next
    (`<Redirect>` runs only once the `<Say>` has been played to its end)."""
    response = VoiceResponse()
    response.say(text)
    response.redirect(then_url, method="POST")
    return str(response)


def redirect(url: str) -> str:
    """Ask `url` what next (a warm transfer's person, once Twilio's detector has answered)."""
    response = VoiceResponse()
    response.redirect(url, method="POST")
    return str(response)


def say_and_hang_up(text: str) -> str:
    response = VoiceResponse()
    response.say(text)
    response.hangup()
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
