"""Who is calling: caller ID known to an account, and a PIN by keypad or spoken digits.

Verification state lives per call (in the process that holds the call) and is dropped
when the call ends; failures and lockouts across calls are durable (`tools.verification`).
The policy engine sees a frozen `CallerIdentity` snapshot.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

# What carriers and Twilio put in From when the number is withheld.
_WITHHELD = {"", "anonymous", "restricted", "unknown", "private", "unavailable", "+266696687"}

_DIGIT_WORDS = {
    "zero": "0",
    "oh": "0",
    "o": "0",
    "one": "1",
    "two": "2",
    "three": "3",
    "four": "4",
    "five": "5",
    "six": "6",
    "seven": "7",
    "eight": "8",
    "nine": "9",
}


def is_withheld(phone: str | None) -> bool:
    """True when the caller's number is absent or withheld."""
    return phone is None or phone.strip().lower() in _WITHHELD


def spoken_digits(text: str) -> str:
    """Digits from what the caller said: "1 2 3 4", "one two three four", "12-34"."""
    out = []
    for token in re.findall(r"[a-z]+|\d", text.lower()):
        if token.isdigit():
            out.append(token)
        elif token in _DIGIT_WORDS:
            out.append(_DIGIT_WORDS[token])
    return "".join(out)


@dataclass(frozen=True, slots=True)
class Account:
    """A customer account of a tenant, with the phone numbers it is known by."""

    account_id: str
    tenant_id: str
    phones: frozenset[str]
    pin: str | None = None
    name: str | None = None
    role: str = "customer"


class IdentityStore(Protocol):
    """Looks up the account a phone number belongs to."""

    async def lookup(self, tenant_id: str, phone: str | None) -> Account | None: ...


class StaticIdentityStore:
    """Accounts held in memory (demo, tests, small deployments configured from a file)."""

    def __init__(self, accounts: Iterable[Account] = ()) -> None:
        self._by_phone: dict[tuple[str, str], Account] = {}
        for acc in accounts:
            for phone in acc.phones:
                self._by_phone[(acc.tenant_id, phone)] = acc

    async def lookup(self, tenant_id: str, phone: str | None) -> Account | None:
        if is_withheld(phone):
            return None
        assert phone is not None
        return self._by_phone.get((tenant_id, phone))


@dataclass(frozen=True, slots=True)
class CallerIdentity:
    """What the policy engine knows about the caller at one moment."""

    phone: str | None
    account_id: str | None = None
    role: str | None = None
    verified: bool = False  # PIN entered correctly in this call
    locked: bool = False  # too many wrong PINs in this call
    failed_attempts: int = 0

    @property
    def known(self) -> bool:
        return self.account_id is not None

    @property
    def withheld(self) -> bool:
        return is_withheld(self.phone)


class PinOutcome(StrEnum):
    """What one PIN entry achieved."""

    VERIFIED = "verified"
    WRONG = "wrong"
    LOCKED = "locked"
    INCOMPLETE = "incomplete"  # keypad digits still coming
    NO_ACCOUNT = "no_account"  # nothing to verify against


class CallerVerification:
    """PIN state of one call. Keypad: digits accumulate; `#` submits, `*` starts over, and
    a full-length PIN submits by itself."""

    def __init__(self, phone: str | None, account: Account | None, *, max_attempts: int = 3):
        self.phone = phone
        self.account = account
        self.max_attempts = max_attempts
        self.verified = False
        self.failed_attempts = 0
        self._buffer = ""

    @property
    def locked(self) -> bool:
        return self.failed_attempts >= self.max_attempts

    @property
    def attempts_left(self) -> int:
        return max(0, self.max_attempts - self.failed_attempts)

    def collecting(self) -> bool:
        """Whether keypad digits are PIN entry now (an account with a PIN, not yet verified)."""
        return self.account is not None and bool(self.account.pin) and not self.verified

    def feed_keypad(self, digit: str) -> str | None:
        """Take one keypad digit; the complete entry once there is one (not yet checked)."""
        if digit == "*":
            self._buffer = ""
            return None
        if digit == "#":
            entered, self._buffer = self._buffer, ""
            return entered
        if not digit.isdigit():
            return None
        self._buffer += digit
        pin = self.account.pin if self.account else None
        if pin is not None and len(self._buffer) >= len(pin):
            entered, self._buffer = self._buffer, ""
            return entered
        return None

    def lock(self) -> None:
        """Locked from outside this call (durable lockout of the account or number)."""
        self.failed_attempts = max(self.failed_attempts, self.max_attempts)

    def feed_dtmf(self, digit: str) -> PinOutcome:
        if digit == "*":
            self._buffer = ""
            return PinOutcome.INCOMPLETE
        if digit == "#":
            entered, self._buffer = self._buffer, ""
            return self.submit(entered)
        if not digit.isdigit():
            return PinOutcome.INCOMPLETE
        self._buffer += digit
        pin = self.account.pin if self.account else None
        if pin is not None and len(self._buffer) >= len(pin):
            entered, self._buffer = self._buffer, ""
            return self.submit(entered)
        return PinOutcome.INCOMPLETE

    def submit(self, entered: str) -> PinOutcome:
        """Check a complete PIN (keypad or spoken digits)."""
        if self.verified:
            return PinOutcome.VERIFIED
        if self.account is None or not self.account.pin:
            return PinOutcome.NO_ACCOUNT
        if self.locked:
            return PinOutcome.LOCKED
        digits = spoken_digits(entered)
        if digits and hmac.compare_digest(digits, self.account.pin):
            self.verified = True
            return PinOutcome.VERIFIED
        self.failed_attempts += 1
        return PinOutcome.LOCKED if self.locked else PinOutcome.WRONG

    def snapshot(self) -> CallerIdentity:
        acc = self.account
        return CallerIdentity(
            phone=self.phone,
            account_id=acc.account_id if acc else None,
            role=acc.role if acc else None,
            verified=self.verified,
            locked=self.locked,
            failed_attempts=self.failed_attempts,
        )


class CallIdentities:
    """Verification state for each live call in this process."""

    def __init__(self, store: IdentityStore, *, max_attempts: int = 3) -> None:
        self._store = store
        self._max_attempts = max_attempts
        self._calls: dict[str, CallerVerification] = {}

    async def for_call(self, call_id: str, tenant_id: str, phone: str | None) -> CallerVerification:
        state = self._calls.get(call_id)
        if state is None:
            account = await self._store.lookup(tenant_id, phone)
            state = self._calls.setdefault(
                call_id, CallerVerification(phone, account, max_attempts=self._max_attempts)
            )
        return state

    def drop(self, call_id: str) -> None:
        self._calls.pop(call_id, None)
