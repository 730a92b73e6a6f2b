"""Pure audio helpers: codecs, framing, WAV, resampling, levels, test audio."""

from __future__ import annotations

import io
import math
import wave

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from telephony import audio

pcm16_bytes = st.lists(st.integers(-32768, 32767), max_size=400).map(
    lambda xs: b"".join(x.to_bytes(2, "little", signed=True) for x in xs)
)


def _samples(pcm: bytes) -> list[int]:
    return [int.from_bytes(pcm[i : i + 2], "little", signed=True) for i in range(0, len(pcm), 2)]


@given(st.binary(max_size=500))
def test_mulaw_decode_then_encode_returns_the_same_bytes(data: bytes) -> None:
    # 0x7F and 0xFF both decode to zero; encoding picks 0xFF, so compare decoded values.
    assert audio.mulaw_to_pcm16(audio.pcm16_to_mulaw(audio.mulaw_to_pcm16(data))) == (
        audio.mulaw_to_pcm16(data)
    )


@given(st.binary(max_size=500))
def test_alaw_decode_then_encode_returns_the_same_bytes(data: bytes) -> None:
    assert audio.pcm16_to_alaw(audio.alaw_to_pcm16(data)) == data


@given(pcm16_bytes)
def test_mulaw_round_trip_error_is_bounded_by_quantization(pcm: bytes) -> None:
    back = audio.mulaw_to_pcm16(audio.pcm16_to_mulaw(pcm))
    assert len(back) == len(pcm)
    for original, decoded in zip(_samples(pcm), _samples(back), strict=True):
        # mu-law steps grow with amplitude: about 1/16 of the magnitude, at least 8.
        assert abs(original - decoded) <= max(abs(original) // 16, 8) + 132


@given(pcm16_bytes)
def test_alaw_round_trip_error_is_bounded_by_quantization(pcm: bytes) -> None:
    back = audio.alaw_to_pcm16(audio.pcm16_to_alaw(pcm))
    for original, decoded in zip(_samples(pcm), _samples(back), strict=True):
        assert abs(original - decoded) <= max(abs(original) // 16, 16)


@given(st.binary(max_size=400))
def test_mulaw_alaw_transcoding_keeps_length(data: bytes) -> None:
    assert len(audio.mulaw_to_alaw(data)) == len(data)
    assert len(audio.alaw_to_mulaw(data)) == len(data)


def test_pcm_of_odd_length_is_refused() -> None:
    with pytest.raises(audio.AudioFormatError):
        audio.pcm16_to_mulaw(b"\x00\x01\x02")


@given(st.binary(max_size=2000), st.booleans())
def test_split_frames_reassembles_to_the_input(data: bytes, pad: bool) -> None:
    frames = audio.split_frames(data, "pcmu", pad=pad)
    joined = b"".join(frames)
    assert joined[: len(data)] == data
    assert all(len(f) == 160 for f in frames[:-1])
    if pad and frames:
        assert len(frames[-1]) == 160
        assert set(joined[len(data) :]) <= {audio.MULAW_SILENCE}
    else:
        assert joined == data


def test_split_frames_cuts_20ms_frames_of_160_bytes() -> None:
    frames = audio.split_frames(bytes(400))
    assert [len(f) for f in frames] == [160, 160, 80]
    padded = audio.split_frames(bytes(400), pad=True)
    assert [len(f) for f in padded] == [160, 160, 160]
    assert padded[-1][80:] == bytes([0xFF]) * 80


def test_durations_and_frame_sizes_per_codec() -> None:
    assert audio.frame_bytes("pcmu") == 160
    assert audio.frame_bytes("pcma") == 160
    assert audio.frame_bytes("pcm16") == 320
    assert audio.frame_bytes("pcm16", rate=24000) == 960
    assert audio.duration_ms(160, "pcmu") == 20
    assert audio.duration_ms(8000, "pcma") == 1000
    assert audio.duration_ms(320, "pcm16") == 20
    assert audio.duration_ms(48000, "pcm16", rate=24000) == 1000


def test_silence_decodes_to_zero_level_in_every_codec() -> None:
    for codec in ("pcmu", "pcma", "pcm16"):
        s = audio.silence(100, codec)
        assert audio.duration_ms(len(s), codec) == 100
        assert audio.rms(s, codec) <= 8


def test_speech_like_audio_is_deterministic_loud_and_of_the_asked_length() -> None:
    a = audio.speech_like_pcm16(500)
    assert a == audio.speech_like_pcm16(500)
    assert audio.duration_ms(len(a), "pcm16") == 500
    assert audio.rms(a, "pcm16") > 2000
    mulaw = audio.speech_like_mulaw(500)
    assert len(mulaw) == 4000
    # Every 20 ms frame carries energy: no gap a voice detector would read as silence.
    assert min(audio.rms(f) for f in audio.split_frames(mulaw)) > 500
    assert audio.speech_like_alaw(40) == audio.pcm16_to_alaw(audio.speech_like_pcm16(40))


def test_rms_and_dbfs_track_amplitude() -> None:
    loud = audio.tone_pcm16(440, 100, amplitude=0.5)
    quiet = audio.tone_pcm16(440, 100, amplitude=0.05)
    assert audio.rms(loud, "pcm16") > 5 * audio.rms(quiet, "pcm16")
    # A sine at half scale has an RMS of about -9 dBFS.
    assert audio.dbfs(loud, "pcm16") == pytest.approx(-9.0, abs=0.5)
    assert audio.dbfs(audio.silence(20, "pcm16"), "pcm16") == -math.inf
    assert audio.rms(b"", "pcmu") == 0


def _wav(pcm: bytes, rate: int, channels: int, width: int = 2) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(channels)
        w.setsampwidth(width)
        w.setframerate(rate)
        w.writeframes(pcm)
    return buf.getvalue()


@given(pcm16_bytes)
def test_wav_write_then_read_at_8k_mono_is_lossless(pcm: bytes) -> None:
    assert audio.wav_to_pcm16(audio.pcm16_to_wav(pcm)) == pcm


def test_stereo_16k_wav_becomes_8k_mono_of_the_same_duration() -> None:
    mono16k = audio.tone_pcm16(300, 1000, rate=16000)
    samples = _samples(mono16k)
    stereo = b"".join(
        s.to_bytes(2, "little", signed=True) + s.to_bytes(2, "little", signed=True) for s in samples
    )
    pcm = audio.wav_to_pcm16(_wav(stereo, 16000, 2))
    assert abs(audio.duration_ms(len(pcm), "pcm16") - 1000) <= 1
    # Averaging two identical channels keeps the level.
    assert audio.rms(pcm, "pcm16") == pytest.approx(audio.rms(mono16k, "pcm16"), rel=0.05)


def riff_wav(
    tag: int, channels: int, rate: int, bits: int, data: bytes, extra: bytes = b""
) -> bytes:
    """A WAV file with any format tag (the stdlib writes PCM only), an odd chunk before
    `data` included, as recorders write them."""
    block = channels * max(1, bits // 8)
    fmt = (
        tag.to_bytes(2, "little")
        + channels.to_bytes(2, "little")
        + rate.to_bytes(4, "little")
        + (rate * block).to_bytes(4, "little")
        + block.to_bytes(2, "little")
        + bits.to_bytes(2, "little")
        + extra
    )
    chunks = b"fmt " + len(fmt).to_bytes(4, "little") + fmt
    chunks += b"LIST" + (3).to_bytes(4, "little") + b"abc\x00"  # padded to even
    chunks += b"data" + len(data).to_bytes(4, "little") + data
    return b"RIFF" + (4 + len(chunks)).to_bytes(4, "little") + b"WAVE" + chunks


def test_wav_that_is_not_a_wav_or_in_an_unknown_encoding_is_refused() -> None:
    with pytest.raises(audio.AudioFormatError, match="not a WAV file"):
        audio.wav_to_pcm16(b"RIFF but not really")
    with pytest.raises(audio.AudioFormatError, match="not a WAV file"):
        audio.wav_to_pcm16(b"hello, I am a text file, not audio at all")
    with pytest.raises(audio.AudioFormatError, match="format tag 3"):
        audio.wav_to_pcm16(riff_wav(3, 1, 8000, 32, bytes(400)))  # IEEE float
    with pytest.raises(audio.AudioFormatError, match="no fmt or data"):
        audio.wav_to_pcm16(b"RIFF\x04\x00\x00\x00WAVE")


def test_telephony_mulaw_wav_passes_through_byte_for_byte() -> None:
    mulaw = audio.speech_like_mulaw(300)
    assert audio.wav_to_mulaw(riff_wav(audio.WAVE_FORMAT_MULAW, 1, 8000, 8, mulaw)) == mulaw


def test_mulaw_and_alaw_wav_at_other_rates_are_decoded_and_resampled() -> None:
    pcm = audio.tone_pcm16(400, 500, rate=16000)
    mulaw_16k = audio.pcm16_to_mulaw(pcm)
    out = audio.wav_to_pcm16(riff_wav(audio.WAVE_FORMAT_MULAW, 1, 16000, 8, mulaw_16k))
    assert abs(audio.duration_ms(len(out), "pcm16") - 500) <= 1
    alaw = audio.pcm16_to_alaw(audio.tone_pcm16(400, 500))
    out = audio.wav_to_pcm16(riff_wav(audio.WAVE_FORMAT_ALAW, 1, 8000, 8, alaw))
    assert out == audio.alaw_to_pcm16(alaw)


def test_8_bit_and_extensible_pcm_wav_are_read() -> None:
    pcm = audio.tone_pcm16(400, 200)
    unsigned = bytes((s >> 8) + 128 for s in _samples(pcm))
    out = _samples(audio.wav_to_pcm16(_wav(unsigned, 8000, 1, width=1)))
    assert max(abs(a - b) for a, b in zip(out, _samples(pcm), strict=True)) < 256
    # WAVE_FORMAT_EXTENSIBLE: the real format is the start of the sub-format GUID.
    extra = (22).to_bytes(2, "little") + (16).to_bytes(2, "little") + bytes(4)
    extra += audio.WAVE_FORMAT_PCM.to_bytes(2, "little") + bytes(14)
    wav = riff_wav(audio.WAVE_FORMAT_EXTENSIBLE, 1, 8000, 16, pcm, extra)
    assert audio.wav_to_pcm16(wav) == pcm


def test_mulaw_wav_helpers_round_trip() -> None:
    mulaw = audio.speech_like_mulaw(200)
    assert audio.wav_to_mulaw(audio.mulaw_to_wav(mulaw)) == mulaw


def test_resampling_8k_to_24k_and_back_keeps_duration_and_level() -> None:
    tone = audio.tone_pcm16(400, 1000)
    up, _ = audio.resample_8k_to_24k(tone)
    assert abs(audio.duration_ms(len(up), "pcm16", rate=24000) - 1000) <= 1
    down, _ = audio.resample_24k_to_8k(up)
    assert abs(audio.duration_ms(len(down), "pcm16") - 1000) <= 1
    assert audio.rms(down, "pcm16") == pytest.approx(audio.rms(tone, "pcm16"), rel=0.05)


@settings(max_examples=30)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=10))
def test_chunked_resampling_with_carried_state_equals_one_shot(chunk_frames: list[int]) -> None:
    tone = audio.speech_like_pcm16(sum(chunk_frames) * 20)
    whole, _ = audio.resample_8k_to_24k(tone)
    pieces = []
    state = None
    offset = 0
    for n in chunk_frames:
        chunk = tone[offset : offset + n * 320]
        offset += n * 320
        out, state = audio.resample_8k_to_24k(chunk, state)
        pieces.append(out)
    assert b"".join(pieces) == whole


def test_resampling_at_the_same_rate_is_identity() -> None:
    tone = audio.tone_pcm16(400, 20)
    assert audio.resample_pcm16(tone, 8000, 8000) == (tone, None)
