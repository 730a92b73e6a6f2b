"""Speech recognition for the simulator, offline: the caller's audio to one of the phrases the
scenario expects (PocketSphinx with the English model its wheel ships; nothing is downloaded).

Free recognition of telephone audio with that small model is poor, so the decoder is
constrained to the scenario: a JSGF grammar whose alternatives are the expected phrases (their
words in the model's dictionary). When the audio does not reach a phrase's end the decoder
gives the words it got to, and those are matched to the closest expected phrase; noise gives
no words. A hypothesis too far from every phrase is reported as heard, with no phrase: the
scripted model then asks again, as a real one would.

Decoding is CPU-bound (a few hundred ms per utterance on a laptop): call `recognize` from a
thread. One decoder is not reentrant, so calls are serialised by a lock.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
import threading
from dataclasses import dataclass

from telephony import audio

DECODER_RATE = 16000  # the bundled en-us model's rate
# A hypothesis matches a phrase when this share of their words line up (difflib's ratio);
# measured on 12 lines in three scenarios spoken by the caller's eSpeak NG voice through
# G.711: every line matched its own phrase (ratio 0.5-1.0); tones and noise decode to nothing.
MATCH_RATIO = 0.4
# Longer turns are cut to their first this-many seconds (decoding time grows with length).
MAX_UTTERANCE_S = 20

_WORD = re.compile(r"[a-z]+(?:'[a-z]+)?")


def pocketsphinx_available() -> bool:
    return importlib.util.find_spec("pocketsphinx") is not None


def words_of(text: str) -> list[str]:
    """Lower-case words of `text`, punctuation dropped (how phrases are compared)."""
    return _WORD.findall(text.lower())


def closest_phrase(heard: str, phrases: list[str]) -> tuple[str | None, float]:
    """The expected phrase closest to `heard` (None below MATCH_RATIO), and its ratio."""
    heard_words = words_of(heard)
    best: str | None = None
    best_ratio = 0.0
    for phrase in phrases:
        ratio = difflib.SequenceMatcher(None, words_of(phrase), heard_words).ratio()
        if ratio > best_ratio:
            best, best_ratio = phrase, ratio
    return (best, best_ratio) if best_ratio >= MATCH_RATIO else (None, best_ratio)


@dataclass(frozen=True, slots=True)
class Recognition:
    """What the recogniser heard: its words, and the expected phrase they match (if any)."""

    heard: str
    phrase: str | None
    ratio: float


class PhraseRecognizer:
    """PocketSphinx constrained to a fixed list of expected phrases."""

    def __init__(self, phrases: list[str]) -> None:
        from pocketsphinx import Decoder

        self.phrases = [p for p in dict.fromkeys(phrases) if words_of(p)]
        self._lock = threading.Lock()
        # Its own log goes to stderr at INFO by default: only errors are worth a line.
        # (A phrase that ends early is expected: only fatal errors are worth a line on stderr.)
        self._decoder = Decoder(samprate=DECODER_RATE, loglevel="FATAL")
        vocabulary = {w for p in self.phrases for w in words_of(p)}
        self.unknown_words = sorted(w for w in vocabulary if self._decoder.lookup_word(w) is None)
        alternatives = [
            " ".join(w for w in words_of(p) if w not in self.unknown_words) for p in self.phrases
        ]
        alternatives = [a for a in dict.fromkeys(alternatives) if a]
        self._searchable = bool(alternatives)
        if self._searchable:
            grammar = (
                "#JSGF V1.0;\ngrammar expected;\n"
                f"public <utterance> = {' | '.join(alternatives)};\n"
            )
            self._decoder.add_jsgf_string("expected", grammar)
            self._decoder.activate_search("expected")

    def recognize(self, speech: bytes, codec: audio.Codec) -> Recognition:
        """Decode one utterance (`codec` audio: 8 kHz G.711 or 24 kHz PCM); blocking."""
        if not speech or not self._searchable:
            return Recognition("", None, 0.0)
        pcm = audio.decode(speech, codec)
        rate = audio.REALTIME_PCM_RATE if codec == "pcm16" else audio.TELEPHONY_RATE
        pcm = pcm[: rate * 2 * MAX_UTTERANCE_S]
        pcm16k, _ = audio.resample_pcm16(pcm, rate, DECODER_RATE)
        with self._lock:
            self._decoder.start_utt()
            self._decoder.process_raw(pcm16k, full_utt=True)
            self._decoder.end_utt()
            hyp = self._decoder.hyp()
        heard = hyp.hypstr if hyp is not None else ""
        phrase, ratio = closest_phrase(heard, self.phrases)
        return Recognition(heard, phrase, ratio)
