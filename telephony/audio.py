"""Pure audio helpers for telephony: G.711 codecs, framing, WAV, resampling, test audio.

Every function takes bytes and returns bytes (or numbers); nothing here does I/O or keeps
state between calls. 16-bit PCM is little-endian signed, as in WAV files and as the
Realtime API's `audio/pcm` expects. Resampler state is opaque and passed in and out.
"""

from __future__ import annotations

import io
import math
import struct
import sys
import warnings
import wave
from array import array
from dataclasses import dataclass
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


def to_codec(pcm: bytes, rate: int, codec: Codec) -> bytes:
    """Mono 16-bit PCM at `rate` as a call's audio: 8 kHz G.711 for `pcmu`/`pcma`, 24 kHz PCM
    (the Realtime API's rate) for `pcm16`."""
    target = REALTIME_PCM_RATE if codec == "pcm16" else TELEPHONY_RATE
    resampled, _ = resample_pcm16(pcm, rate, target)
    return encode(resampled, codec)


def trim_silence(pcm: bytes, rate: int, *, floor_dbfs: float = -50.0, keep_ms: int = 30) -> bytes:
    """Mono 16-bit PCM without its leading and trailing stretches below `floor_dbfs` (in
    10 ms frames), keeping `keep_ms` either side so the first and last sounds are whole."""
    _check_pcm16(pcm)
    frame = rate // 100 * 2
    floor = 32768 * 10 ** (floor_dbfs / 20)
    loud = [
        i
        for i in range(0, len(pcm) - frame + 1, frame)
        if audioop.rms(_native(pcm[i : i + frame]), 2) >= floor
    ]
    if not loud:
        return b""
    keep = rate * keep_ms // 1000 * 2
    return pcm[max(0, loud[0] - keep) : min(len(pcm), loud[-1] + frame + keep)]


# WAV.


# WAVE format tags (RIFF fmt chunk); EXTENSIBLE carries the real tag in its sub-format.
WAVE_FORMAT_PCM = 0x0001
WAVE_FORMAT_ALAW = 0x0006
WAVE_FORMAT_MULAW = 0x0007
WAVE_FORMAT_EXTENSIBLE = 0xFFFE
_WAVE_FORMATS = {WAVE_FORMAT_PCM: "PCM", WAVE_FORMAT_ALAW: "A-law", WAVE_FORMAT_MULAW: "mu-law"}


@dataclass(frozen=True, slots=True)
class WavAudio:
    """The samples of a WAV file and how they are encoded."""

    format_tag: int
    channels: int
    rate: int
    bits: int
    data: bytes

    @property
    def is_telephony_mulaw(self) -> bool:
        """8 kHz mono mu-law: what a phone call carries, byte for byte."""
        return (
            self.format_tag == WAVE_FORMAT_MULAW
            and self.channels == 1
            and self.rate == TELEPHONY_RATE
        )


