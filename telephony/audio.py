"""Pure audio helpers for telephony: G.711 codecs, framing, WAV, resampling, test audio.

Every function takes bytes and returns bytes (or numbers); nothing here does I/O or keeps
state between calls. 16-bit PCM is little-endian signed, as in WAV files and as the
Realtime API's `audio/pcm` expects. Resampler state is opaque and passed in and out.
"""

from __future__ import annotations

import io
import math
import sys
import warnings
import wave
from array import array
from typing import Any, Literal, TypeAlias

from telephony.errors import TelephonyError

with warnings.catch_warnings():
    # Deprecated in 3.11/3.12 and gone from 3.13's stdlib, where `audioop-lts` provides it.
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

Codec: TypeAlias = Literal["pcmu", "pcma", "pcm16"]
"""`pcmu` is G.711 mu-law, `pcma` is G.711 A-law, `pcm16` is 16-bit linear PCM."""

ResampleState: TypeAlias = Any
"""Opaque state of `audioop.ratecv`, carried from one chunk to the next (None to start)."""

TELEPHONY_RATE = 8000
REALTIME_PCM_RATE = 24000
FRAME_MS = 20
G711_FRAME_BYTES = TELEPHONY_RATE * FRAME_MS // 1000  # 160

# The byte that decodes to (near) zero amplitude in each codec.
MULAW_SILENCE = 0xFF
ALAW_SILENCE = 0xD5

_SAMPLE_WIDTH: dict[str, int] = {"pcmu": 1, "pcma": 1, "pcm16": 2}
_BIG_ENDIAN = sys.byteorder == "big"


class AudioFormatError(TelephonyError, ValueError):
    """Audio bytes that cannot be interpreted as asked (bad WAV, odd PCM length)."""


def _native(pcm_le: bytes) -> bytes:
    # audioop works in the machine's byte order; our PCM is little-endian on the wire.
    return audioop.byteswap(pcm_le, 2) if _BIG_ENDIAN else pcm_le


def _little(pcm_native: bytes) -> bytes:
    return audioop.byteswap(pcm_native, 2) if _BIG_ENDIAN else pcm_native


def _check_pcm16(pcm: bytes) -> None:
    if len(pcm) % 2:
        raise AudioFormatError(f"16-bit PCM must have an even length, got {len(pcm)} bytes")


# G.711 <-> PCM.


def mulaw_to_pcm16(mulaw: bytes) -> bytes:
    """Decode G.711 mu-law to 16-bit PCM (same sample rate)."""
    return _little(audioop.ulaw2lin(mulaw, 2))


def pcm16_to_mulaw(pcm: bytes) -> bytes:
    """Encode 16-bit PCM as G.711 mu-law (same sample rate)."""
    _check_pcm16(pcm)
    return audioop.lin2ulaw(_native(pcm), 2)


def alaw_to_pcm16(alaw: bytes) -> bytes:
    """Decode G.711 A-law to 16-bit PCM (same sample rate)."""
    return _little(audioop.alaw2lin(alaw, 2))


def pcm16_to_alaw(pcm: bytes) -> bytes:
    """Encode 16-bit PCM as G.711 A-law (same sample rate)."""
    _check_pcm16(pcm)
    return audioop.lin2alaw(_native(pcm), 2)


def mulaw_to_alaw(mulaw: bytes) -> bytes:
    """Transcode G.711 mu-law to A-law (through 16-bit PCM)."""
    return pcm16_to_alaw(mulaw_to_pcm16(mulaw))


def alaw_to_mulaw(alaw: bytes) -> bytes:
    """Transcode G.711 A-law to mu-law (through 16-bit PCM)."""
    return pcm16_to_mulaw(alaw_to_pcm16(alaw))


def decode(data: bytes, codec: Codec) -> bytes:
    """Any supported codec to 16-bit PCM."""
    if codec == "pcmu":
        return mulaw_to_pcm16(data)
    if codec == "pcma":
        return alaw_to_pcm16(data)
    _check_pcm16(data)
    return data


def encode(pcm: bytes, codec: Codec) -> bytes:
    """16-bit PCM to any supported codec."""
    if codec == "pcmu":
        return pcm16_to_mulaw(pcm)
    if codec == "pcma":
        return pcm16_to_alaw(pcm)
    _check_pcm16(pcm)
    return pcm


# Sizes, framing, silence.


