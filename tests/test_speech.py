"""Real speech in the stand-ins: eSpeak NG speaks, PocketSphinx hears, over real calls.

The engines are real (no stand-in for them): these tests skip on a machine without espeak-ng
or pocketsphinx, and under CI (.ci/run installs both) they fail instead.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import shutil
import zlib
from pathlib import Path

import pytest
from openai import AsyncOpenAI
from openai.types.realtime import ConversationItemInputAudioTranscriptionCompletedEvent
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony import audio
from telephony.legs.twilio.leg import parse_mark_name
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.recognizer import PhraseRecognizer, closest_phrase, pocketsphinx_available
from telephony.sim.scenario import Scenario
from telephony.sim.simulator import RealtimeSimulator, synthesize_speech
from telephony.sim.speech import (
    AGENT_ESPEAK_VOICE,
    CALLER_ESPEAK_VOICE,
    MAX_TEXT_CHARS,
    SpeechError,
    SpeechSynthesizer,
    choose_voice,
    espeak_available,
    speech_setup,
)
from telephony.sim.vad import EnergyVad, SpeechStarted, SpeechStopped, webrtcvad_available
from tests.cli_support import clean_env, run_cli
from tests.e2e_support import call_stack

FRAME_MS = 20

_missing = [
    name
    for name, ok in (
        ("espeak-ng (apt-get install espeak-ng)", espeak_available()),
        ("pocketsphinx (pip install pocketsphinx)", pocketsphinx_available()),
        ("webrtcvad (pip install webrtcvad-wheels)", webrtcvad_available()),
    )
    if not ok
]
pytestmark = pytest.mark.skipif(
    bool(_missing) and not os.environ.get("CI"),
    reason=f"speech engines not installed: {', '.join(_missing)}",
)

CALLER_LINES = [
    "What is on the menu tonight?",
    "Do you have parking nearby?",
    "Yes, that's right.",
    "Goodbye.",
]


def caller_voice(tmp_path: Path | None = None) -> SpeechSynthesizer:
    return SpeechSynthesizer("espeak", voice=CALLER_ESPEAK_VOICE, cache_dir=tmp_path)


def agent_voice(tmp_path: Path | None = None) -> SpeechSynthesizer:
    return SpeechSynthesizer("espeak", voice=AGENT_ESPEAK_VOICE, cache_dir=tmp_path)


@pytest.mark.parametrize("codec", ["pcmu", "pcma", "pcm16"])
async def test_what_espeak_says_is_recognised_as_that_phrase_and_tones_as_none(
    codec: audio.Codec,
) -> None:
    recognizer = PhraseRecognizer(CALLER_LINES)
    voice = caller_voice()
    for line in CALLER_LINES:
        spoken = await voice.speak(line, codec)
        result = recognizer.recognize(spoken, codec)
        print(f"{codec}: {line!r} heard as {result.heard!r} ({result.ratio:.2f})")
        assert result.phrase == line, result
        # The words themselves, not only the choice: most of the phrase's words were heard.
        assert result.ratio >= 0.5, result
    tones = audio.encode(
        audio.speech_like_pcm16(1500, rate=24000 if codec == "pcm16" else 8000), codec
    )
    assert recognizer.recognize(tones, codec).phrase is None


def test_the_closest_phrase_needs_most_of_its_words() -> None:
    assert closest_phrase("yes that's right", CALLER_LINES) == ("Yes, that's right.", 1.0)
    assert closest_phrase("the", CALLER_LINES)[0] is None
    assert closest_phrase("", CALLER_LINES)[0] is None


async def test_a_line_is_synthesised_once_then_read_from_memory_and_disk(tmp_path: Path) -> None:
    first = agent_voice(tmp_path)
    spoken = await first.speak("Thanks for calling.", "pcmu")
    again = await first.speak("Thanks  for calling.", "pcmu")  # same words, other spacing
    assert again == spoken and first.synthesised == 1
    # Speech, not silence or a click: about a second long and loud enough.
    ms = audio.duration_ms(len(spoken), "pcmu")
    assert 500 < ms < 3000, ms
    assert audio.dbfs(spoken, "pcmu") > -30
    # Another process (a new synthesizer on the same cache directory) reads it from disk.
    second = agent_voice(tmp_path)
    assert await second.speak("Thanks for calling.", "pcmu") == spoken
    assert second.synthesised == 0
    # Each codec is cached apart: 24 kHz PCM is three times the samples, twice the bytes each.
    pcm = await second.speak("Thanks for calling.", "pcm16")
    assert second.synthesised == 1
    assert abs(audio.duration_ms(len(pcm), "pcm16", rate=24000) - ms) <= 2


def test_without_espeak_the_voices_fall_back_to_tones_with_one_notice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it: no espeak-ng
    choice = choose_voice("auto")
    assert choice.engine is None
    assert choice.notice is not None and "espeak-ng is not installed" in choice.notice
    assert "\n" not in choice.notice
    setup = speech_setup("auto", recognition=True)
    assert setup.agent is None and setup.caller is None and not setup.recognize


def test_piper_without_its_package_or_voice_file_says_which_and_uses_espeak(
    tmp_path: Path,
) -> None:
    choice = choose_voice("piper", piper_model=tmp_path / "missing.onnx")
    assert choice.engine == ("espeak" if shutil.which("espeak-ng") else None)
    assert choice.notice is not None and "Piper cannot speak" in choice.notice
    assert "piper-tts" in choice.notice or "missing.onnx" in choice.notice
    assert choose_voice("tones").engine is None


async def test_both_vads_find_the_turn_in_real_speech_and_only_webrtc_ends_a_line_offset() -> None:
    speech = await caller_voice().speak(CALLER_LINES[1], "pcmu")
    speech_ms = audio.duration_ms(len(speech))
    line = audio.silence(1000) + speech + audio.silence(800)
    for kind in ("webrtc", "energy"):
        vad = EnergyVad(kind=kind)
        assert vad.kind == kind
        start, stop = vad.feed(line)
        assert isinstance(start, SpeechStarted) and isinstance(stop, SpeechStopped)
        # The start includes the 300 ms prefix padding; speech ends where eSpeak's does, but
        # for its softest last sounds (under the -40 dBFS threshold, over the -50 of the trim).
        assert 700 - FRAME_MS <= start.audio_start_ms <= 700 + 3 * FRAME_MS, (kind, start)
        end = 1000 + speech_ms
        assert end - 250 <= stop.speech_end_ms <= end + 3 * FRAME_MS, (kind, stop, end)
    assert EnergyVad(kind="auto").kind == "webrtc"
    # A constant offset is loud by level, so the threshold alone hears a caller who never
    # stops; WebRTC's detector hears the step, then nothing.
    offset = audio.pcm16_to_mulaw((3000).to_bytes(2, "little", signed=True) * 16000)
    assert [type(e) for e in EnergyVad(kind="energy").feed(offset)] == [SpeechStarted]
    assert [type(e) for e in EnergyVad(kind="webrtc").feed(offset)] == [
        SpeechStarted,
        SpeechStopped,
    ]


async def test_the_simulator_speaks_24_khz_pcm_and_a_line_it_cannot_say_is_tones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    voice = agent_voice(tmp_path)
    too_long = "word " * (MAX_TEXT_CHARS // 5 + 1)
    with pytest.raises(SpeechError, match="longer than"):
        await voice.speak(too_long, "pcm16")
    scenario = Scenario.model_validate(
        {
            "greeting": {"text": "Hello, how can I help?", "audio_ms": 3000},
            "steps": [{"reply": {"text": too_long.strip(), "audio_ms": 1000}}],
        }
    )
    said: list[bytes] = []
    async with RealtimeSimulator(scenario, realtime_factor=0.0, voice=voice) as sim:
        client = AsyncOpenAI(api_key="sk-test", base_url=sim.base_url)
        async with client.realtime.connect(model="gpt-realtime") as conn:
            for _ in range(2):
                await conn.response.create()
                chunks: list[bytes] = []
                async with asyncio.timeout(20):
                    async for event in conn:
                        if event.type == "response.output_audio.delta":
                            chunks.append(base64.b64decode(event.delta))
                        if event.type == "response.done":
                            assert event.response.status == "completed"
                            break
                said.append(b"".join(chunks))
    # The session's default output is 24 kHz PCM: the greeting is eSpeak's line at that rate,
    # then silence up to the scripted 3 s (speech is never cut to fit).
    spoken = await voice.speak("Hello, how can I help?", "pcm16")
    assert said[0][: len(spoken)] == spoken
    assert len(said[0]) == 3000 * 48 and not any(said[0][len(spoken) :])
    # A line the engine refuses is the synthetic tones of its scripted length, with one warning.
    assert said[1] == synthesize_speech(1000, zlib.crc32(too_long.strip().encode()), "pcm16")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "tones" in r.message]
    assert len(warnings) == 1 and "\n" not in warnings[0].message


def menu_scenario() -> Scenario:
    return Scenario.model_validate(
        {
            "name": "speech",
            "greeting": {"text": "Hello, how can I help?"},
            "steps": [
                {
                    "caller_transcript": CALLER_LINES[0],
                    "reply": {
                        "text": "Tonight we have fresh pasta with tomato and basil, a wood fired "
                        "pizza, grilled fish of the day, and a lemon tart for dessert."
                    },
                },
                {
                    "caller_transcript": CALLER_LINES[1],
                    "reply": {"text": "Yes, there is parking on the square."},
                },
                {"caller_transcript": CALLER_LINES[3], "reply": {"text": "Goodbye, see you."}},
            ],
            "fallback": {"text": "Sorry, could you say that again?"},
        }
    )


def speaking_simulator(tmp_path: Path) -> dict[str, object]:
    return {"voice": agent_voice(tmp_path), "recognize": True, "vad": "auto"}


async def hear_everything(caller: FakeTwilioCaller, at_least_ms: float) -> float:
    await caller.wait_for(lambda c: c.heard_ms >= at_least_ms and c.buffered_ms == 0, 20)
    return caller.heard_ms


async def test_barge_in_by_real_speech_truncates_at_the_speech_the_caller_heard(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    agent = agent_voice(tmp_path)
    reply = menu_scenario().steps[0].reply
    assert reply is not None
    reply_text = reply.text
    reply_audio = await agent.speak(reply_text, "pcmu")
    greeting_ms = audio.duration_ms(len(await agent.speak("Hello, how can I help?", "pcmu")))
    async with call_stack(engine, menu_scenario(), simulator=speaking_simulator(tmp_path)) as stack:
        caller = stack.caller(voice=caller_voice(tmp_path))
        await caller.dial()
        before = await hear_everything(caller, greeting_ms - FRAME_MS)
        await caller.say(CALLER_LINES[0])
        session = stack.sim.sessions[0]
        await session.wait_for_sent("response.done", count=2, within=20)
        # Two seconds into the spoken reply, the caller talks over it: real speech.
        await caller.wait_for(lambda c: c.heard_ms >= before + 2000, 20)
        await caller.say(CALLER_LINES[1])
        await caller.wait_for(lambda c: len(c.clears) == 1, 10)
        truncate = await session.wait_for_received("conversation.item.truncate", within=5)
        clear = caller.clears[0]
        heard = b"".join(chunk.audio for chunk in caller.heard if chunk.t < clear.t)
        heard_of_reply = heard[int(before * 8) :]
        # The answer to the interruption is the parking reply: recognised, not scripted order.
        await session.wait_for_sent("response.done", count=3, within=20)
        confirmed = [
            mark[1]
            for echo in caller.marks_echoed
            if not echo.cleared
            and (mark := parse_mark_name(echo.name)) is not None
            and mark[2] == truncate["item_id"]
        ]
        await caller.hangup()
        events = await stack.events(caller)
    audio_end = truncate["audio_end_ms"]
    heard_ms = audio.duration_ms(len(heard_of_reply))
    print(f"reply {audio.duration_ms(len(reply_audio)):.0f} ms, heard {heard_ms:.0f} ms, "
          f"truncated at {audio_end} ms")  # fmt: skip
    # What the caller heard of the reply is the reply's speech from its start, byte for byte,
    # and the truncate point is that much (within a frame), not what had been sent.
    assert heard_of_reply == reply_audio[: len(heard_of_reply)]
    assert max(confirmed) <= audio_end <= heard_ms + FRAME_MS, (confirmed, audio_end, heard_ms)
    assert abs(audio_end - heard_ms) <= 2 * FRAME_MS
    assert audio_end < audio.duration_ms(len(reply_audio)) - 1000  # cut well before its end
    transcripts = [e["data"]["text"] for e in events if e["kind"] == "caller_transcript"]
    assert transcripts == CALLER_LINES[:2]
    said = [e["transcript"] for e in session.sent_events("response.output_audio_transcript.done")]
    assert said[-1] == "Yes, there is parking on the square."


async def test_the_caller_drives_the_scenario_by_what_it_says_not_by_script_order(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    agent = agent_voice(tmp_path)
    greeting_ms = audio.duration_ms(len(await agent.speak("Hello, how can I help?", "pcmu")))
    async with call_stack(engine, menu_scenario(), simulator=speaking_simulator(tmp_path)) as stack:
        caller = stack.caller(voice=caller_voice(tmp_path))
        await caller.dial()
        heard = await hear_everything(caller, greeting_ms - FRAME_MS)
        session = stack.sim.sessions[0]
        # Out of script order: the second expected question first.
        for count, line in enumerate([CALLER_LINES[1], None, CALLER_LINES[3]], start=2):
            if line is None:
                await caller.play_speech(1200)  # not speech: noise the recogniser cannot place
            else:
                await caller.say(line)
            await session.wait_for_sent("response.done", count=count, within=20)
            heard = await hear_everything(caller, heard + 500)
        await caller.hangup()
        events = await stack.events(caller)
    completed = session.sent_events("conversation.item.input_audio_transcription.completed")
    for event in completed:
        ConversationItemInputAudioTranscriptionCompletedEvent.model_validate(event)
    transcripts = [e["transcript"] for e in completed]
    assert transcripts[0] == CALLER_LINES[1]
    assert transcripts[1] == ""  # noise: no words, and no expected phrase
    assert transcripts[2] == CALLER_LINES[3]
    said = [e["transcript"] for e in session.sent_events("response.output_audio_transcript.done")]
    assert said == [
        "Hello, how can I help?",
        "Yes, there is parking on the square.",
        "Sorry, could you say that again?",
        "Goodbye, see you.",
    ]
    persisted = [e["data"]["text"] for e in events if e["kind"] == "caller_transcript"]
    assert persisted[0] == CALLER_LINES[1] and persisted[-1] == CALLER_LINES[3]


async def test_voice_agent_call_says_a_line_that_the_simulator_recognises(
    engine: AsyncEngine, tmp_path: Path
) -> None:
    async with call_stack(engine, menu_scenario(), simulator=speaking_simulator(tmp_path)) as stack:
        code, _, err = await run_cli(
            "call", "--server", stack.service.url, "--say", CALLER_LINES[1], "--tail-ms", "4000",
            "--out", str(tmp_path / "heard.wav"),
            env=clean_env(), cwd=tmp_path,
        )  # fmt: skip
        session = await stack.sim.wait_for_session(0)
    assert code == 0, err
    assert [r.phrase for r in session.recognitions] == [CALLER_LINES[1]]
    said = [e["transcript"] for e in session.sent_events("response.output_audio_transcript.done")]
    assert said[:2] == ["Hello, how can I help?", "Yes, there is parking on the square."]
    # An empty line is refused before any call is placed, in one line.
    code, _, err = await run_cli(
        "call", "--server", "http://127.0.0.1:9", "--say", " ", env=clean_env(), cwd=tmp_path
    )
    assert code == 2 and err.strip() == "voice-agent call: --say needs some words", err