def parse_wav(wav_bytes: bytes) -> WavAudio:
    """Read a RIFF/WAVE file's fmt and data chunks: 8/16/24/32-bit PCM, A-law or mu-law.

    The stdlib `wave` module reads PCM only; Twilio records calls as 8 kHz mu-law WAV.
    """
    if len(wav_bytes) < 12 or wav_bytes[:4] != b"RIFF" or wav_bytes[8:12] != b"WAVE":
        raise AudioFormatError("not a WAV file (no RIFF/WAVE header)")
    fmt: tuple[int, int, int, int] | None = None
    data: bytes | None = None
    pos = 12
    while pos + 8 <= len(wav_bytes) and (fmt is None or data is None):
        chunk_id = wav_bytes[pos : pos + 4]
        size = int.from_bytes(wav_bytes[pos + 4 : pos + 8], "little")
        body = wav_bytes[pos + 8 : pos + 8 + size]  # a streamed file may say more than it has
        if chunk_id == b"fmt ":
            if len(body) < 16:
                raise AudioFormatError("WAV fmt chunk too short")
            tag = int.from_bytes(body[0:2], "little")
            channels = int.from_bytes(body[2:4], "little")
            rate = int.from_bytes(body[4:8], "little")
            bits = int.from_bytes(body[14:16], "little")
            if tag == WAVE_FORMAT_EXTENSIBLE and len(body) >= 26:
                tag = int.from_bytes(body[24:26], "little")  # first bytes of the sub-format GUID
            fmt = (tag, channels, rate, bits)
        elif chunk_id == b"data":
            data = body
        pos += 8 + size + (size & 1)  # chunks are padded to an even length
    if fmt is None or data is None:
        raise AudioFormatError("not a readable WAV file: no fmt or data chunk")
    tag, channels, rate, bits = fmt
    if tag not in _WAVE_FORMATS:
        raise AudioFormatError(
            f"unsupported WAV encoding (format tag {tag}): use PCM, A-law or mu-law"
        )
    if channels not in (1, 2):
        raise AudioFormatError(f"only mono or stereo WAV is supported, got {channels} channels")
    if rate <= 0:
        raise AudioFormatError(f"WAV sample rate {rate} is not valid")
    width = bits // 8
    if tag == WAVE_FORMAT_PCM and (bits % 8 or width not in (1, 2, 3, 4)):
        raise AudioFormatError(f"only 8/16/24/32-bit PCM WAV is supported, got {bits}-bit")
    if tag != WAVE_FORMAT_PCM and bits != 8:
        raise AudioFormatError(f"{_WAVE_FORMATS[tag]} WAV must be 8-bit, got {bits}-bit")
    frame = width * channels
    return WavAudio(tag, channels, rate, bits, data[: len(data) - len(data) % frame])


def wav_to_pcm16(wav_bytes: bytes, rate: int = TELEPHONY_RATE) -> bytes:
    """Read a mono or stereo WAV (PCM, A-law or mu-law) at any rate; return mono 16-bit PCM
    at `rate`."""
    wav = parse_wav(wav_bytes)
    if wav.format_tag == WAVE_FORMAT_MULAW:
        pcm = audioop.ulaw2lin(wav.data, 2)
    elif wav.format_tag == WAVE_FORMAT_ALAW:
        pcm = audioop.alaw2lin(wav.data, 2)
    elif wav.bits == 16:
        pcm = _native(wav.data)
    elif wav.bits == 8:
        pcm = audioop.lin2lin(audioop.bias(wav.data, 1, -128), 1, 2)  # 8-bit WAV is unsigned
    else:
        pcm = audioop.lin2lin(wav.data, wav.bits // 8, 2)
    if wav.channels == 2:
        pcm = audioop.tomono(pcm, 2, 0.5, 0.5)
    if wav.rate != rate:
        pcm, _ = audioop.ratecv(pcm, 2, 1, wav.rate, rate, None)
    return _little(pcm)


def wav_header(pcm_bytes: int, rate: int = TELEPHONY_RATE, channels: int = 1) -> bytes:
    """The 44-byte header `pcm16_to_wav` writes before `pcm_bytes` of 16-bit PCM (RIFF, a
    `fmt ` chunk for PCM, the `data` chunk's size): for writing a WAV in pieces."""
    if pcm_bytes % (2 * channels):
        raise AudioFormatError(
            f"16-bit PCM of {channels} channel(s) comes in whole frames, not {pcm_bytes} bytes"
        )
    block = 2 * channels
    return struct.pack(
        "<4sI4s4sIHHIIHH4sI",
        b"RIFF",
        36 + pcm_bytes,
        b"WAVE",
        b"fmt ",
        16,
        1,  # PCM
        channels,
        rate,
        rate * block,
        block,
        16,
        b"data",
        pcm_bytes,
    )


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
    """Any WAV `wav_to_pcm16` reads to 8 kHz mono mu-law, ready to stream to a phone call
    (an 8 kHz mono mu-law WAV is passed through as it is)."""
    wav = parse_wav(wav_bytes)
    if wav.is_telephony_mulaw:
        return wav.data
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
