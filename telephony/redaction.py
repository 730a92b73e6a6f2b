"""Digits in free text that may be a PIN or a phone number: the patterns, and the masking a
caller's transcript gets before it is stored (a caller may speak their PIN aloud).

A PIN the caller types is never recorded (the bridge records "PIN entered (4 digits)"); one
the caller speaks reaches the tool's arguments, which a tool declaring `redact_arguments`
never stores, and the caller's transcript, which is stored with PIN-like digit runs masked.
Phone numbers in the transcript are kept: operators may see them, and the console masks them
for viewers.
"""

from __future__ import annotations

import re

MASK = "•"

# E.164 numbers (+ and 7-15 digits, maybe spaced or dashed) and bare runs of 10-15 digits.
PHONE_IN_TEXT = re.compile(r"\+\d[\d\-\s().]{5,17}\d|(?<![\w-])\d{10,15}(?![\w-])")
# Four or more digits, maybe spaced ("4321", "4 3 2 1"), not part of a date, time, id or number;
# a full stop may end the sentence after them ("my PIN is 4321."), not continue a number.
PIN_IN_TEXT = re.compile(r"(?<![\w\-:/.+])\d(?:[ ,]?\d){3,}(?![\w\-:/]|\.\w)")
_DIGIT = re.compile(r"\d")


def _mask_pins(text: str) -> str:
    return PIN_IN_TEXT.sub(lambda m: _DIGIT.sub(MASK, m.group(0)), text)


def mask_spoken_pins(text: str) -> str:
    """`text` with every PIN-like digit run masked, phone numbers left as they are."""
    if _DIGIT.search(text) is None:
        return text
    out: list[str] = []
    last = 0
    for phone in PHONE_IN_TEXT.finditer(text):
        out.append(_mask_pins(text[last : phone.start()]))
        out.append(phone.group(0))
        last = phone.end()
    out.append(_mask_pins(text[last:]))
    return "".join(out)
