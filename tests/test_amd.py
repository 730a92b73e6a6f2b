"""Answering-machine detection on the callee's audio (telephony/amd.py): real speech from
eSpeak NG through G.711 as a line carries it, beeps and fax tones, and silence."""

from __future__ import annotations

import asyncio
import math
import struct

from telephony import audio
from telephony.amd import (
    FAX,
    HUMAN,
    MACHINE_END_BEEP,
    MACHINE_END_OTHER,
    MACHINE_END_SILENCE,
    MACHINE_START,
    UNKNOWN,
    AmdSettings,
    LineListener,
    MachineDetector,
    Verdict,
)
from tests.rtp_voice import GREETING, needs_espeak, speech
from tests.rtp_voice import quiet as silence


def tone(hz: float, ms: int, amplitude: int = 8000) -> bytes:
    n = 8 * ms
    samples = [int(amplitude * math.sin(2 * math.pi * hz * i / 8000)) for i in range(n)]
    return struct.pack(f"<{n}h", *samples)


def noise_floor(pcm: bytes, level: int = 60) -> bytes:
    """A line's hiss under everything (deterministic), so silence is not digital zero."""
    n = len(pcm) // 2
    values = struct.unpack(f"<{n}h", pcm)
    hiss = [((i * 7919) % 2 * 2 - 1) * level for i in range(n)]
    mixed = [max(-32768, min(32767, v + h)) for v, h in zip(values, hiss, strict=True)]
    return struct.pack(f"<{n}h", *mixed)


def judge(pcm: bytes, settings: AmdSettings | None = None) -> list[Verdict]:
    """What the detector decides hearing `pcm` in 20 ms frames through μ-law."""
    line = audio.mulaw_to_pcm16(audio.pcm16_to_mulaw(noise_floor(pcm)))
    detector = MachineDetector(settings)
    verdicts = []
    for at in range(0, len(line) - 319, 320):
        verdict = detector.feed(line[at : at + 320])
        if verdict is not None:
            verdicts.append(verdict)
    return verdicts


@needs_espeak
def test_a_person_saying_hello_then_waiting_is_a_human_as_soon_as_they_paused() -> None:
    hello = speech("Hello?")

    verdicts = judge(silence(400) + hello + silence(3000))

    [verdict] = verdicts
    assert verdict.answered_by == HUMAN
    # Decided by the pause after "Hello?" (800 ms), not by the end of the analysis window.
    assert verdict.at_ms <= 400 + len(hello) // 16 + 900


@needs_espeak
def test_a_greeting_is_a_machine_whose_message_ends_at_the_end_of_its_beep() -> None:
    greeting = speech(GREETING)
    beep_ends_ms = 300 + len(greeting) // 16 + 200 + 500

    verdicts = judge(silence(300) + greeting + silence(200) + tone(1000, 500) + silence(3000))

    assert [v.answered_by for v in verdicts] == [MACHINE_START, MACHINE_END_BEEP]
    start, end = verdicts
    assert start.at_ms < 300 + 2500  # known for a machine while the greeting still plays
    # The message is left after the beep, not over it, and not much later.
    assert beep_ends_ms <= end.at_ms <= beep_ends_ms + 100
    assert "1000 Hz" in end.reason


@needs_espeak
def test_a_greeting_without_a_beep_ends_in_its_silence() -> None:
    greeting = speech(GREETING)

    verdicts = judge(silence(300) + greeting + silence(4000))

    assert [v.answered_by for v in verdicts] == [MACHINE_START, MACHINE_END_SILENCE]
    # The clip ends in some silence of its own: the 1500 ms run ends after the clip, within
    # 1500 ms of its end.
    clip_end_ms = 300 + len(greeting) // 16
    assert clip_end_ms < verdicts[1].at_ms <= clip_end_ms + 1500


@needs_espeak
def test_a_short_greeting_and_its_beep_before_the_greeting_rule_is_a_machine() -> None:
    verdicts = judge(silence(200) + speech("Leave a message") + tone(1400, 400) + silence(2000))

    assert verdicts[-1].answered_by == MACHINE_END_BEEP
    assert HUMAN not in [v.answered_by for v in verdicts]


@needs_espeak
def test_speech_is_never_taken_for_a_beep() -> None:
    # Vowels held by a voice are periodic, but not sine-like: a greeting that ends in speech
    # and never beeps must end by its silence.
    greeting = speech("Hello, hello, hello, this is the answering machine of the Taylors.")

    verdicts = judge(greeting + silence(2000))

    assert verdicts[-1].answered_by == MACHINE_END_SILENCE


def test_a_fax_tone_before_anything_is_a_fax() -> None:
    verdicts = judge(tone(1100, 500) + silence(3000) + tone(1100, 500))

    assert [v.answered_by for v in verdicts] == [FAX]


def test_nothing_said_is_unknown_after_the_initial_silence() -> None:
    verdicts = judge(silence(6000))

    assert [(v.answered_by, v.at_ms) for v in verdicts] == [(UNKNOWN, 2500)]


def test_a_message_that_never_ends_is_cut_at_the_longest_wait() -> None:
    settings = AmdSettings(max_message_ms=3000)
    hiss = tone(200, 2000, amplitude=3000)  # voiced, too low to be a beep, never silent

    verdicts = judge(hiss + hiss, settings)

    assert [v.answered_by for v in verdicts] == [MACHINE_START, MACHINE_END_OTHER]
    assert verdicts[1].at_ms == 3000


async def test_a_line_that_sends_no_packets_is_judged_by_the_clock() -> None:
    now = [0.0]
    listener = LineListener(tick_s=0.01, clock=lambda: now[0])

    async def time_passes() -> None:
        while True:
            await asyncio.sleep(0.005)
            now[0] += 0.1

    ticking = asyncio.create_task(time_passes())
    try:
        verdict = await asyncio.wait_for(listener.verdict(), 5.0)
    finally:
        ticking.cancel()

    assert verdict.answered_by == UNKNOWN
    assert listener.verdicts == [verdict]


@needs_espeak
async def test_a_listener_waits_for_the_end_of_a_machines_message() -> None:
    listener = LineListener(tick_s=60)  # the clock never needed: audio covers the time
    line = audio.mulaw_to_pcm16(audio.pcm16_to_mulaw(speech(GREETING) + tone(1000, 400)))
    line += silence(200)
    for at in range(0, len(line) - 319, 320):
        listener.hear(line[at : at + 320])

    verdict = await asyncio.wait_for(listener.verdict(), 1.0)

    assert verdict.answered_by == MACHINE_END_BEEP
    assert [v.answered_by for v in listener.verdicts] == [MACHINE_START, MACHINE_END_BEEP]
