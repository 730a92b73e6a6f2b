"""What each role may see: phone numbers masked for viewers, PINs and secrets for everyone.

`Masker.scrub` rewrites any JSON-able value the console or its API is about to show:
- for every role: keypad digits (a PIN may be typed on the keypad), values under keys that
  name a PIN, password, secret or token, and arguments of function calls the ledger stores
  redacted;
- for viewers, also: phone numbers (whole values under phone-ish keys, and phone-like runs
  inside any text) and PIN-like digit runs inside text ("my PIN is 4 3 2 1").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from telephony.redaction import MASK
from telephony.redaction import PHONE_IN_TEXT as _PHONE_IN_TEXT
from telephony.redaction import PIN_IN_TEXT as _PIN_IN_TEXT

REDACTED = "[redacted]"
_PHONE_KEYS = frozenset(
    {"from", "to", "caller", "from_number", "to_number", "phone", "phones", "number", "callee"}
)
_SECRET_KEY = re.compile(
    r"(?i)(?:^|_)(?:pins?|password|passwd|secret|token|api_key|auth_token|otp)(?:_|$)"
)
# Keys whose values are ids or statuses, never free text worth scanning.
_PLAIN_KEYS = frozenset(
    {
        "operation_id",
        "call_id",
        "id",
        "item_id",
        "response_id",
        "stream_sid",
        "call_sid",
        "provider_call_id",
        "idempotency_key",
        "at",
        "created_at",
        "updated_at",
        "status",
        "kind",
        "tool",
        "reference",
        "provider_ref",
    }
)


def mask_phone(value: str) -> str:
    """`+15551230000` -> `+•••••••••00`: the shape stays, the last two digits stay."""
    digits = sum(c.isdigit() for c in value)
    if digits < 5:
        return value  # "anonymous", short codes: nothing to hide
    keep = 2
    out = []
    seen = 0
    for c in value:
        if c.isdigit():
            seen += 1
            out.append(c if seen > digits - keep else MASK)
        else:
            out.append(c)
    return "".join(out)


_DIGIT = re.compile(r"\d")


@lru_cache(maxsize=4096)
def _is_secret_key(key: str) -> bool:
    return _SECRET_KEY.search(key) is not None


def mask_text(text: str) -> str:
    """Phone numbers and PIN-like digit runs inside free text."""
    if _DIGIT.search(text) is None:
        return text  # most text: nothing to mask, and no regex substitution to pay for
    text = _PHONE_IN_TEXT.sub(lambda m: mask_phone(m.group(0)), text)
    return _PIN_IN_TEXT.sub(lambda m: re.sub(r"\d", MASK, m.group(0)), text)


@dataclass(frozen=True, slots=True)
class Masker:
    """The view of one role."""

    sees_phone_numbers: bool

    def phone(self, value: str | None) -> str | None:
        if value is None or self.sees_phone_numbers:
            return value
        return mask_phone(value)

    def scrub(self, value: Any, key: str | None = None) -> Any:
        """A copy of `value` fit for this role."""
        if isinstance(value, Mapping):
            return self._scrub_mapping(value)
        if isinstance(value, list):
            return [self.scrub(v, key) for v in value]
        if isinstance(value, str):
            return self._scrub_str(value, key)
        return value

    def _scrub_mapping(self, value: Mapping[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        redact_args = bool(value.get("redacted_arguments"))
        for k, v in value.items():
            if isinstance(k, str) and _is_secret_key(k) and not isinstance(v, bool):
                out[k] = REDACTED if v not in (None, "") else v
            elif k in ("arguments", "raw_arguments") and redact_args:
                out[k] = {"redacted": True}
            else:
                out[k] = self.scrub(v, k if isinstance(k, str) else None)
        if out.get("kind") == "dtmf" and isinstance(out.get("data"), dict):
            # A PIN may be typed on the keypad: nobody sees the digits.
            out["data"] = {**out["data"], "digit": MASK}
        return out

    def _scrub_str(self, value: str, key: str | None) -> str:
        if self.sees_phone_numbers or key in _PLAIN_KEYS:
            return value
        if key in _PHONE_KEYS:
            return mask_phone(value)
        return mask_text(value)


FULL = Masker(sees_phone_numbers=True)
VIEWER = Masker(sees_phone_numbers=False)


def masker_for(sees_phone_numbers: bool) -> Masker:
    return FULL if sees_phone_numbers else VIEWER
