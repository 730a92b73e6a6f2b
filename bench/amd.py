"""Answering-machine detection on SIP (telephony/amd.py): how often it is right, how soon it
knows, and what it costs, on spoken answers made with eSpeak NG in several voices, through
G.711 with a line's hiss, as a callee's audio arrives.

Prints one table (no assertions). Baseline in the same run: what the SIP leg did before the
detector, taking whoever answers for a person (right for every person, wrong for every
machine: a voicemail then hears the purpose and the operation's state).

    .venv/bin/python bench/amd.py
"""

from __future__ import annotations

import math
import struct
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _stats import pct  # bench/ is on sys.path when run as a script

from telephony import audio
from telephony.amd import HUMAN, MACHINE_START, MachineDetector

PEOPLE = [
    "Hello?",
    "Yes?",
    "Hi, this is Sam.",
    "Hello, who is this?",
    "Sam speaking.",
    "Hello. Hello?",
    "Good morning.",
    "Yeah, hi.",
]
MACHINES = [
    "Hi, you have reached Alex and Sam. We cannot take your call right now. "
    "Please leave a message after the tone.",
    "The person you are calling is not available. Please leave a message.",
    "Hello, this is Dana. Leave your name and number and I will call you back.",
    "You have reached the Taylors. Nobody is home. Speak after the beep.",
    "Thank you for calling. Our office is closed. Please leave a message after the tone.",
    "Hi, it's Chris, I can't get to the phone, leave a message.",
]
VOICES = ["en", "en-us", "en-gb-x-rp", "en+f3"]
BEEP_HZ = [1000.0, 1400.0, 850.0]


def speech(text: str, voice: str) -> bytes:
    wav = subprocess.run(
        ["espeak-ng", "-v", voice, "--stdout", text], capture_output=True, check=True
    ).stdout
    return audio.trim_silence(audio.wav_to_pcm16(wav), 8000, keep_ms=0)


def tone(hz: float, ms: int) -> bytes:
    n = 8 * ms
    return struct.pack(
        f"<{n}h", *(int(7000 * math.sin(2 * math.pi * hz * i / 8000)) for i in range(n))
    )


def line(pcm: bytes) -> bytes:
    n = len(pcm) // 2
    values = struct.unpack(f"<{n}h", pcm)
    hissed = struct.pack(
        f"<{n}h",
        *(max(-32768, min(32767, v + ((i * 7919) % 3 - 1) * 80)) for i, v in enumerate(values)),
    )
    return audio.mulaw_to_pcm16(audio.pcm16_to_mulaw(hissed))


def run(pcm: bytes) -> tuple[str, int, float]:
    """(final answered_by, its ms into the audio, CPU µs per frame)."""
    detector = MachineDetector()
    frames = [pcm[at : at + 320] for at in range(0, len(pcm) - 319, 320)]
    final, at_ms, fed = "none", -1, 0
    started = time.process_time()
    for frame in frames:
        fed += 1
        verdict = detector.feed(frame)
        if verdict is not None and verdict.answered_by != MACHINE_START:
            final, at_ms = verdict.answered_by, verdict.at_ms
            break
    cpu_us = (time.process_time() - started) * 1e6 / max(1, fed)
    return final, at_ms, cpu_us


def main() -> None:
    people, machines = [], []
    for voice in VOICES:
        for text in PEOPLE:
            said = speech(text, voice)
            people.append(
                (run(line(b"\x00\x00" * 2400 + said + b"\x00\x00" * 8 * 4000)), len(said) // 16)
            )
        for i, text in enumerate(MACHINES):
            said = speech(text, voice)
            with_beep = said + tone(BEEP_HZ[i % len(BEEP_HZ)], 500)
            for clip, beep in ((with_beep, True), (said, False)):
                pcm = line(b"\x00\x00" * 2400 + clip + b"\x00\x00" * 8 * 4000)
                machines.append((run(pcm), len(clip) // 16, beep))
    human_right = [r for r, _ in people if r[0] == HUMAN]
    machine_right = [r for r, _, _ in machines if r[0].startswith("machine")]
    # How long after the person stopped talking the agent may speak; after the beep, the message.
    wait = [r[1] - (300 + n) for r, n in people if r[0] == HUMAN]
    after_beep = [
        r[1] - (300 + n) for r, n, beep in machines if beep and r[0] == "machine_end_beep"
    ]
    cpu = [r[2] for r, _ in people] + [r[2] for r, _, _ in machines]
    print(
        f"answering-machine detection, {len(people)} people and {len(machines)} machines "
        f"({len(VOICES)} eSpeak voices, G.711 with hiss)"
    )

    def row(name: str, detector: str, baseline: str = "") -> None:
        print(f"{name:34} {detector:>12} {baseline:>12}")

    row("", "detector", "baseline")
    row(
        "people taken for people",
        f"{len(human_right)}/{len(people)}",
        f"{len(people)}/{len(people)}",
    )
    row(
        "machines taken for machines", f"{len(machine_right)}/{len(machines)}", f"0/{len(machines)}"
    )
    row("ms from end of speech to human", f"{pct(wait, 50):.0f}/{pct(wait, 99):.0f}", "0 (p50/p99)")
    row("ms from end of beep to machine", f"{pct(after_beep, 50):.0f}/{pct(after_beep, 99):.0f}")
    row("CPU µs per 20 ms frame", f"{pct(cpu, 50):.1f}/{pct(cpu, 99):.1f}")
    wrong = [
        (t, r[0]) for (r, _), t in zip(people, PEOPLE * len(VOICES), strict=True) if r[0] != HUMAN
    ]
    if wrong:
        print("people judged otherwise:", wrong)
    missed = [r[0] for r, _, _ in machines if not r[0].startswith("machine")]
    if missed:
        print("machines judged otherwise:", missed)


if __name__ == "__main__":
    main()