def bytes_per_ms(codec: Codec, rate: int = TELEPHONY_RATE) -> float:
    """How many bytes one millisecond of mono audio takes."""
    return _SAMPLE_WIDTH[codec] * rate / 1000


def frame_bytes(codec: Codec = "pcmu", frame_ms: int = FRAME_MS, rate: int = TELEPHONY_RATE) -> int:
    """Bytes in one frame of `frame_ms` (160 for a 20 ms G.711 frame at 8 kHz)."""
    return _SAMPLE_WIDTH[codec] * rate * frame_ms // 1000


def duration_ms(num_bytes: int, codec: Codec = "pcmu", rate: int = TELEPHONY_RATE) -> float:
    """Playing time of `num_bytes` of mono audio in `codec` at `rate`."""
    return num_bytes * 1000 / (_SAMPLE_WIDTH[codec] * rate)


def base64_size(payload: str) -> int:
    """Bytes encoded by canonical base64 text, without decoding it."""
    size = len(payload) // 4 * 3
    if payload.endswith("=="):
        return size - 2
    if payload.endswith("="):
        return size - 1
    return size


def silence_byte(codec: Codec) -> int:
    """The byte value that encodes silence (for PCM16, both bytes of a zero sample)."""
    return {"pcmu": MULAW_SILENCE, "pcma": ALAW_SILENCE, "pcm16": 0}[codec]


def silence(ms: float, codec: Codec = "pcmu", rate: int = TELEPHONY_RATE) -> bytes:
    """`ms` milliseconds of digital silence (rounded down to whole samples)."""
    samples = int(rate * ms / 1000)
    return bytes([silence_byte(codec)]) * (samples * _SAMPLE_WIDTH[codec])


def split_frames(
    data: bytes,
    codec: Codec = "pcmu",
    *,
    frame_ms: int = FRAME_MS,
    rate: int = TELEPHONY_RATE,
    pad: bool = False,
) -> list[bytes]:
    """Cut audio into frames of `frame_ms`; a short last frame is kept, or padded with
    silence to full length when `pad` is set."""
    size = frame_bytes(codec, frame_ms, rate)
    frames = [data[i : i + size] for i in range(0, len(data), size)]
    if pad and frames and len(frames[-1]) < size:
        frames[-1] = frames[-1] + bytes([silence_byte(codec)]) * (size - len(frames[-1]))
    return frames


# Level.


def rms(data: bytes, codec: Codec = "pcmu") -> int:
    """Root-mean-square amplitude (0..32767) of the audio, decoded to 16-bit PCM."""
    pcm = decode(data, codec)
    if not pcm:
        return 0
    return int(audioop.rms(_native(pcm), 2))


def dbfs(data: bytes, codec: Codec = "pcmu") -> float:
    """Level in dB relative to full scale; -inf for digital silence."""
    level = rms(data, codec)
    if level == 0:
        return -math.inf
    return 20 * math.log10(level / 32768)


# Resampling.


def resample_pcm16(
    pcm: bytes, from_rate: int, to_rate: int, state: ResampleState = None
) -> tuple[bytes, ResampleState]:
    """Resample mono 16-bit PCM; pass the returned state with the next chunk of the same
    stream so chunk boundaries are seamless."""
    _check_pcm16(pcm)
    if from_rate == to_rate:
        return pcm, state
    out, new_state = audioop.ratecv(_native(pcm), 2, 1, from_rate, to_rate, state)
    return _little(out), new_state


def resample_8k_to_24k(pcm: bytes, state: ResampleState = None) -> tuple[bytes, ResampleState]:
    """8 kHz telephone PCM to the Realtime API's 24 kHz PCM, with carried state."""
    return resample_pcm16(pcm, TELEPHONY_RATE, REALTIME_PCM_RATE, state)


def resample_24k_to_8k(pcm: bytes, state: ResampleState = None) -> tuple[bytes, ResampleState]:
    """The Realtime API's 24 kHz PCM to 8 kHz telephone PCM, with carried state."""
    return resample_pcm16(pcm, REALTIME_PCM_RATE, TELEPHONY_RATE, state)


# WAV.


