"""Staff passwords: argon2id through argon2-cffi (its RFC 9106 low-memory profile).

Hashing and verifying cost tens of milliseconds of CPU by design, so async callers run them
in a thread (`hash_password_async`, `verify_password_async`).
"""

from __future__ import annotations

import asyncio
import functools
import secrets

from argon2 import PasswordHasher
from argon2.exceptions import InvalidHashError, VerificationError

_hasher = PasswordHasher()


@functools.cache
def _dummy_hash() -> str:
    """Verified when the account does not exist, so a wrong name costs as long as a wrong
    password. Made at the first login, not at import: a hash is ~0.3 s of CPU that every
    `voice-agent` command would otherwise pay at start."""
    return _hasher.hash(secrets.token_urlsafe(16))


MIN_LENGTH = 10
MAX_LENGTH = 256


class WeakPassword(ValueError):
    """A password the console refuses to store."""


def check_strength(password: str) -> None:
    """Refuse passwords too short to resist guessing (or absurdly long)."""
    if len(password) < MIN_LENGTH:
        raise WeakPassword(f"a password needs at least {MIN_LENGTH} characters")
    if len(password) > MAX_LENGTH:
        raise WeakPassword(f"a password has at most {MAX_LENGTH} characters")


def generate_password() -> str:
    """A random password for a new account (shown once)."""
    return secrets.token_urlsafe(15)


def hash_password(password: str) -> str:
    return _hasher.hash(password)


def verify_password(password_hash: str | None, password: str) -> bool:
    """Whether `password` matches; a missing account still spends the same time."""
    try:
        matches = _hasher.verify(password_hash or _dummy_hash(), password)
        return matches and password_hash is not None
    except (VerificationError, InvalidHashError):
        return False


def needs_rehash(password_hash: str) -> bool:
    """The hash was made with weaker parameters than today's."""
    try:
        return _hasher.check_needs_rehash(password_hash)
    except InvalidHashError:
        return True


async def hash_password_async(password: str) -> str:
    return await asyncio.to_thread(hash_password, password)


async def verify_password_async(password_hash: str | None, password: str) -> bool:
    return await asyncio.to_thread(verify_password, password_hash, password)
