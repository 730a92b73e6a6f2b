"""Real speech for the stand-ins, offline: text in, a call's audio out (simulator and fake caller).

Engines, chosen by name (`choose_voice`):
- `espeak`: eSpeak NG (the distribution's `espeak-ng` package), run as a process per line
  (`espeak-ng --stdout` writes a WAV at 22.05 kHz); no model, no download.
- `piper`: a Piper neural voice, only where the `piper-tts` package and a local voice file
  (`*.onnx` with its `.onnx.json` beside it) exist; nothing is downloaded.
- `tones`: no speech engine (the simulator's synthetic tones, the caller's noise bursts).
- `auto`: Piper where a voice file was named and is present, else eSpeak NG if installed,
  else tones, with a one-line notice saying why.

Synthesis is cached by (engine, voice, text, codec): in memory, and on disk when a cache
directory is given, so a scenario's lines are synthesised once per machine and tests stay fast.
The engine's leading and trailing silence is trimmed, so a line's audio is its speech.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib.util
import logging
import os
import shutil
import sys
import tempfile
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from telephony import audio
from telephony.errors import TelephonyError

log = logging.getLogger(__name__)

VoiceName = Literal["auto", "tones", "espeak", "piper"]
Engine = Literal["espeak", "piper"]

ESPEAK_BINARY = "espeak-ng"
# eSpeak NG voices for the two sides of a call, so a listener tells them apart (and the
# recogniser hears the caller's voice, which it decodes best: measured on the built-in lines).
AGENT_ESPEAK_VOICE = "en-us"
CALLER_ESPEAK_VOICE = "en-us+f3"
ESPEAK_WPM = 175
SYNTH_TIMEOUT_S = 20.0
MEMORY_CACHE_LINES = 256
# Far longer than any scripted line: a runaway text is refused rather than spoken for minutes.
MAX_TEXT_CHARS = 2000


class SpeechError(TelephonyError):
    """A speech engine failed or is not available."""


@dataclass(frozen=True, slots=True)
class VoiceChoice:
    """Which engine speaks, and the one-line notice when it is not the one asked for."""

    engine: Engine | None  # None: synthetic tones
    notice: str | None = None
    piper_model: Path | None = None


def espeak_available() -> bool:
    return shutil.which(ESPEAK_BINARY) is not None


def piper_problem(model: Path | None) -> str | None:
    """Why a Piper voice cannot speak here (None: it can)."""
    if model is None:
        return "no Piper voice file named (SIM_PIPER_VOICE=/path/to/voice.onnx)"
    if importlib.util.find_spec("piper") is None:
        return "the piper-tts package is not installed (pip install piper-tts)"
    if not model.is_file():
        return f"the Piper voice file {model} does not exist"
    config = model.with_name(model.name + ".json")
    if not config.is_file():
        return f"the Piper voice's config {config} does not exist"
    return None


def choose_voice(asked: VoiceName, *, piper_model: Path | None = None) -> VoiceChoice:
    """The engine for `asked`, falling back (with a notice) to what is installed."""
    if asked == "tones":
        return VoiceChoice(None)
    why_not_piper = ""
    if asked == "piper" or piper_model is not None:
        problem = piper_problem(piper_model)
        if problem is None:
            return VoiceChoice("piper", piper_model=piper_model)
        why_not_piper = f"Piper cannot speak ({problem}); "
    if espeak_available():
        notice = f"speech: {why_not_piper}using eSpeak NG" if why_not_piper else None
        return VoiceChoice("espeak", notice)
    return VoiceChoice(
        None,
        f"speech: {why_not_piper}espeak-ng is not installed (apt-get install espeak-ng); "
        "the simulated voices are synthetic tones",
    )


def _cache_key(parts: tuple[str, ...]) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:32]


class SpeechSynthesizer:
    """Text to a call's audio with one engine and voice, cached; safe to share between calls."""

    def __init__(
        self,
        engine: Engine,
        *,
        voice: str = AGENT_ESPEAK_VOICE,
        wpm: int = ESPEAK_WPM,
        piper_model: Path | None = None,
        cache_dir: Path | None = None,
        timeout_s: float = SYNTH_TIMEOUT_S,
    ) -> None:
        if engine == "piper" and piper_model is None:
            raise SpeechError("a Piper synthesizer needs its voice file")
        self.engine: Engine = engine
        self.voice = voice if engine == "espeak" else str(piper_model)
        self.wpm = wpm
        self.piper_model = piper_model
        self.cache_dir = cache_dir
        self.timeout_s = timeout_s
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._locks: dict[str, asyncio.Lock] = {}
        self.synthesised = 0  # lines actually run through the engine (cache misses)

    def describe(self) -> str:
        if self.engine == "piper":
            return f"Piper voice {self.piper_model}"
        return f"eSpeak NG voice {self.voice}"

    def with_voice(self, voice: str) -> SpeechSynthesizer:
        """The same engine and cache with another eSpeak voice (the other side of a call)."""
        return SpeechSynthesizer(
            self.engine,
            voice=voice,
            wpm=self.wpm,
            piper_model=self.piper_model,
            cache_dir=self.cache_dir,
            timeout_s=self.timeout_s,
        )

    async def speak(self, text: str, codec: audio.Codec) -> bytes:
        """`text` spoken, as `codec` audio (8 kHz G.711, or 24 kHz 16-bit PCM)."""
        text = " ".join(text.split())
        if not text:
            return b""
        if len(text) > MAX_TEXT_CHARS:
            raise SpeechError(f"a line of {len(text)} characters is longer than {MAX_TEXT_CHARS}")
        key = _cache_key((self.engine, self.voice, str(self.wpm), codec, text))
        cached = self._memory.get(key)
        if cached is not None:
            self._memory.move_to_end(key)
            return cached
        # One synthesis per line at a time: a second caller of the same line waits for it.
        lock = self._locks.setdefault(key, asyncio.Lock())
        try:
            async with lock:
                cached = self._memory.get(key)
                if cached is not None:
                    return cached
                result = await self._load_or_make(key, text, codec)
                self._memory[key] = result
                while len(self._memory) > MEMORY_CACHE_LINES:
                    self._memory.popitem(last=False)
                return result
        finally:
            if not lock.locked():
                self._locks.pop(key, None)

    async def _load_or_make(self, key: str, text: str, codec: audio.Codec) -> bytes:
        path = self.cache_dir / f"{key}.{codec}" if self.cache_dir is not None else None
        if path is not None:
            with contextlib.suppress(OSError):
                return await asyncio.to_thread(path.read_bytes)
        wav = await self._run_engine(text)
        self.synthesised += 1
        try:
            parsed = audio.parse_wav(wav)
            plain = (parsed.format_tag, parsed.bits, parsed.channels) == (
                audio.WAVE_FORMAT_PCM,
                16,
                1,
            )
            pcm = parsed.data if plain else audio.wav_to_pcm16(wav, parsed.rate)
        except audio.AudioFormatError as exc:
            raise SpeechError(f"{self.describe()} gave no usable WAV: {exc}") from None
        result = audio.to_codec(audio.trim_silence(pcm, parsed.rate), parsed.rate, codec)
        if path is not None:
            await asyncio.to_thread(_write_atomically, path, result)
        return result

    async def _run_engine(self, text: str) -> bytes:
        if self.engine == "espeak":
            # Text on stdin, so a line starting with "-" is never read as an option.
            argv = [ESPEAK_BINARY, "-v", self.voice, "-s", str(self.wpm), "--stdout"]
            return await _run(argv, text, self.timeout_s)
        assert self.piper_model is not None
        with tempfile.TemporaryDirectory(prefix="piper-") as tmp:
            out = Path(tmp) / "line.wav"
            argv = [sys.executable, "-m", "piper", "--model", str(self.piper_model)]
            await _run([*argv, "--output-file", str(out)], text, self.timeout_s)
            return await asyncio.to_thread(out.read_bytes)