def wav_to_pcm16(wav_bytes: bytes, rate: int = TELEPHONY_RATE) -> bytes:
    """Read a 16-bit mono or stereo WAV at any rate; return mono 16-bit PCM at `rate`."""
    try:
        with wave.open(io.BytesIO(wav_bytes), "rb") as reader:
            channels = reader.getnchannels()
            width = reader.getsampwidth()
            source_rate = reader.getframerate()
            frames = reader.readframes(reader.getnframes())
    except (wave.Error, EOFError) as exc:
        raise AudioFormatError(f"not a readable WAV file: {exc}") from exc
    if width != 2:
        raise AudioFormatError(f"only 16-bit WAV is supported, got {8 * width}-bit")
    if channels not in (1, 2):
        raise AudioFormatError(f"only mono or stereo WAV is supported, got {channels} channels")
    pcm = _native(frames)
    if channels == 2:
        pcm = audioop.tomono(pcm, 2, 0.5, 0.5)
    if source_rate != rate:
        pcm, _ = audioop.ratecv(pcm, 2, 1, source_rate, rate, None)
    return _little(pcm)


def pcm16_to_wav(pcm: bytes, rate: int = TELEPHONY_RATE, channels: int = 1) -> bytes:
    """Wrap 16-bit PCM in a WAV container."""
    _check_pcm16(pcm)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(channels)
        writer.setsampwidth(2)
        writer.setframerate(rate)
        writer.writeframes(pcm)
    return buffer.getvalue()


def wav_to_mulaw(wav_bytes: bytes) -> bytes:
    """Any 16-bit WAV to 8 kHz mono mu-law, ready to stream to a phone call."""
    return pcm16_to_mulaw(wav_to_pcm16(wav_bytes, TELEPHONY_RATE))


def mulaw_to_wav(mulaw: bytes) -> bytes:
    """8 kHz mu-law to a 16-bit 8 kHz mono WAV (for listening to what a caller heard)."""
    return pcm16_to_wav(mulaw_to_pcm16(mulaw), TELEPHONY_RATE)


# Synthesized test audio.


def tone_pcm16(
    freq_hz: float, ms: float, *, amplitude: float = 0.5, rate: int = TELEPHONY_RATE
) -> bytes:
    """A pure sine tone; `amplitude` is a fraction of full scale."""
    n = int(rate * ms / 1000)
    peak = amplitude * 32767
    samples = array("h", (int(peak * math.sin(2 * math.pi * freq_hz * i / rate)) for i in range(n)))
    return _little(samples.tobytes())


def speech_like_pcm16(
    ms: float,
    *,
    pitch_hz: float = 140.0,
    syllables_per_s: float = 4.0,
    amplitude: float = 0.5,
    rate: int = TELEPHONY_RATE,
) -> bytes:
    """Deterministic audio with a voice's rough shape: a harmonic-rich fundamental with
    formant-like weighting, amplitude-modulated at syllable rate, never fully silent
    for more than a few ms, so energy-based voice detection treats it as speech."""
    n = int(rate * ms / 1000)
    # Harmonic weights peak near 500 Hz and 1500 Hz, like the first two formants.
    harmonics = []
    k = 1
    while k * pitch_hz < rate / 2 - 200 and k <= 16:
        f = k * pitch_hz
        weight = math.exp(-(((f - 500) / 300) ** 2)) + 0.6 * math.exp(-(((f - 1500) / 400) ** 2))
        harmonics.append((2 * math.pi * f / rate, weight + 0.05))
        k += 1
    norm = sum(w for _, w in harmonics)
    peak = amplitude * 32767 / norm
    out = array("h", bytes(2 * n))
    for i in range(n):
        t = i / rate
        # Syllable envelope between 0.25 and 1.0, so the signal stays voiced throughout.
        envelope = 0.625 + 0.375 * math.sin(2 * math.pi * syllables_per_s * t)
        value = sum(w * math.sin(omega * i) for omega, w in harmonics)
        out[i] = max(-32768, min(32767, int(peak * envelope * value)))
    return _little(out.tobytes())


def speech_like_mulaw(ms: float, **kwargs: Any) -> bytes:
    """`speech_like_pcm16` at 8 kHz, encoded as mu-law."""
    return pcm16_to_mulaw(speech_like_pcm16(ms, **kwargs))


def speech_like_alaw(ms: float, **kwargs: Any) -> bytes:
    """`speech_like_pcm16` at 8 kHz, encoded as A-law."""
    return pcm16_to_alaw(speech_like_pcm16(ms, **kwargs))
