"""Speech detection on a stream of telephone audio (bytes in, events out; no I/O).

The detector cuts the stream into short frames and calls a frame voiced when its RMS level is
at or above a threshold (dBFS) and, where the `webrtcvad` module is installed (the
`webrtcvad-wheels` package), when WebRTC's voice activity detector also calls it speech (it
models speech rather than loudness: a line's constant offset, loud by level, ends its turn after
a few frames instead of never; `server_vad`'s threshold still means what it says). Without the
module the threshold alone decides (the fallback). Then a small state machine:

    silence --(voiced frame)--> pending --(activation_ms voiced in a row)--> speech
    pending --(unvoiced frame)--> silence
    speech --(silence_ms unvoiced in a row)--> silence

Offsets are milliseconds of audio fed since the detector was created, like the Realtime API's
`audio_start_ms` / `audio_end_ms`: the start includes `prefix_padding_ms` (it points at the audio
the model would hear first), and the end is where the trailing silence was confirmed, so it
includes `silence_ms`.
"""

from __future__ import annotations

import enum
import importlib.util
import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

with warnings.catch_warnings():
    # audioop is deprecated on 3.11/3.12 and provided by `audioop-lts` from 3.13 on.
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

AudioEncoding = Literal["pcmu", "pcma", "pcm16"]
VadKind = Literal["auto", "energy", "webrtc"]

SAMPLE_RATES: dict[AudioEncoding, int] = {"pcmu": 8000, "pcma": 8000, "pcm16": 24000}
_BYTES_PER_SAMPLE: dict[AudioEncoding, int] = {"pcmu": 1, "pcma": 1, "pcm16": 2}


@dataclass(frozen=True, slots=True)
class VadConfig:
    """Tuning of the detector; the defaults match the Realtime API's `server_vad` defaults."""

    threshold_dbfs: float = -40.0
    activation_ms: int = 60
    silence_ms: int = 500
    prefix_padding_ms: int = 300
    frame_ms: int = 10
    # WebRTC VAD aggressiveness, 0 (calls most audio speech) to 3 (the strictest).
    webrtc_mode: int = 2


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    """Speech was confirmed; `audio_start_ms` includes the prefix padding."""

    audio_start_ms: int


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    """Trailing silence was confirmed at `audio_end_ms`; speech itself ended at `speech_end_ms`."""

    audio_end_ms: int
    speech_end_ms: int


VadEvent = SpeechStarted | SpeechStopped


class VadState(enum.Enum):
    SILENCE = "silence"
    PENDING = "pending"
    SPEECH = "speech"


def to_linear16(audio: bytes, encoding: AudioEncoding) -> bytes:
    """Decode G.711 (or pass through 16-bit PCM) to 16-bit little-endian linear samples."""
    if encoding == "pcmu":
        return audioop.ulaw2lin(audio, 2)
    if encoding == "pcma":
        return audioop.alaw2lin(audio, 2)
    return audio


def level_dbfs(linear16: bytes) -> float:
    """RMS level of 16-bit linear audio in dBFS (-inf for digital silence)."""
    if not linear16:
        return -math.inf
    rms = audioop.rms(linear16, 2)
    if rms == 0:
        return -math.inf
    return 20.0 * math.log10(rms / 32768.0)


def audio_ms(num_bytes: int, encoding: AudioEncoding) -> float:
    """Duration of `num_bytes` of audio in `encoding`, in milliseconds."""
    return num_bytes * 1000.0 / (SAMPLE_RATES[encoding] * _BYTES_PER_SAMPLE[encoding])


def webrtcvad_available() -> bool:
    return importlib.util.find_spec("webrtcvad") is not None


# WebRTC's detector takes 10, 20 or 30 ms frames at 8, 16, 32 or 48 kHz.
_WEBRTC_FRAME_MS = (10, 20, 30)
_WEBRTC_RATE: dict[AudioEncoding, int] = {"pcmu": 8000, "pcma": 8000, "pcm16": 16000}


def resolve_vad(kind: VadKind, frame_ms: int = 10) -> Literal["energy", "webrtc"]:
    """What `kind` runs as here: `auto` and `webrtc` need the module (else energy)."""
    if kind == "energy" or frame_ms not in _WEBRTC_FRAME_MS or not webrtcvad_available():
        return "energy"
    return "webrtc"