async def _run(argv: list[str], stdin_text: str, timeout_s: float) -> bytes:
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except OSError as exc:
        raise SpeechError(f"cannot run {argv[0]}: {exc.strerror or exc}") from exc
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate(stdin_text.encode())
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SpeechError(f"{argv[0]} took longer than {timeout_s:.0f} s") from None
    except asyncio.CancelledError:
        # The reply was cancelled mid-synthesis: the engine must not outlive it.
        proc.kill()
        await asyncio.shield(proc.wait())
        raise
    if proc.returncode != 0:
        detail = err.decode(errors="replace").strip().splitlines()
        raise SpeechError(
            f"{argv[0]} failed (exit {proc.returncode}): {detail[-1] if detail else 'no output'}"
        )
    return out


def _write_atomically(path: Path, data: bytes) -> None:
    """Write then rename, so two processes sharing the cache never read half a line."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".line-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as exc:
        # The cache is an optimisation: a read-only or full disk costs a resynthesis, not a call.
        log.warning("speech cache: cannot write %s: %s", path, exc)


@dataclass(frozen=True, slots=True)
class SpeechSetup:
    """The stand-ins' speech as configured: who speaks with what, whether the simulator
    recognises the caller, which VAD it runs, and one line per thing that fell back."""

    agent: SpeechSynthesizer | None
    caller: SpeechSynthesizer | None
    recognize: bool
    vad: Literal["auto", "energy", "webrtc"]
    notices: tuple[str, ...] = ()

    def describe(self) -> str:
        voice = self.agent.describe() if self.agent is not None else "synthetic tones"
        heard = "recognised by PocketSphinx" if self.recognize else "taken from the script"
        return f"voice: {voice}; caller's words {heard}; VAD: {self.vad}"


def speech_setup(
    voice: VoiceName,
    *,
    piper_model: Path | None = None,
    cache_dir: Path | None = None,
    recognition: bool = True,
    vad: Literal["auto", "energy", "webrtc"] = "auto",
) -> SpeechSetup:
    """What `voice`, `recognition` and `vad` come to on this machine (with fallback notices).

    Recognition needs real speech from the caller, so it is on only with a voice."""
    from telephony.sim.recognizer import pocketsphinx_available
    from telephony.sim.vad import resolve_vad

    choice = choose_voice(voice, piper_model=piper_model)
    notices = [choice.notice] if choice.notice else []
    agent: SpeechSynthesizer | None = None
    caller: SpeechSynthesizer | None = None
    if choice.engine is not None:
        agent = SpeechSynthesizer(
            choice.engine, piper_model=choice.piper_model, cache_dir=cache_dir
        )
        # The caller always speaks with eSpeak NG's second voice when it can (the recogniser
        # was tuned on it); a Piper-only machine has the caller speak Piper too.
        caller = (
            SpeechSynthesizer("espeak", voice=CALLER_ESPEAK_VOICE, cache_dir=cache_dir)
            if espeak_available()
            else agent
        )
    recognize = recognition and caller is not None
    if recognize and not pocketsphinx_available():
        notices.append(
            "speech: the pocketsphinx package is not installed; the caller's words come "
            "from the script"
        )
        recognize = False
    resolved = resolve_vad(vad)
    if vad == "webrtc" and resolved != "webrtc":
        notices.append(
            "speech: the webrtcvad module (webrtcvad-wheels) is not installed; the simulator "
            "detects speech by level"
        )
    return SpeechSetup(agent, caller, recognize, resolved, tuple(notices))