class EnergyVad:
    """Feed audio chunks of any size; get speech start/stop events with stream offsets.

    `kind` chooses the frame classifier: the level threshold alone (`energy`), or the threshold
    and WebRTC's detector (`webrtc`, and `auto` where the module is installed)."""

    def __init__(
        self,
        config: VadConfig | None = None,
        encoding: AudioEncoding = "pcmu",
        *,
        offset_ms: int = 0,
        kind: VadKind = "energy",
    ) -> None:
        """`offset_ms` is where this detector's stream starts (to keep counting across retunes)."""
        self.config = config or VadConfig()
        self.kind = resolve_vad(kind, self.config.frame_ms)
        self._webrtc: Any = None
        self._resample_state: Any = None
        if self.kind == "webrtc":
            import webrtcvad

            self._webrtc = webrtcvad.Vad(self.config.webrtc_mode)
        self._offset_ms = offset_ms
        self.encoding: AudioEncoding = encoding
        rate = SAMPLE_RATES[encoding]
        self._frame_bytes = rate * self.config.frame_ms // 1000 * _BYTES_PER_SAMPLE[encoding]
        self._linear_frame_bytes = rate * self.config.frame_ms // 1000 * 2
        self._pending_bytes = b""
        self._frames = 0  # whole frames analysed so far
        self.state = VadState.SILENCE
        self._run_frames = 0  # voiced frames in a row (PENDING) or unvoiced in a row (SPEECH)
        self._onset_frame = 0

    @property
    def position_ms(self) -> int:
        """Milliseconds of audio analysed so far (whole frames only), from the stream start."""
        return self._offset_ms + self._frames * self.config.frame_ms

    @property
    def in_speech(self) -> bool:
        return self.state is VadState.SPEECH

    def reset(self) -> None:
        """Forget any speech in progress (buffer cleared or committed); offsets keep counting."""
        self.state = VadState.SILENCE
        self._run_frames = 0

    def feed(self, audio: bytes) -> list[VadEvent]:
        """Analyse `audio` (in this detector's encoding) and return the events it completes."""
        data = self._pending_bytes + audio
        events: list[VadEvent] = []
        whole = len(data) - len(data) % self._frame_bytes
        linear = to_linear16(data[:whole], self.encoding)
        step = self._linear_frame_bytes
        for start in range(0, len(linear), step):
            frame = linear[start : start + step]
            event = self._step(self._voiced(frame))
            if event is not None:
                events.append(event)
        self._pending_bytes = data[whole:]
        return events

    def _voiced(self, frame: bytes) -> bool:
        if level_dbfs(frame) < self.config.threshold_dbfs:
            return False
        if self._webrtc is None:
            return True
        rate = SAMPLE_RATES[self.encoding]
        target = _WEBRTC_RATE[self.encoding]
        if rate != target:
            frame, self._resample_state = audioop.ratecv(
                frame, 2, 1, rate, target, self._resample_state
            )
            # ratecv may hand back a sample more or less than a whole frame: pad or cut.
            want = target * self.config.frame_ms // 1000 * 2
            frame = frame[:want].ljust(want, b"\x00")
        return bool(self._webrtc.is_speech(frame, target))

    def _step(self, voiced: bool) -> VadEvent | None:
        cfg = self.config
        frame_index = self._frames
        self._frames += 1
        if self.state is VadState.SILENCE:
            if voiced:
                self.state = VadState.PENDING
                self._onset_frame = frame_index
                self._run_frames = 1
                return self._maybe_start()
            return None
        if self.state is VadState.PENDING:
            if not voiced:
                self.reset()
                return None
            self._run_frames += 1
            return self._maybe_start()
        # SPEECH
        if voiced:
            self._run_frames = 0
            return None
        self._run_frames += 1
        if self._run_frames * cfg.frame_ms >= cfg.silence_ms:
            end_ms = self.position_ms
            self.reset()
            return SpeechStopped(audio_end_ms=end_ms, speech_end_ms=end_ms - cfg.silence_ms)
        return None

    def _maybe_start(self) -> VadEvent | None:
        cfg = self.config
        if self._run_frames * cfg.frame_ms < cfg.activation_ms:
            return None
        self.state = VadState.SPEECH
        self._run_frames = 0
        onset_ms = self._offset_ms + self._onset_frame * cfg.frame_ms
        return SpeechStarted(audio_start_ms=max(0, onset_ms - cfg.prefix_padding_ms))
