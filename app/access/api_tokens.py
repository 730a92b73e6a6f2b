"""API tokens for integrations: `Authorization: Bearer va_…`, hashed at rest, shown once.

A token carries a role like a staff account. Only its sha256 is stored (a token is 256 random
bits, so a fast hash is enough: there is nothing to brute-force), with a short prefix kept in
clear so staff can tell tokens apart in a list.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role, StaffError
from app.console_models import api_tokens_table as tokens_t

PREFIX = "va_"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9 ._:@-]{0,63}$")
# Record `last_used_at` at most this often per token.
TOUCH_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class ApiToken:
    """One token, without its secret."""

    id: int
    name: str
    prefix: str
    role: Role
    created_by: str | None
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None

    @property
    def active(self) -> bool:
        return self.revoked_at is None

    @classmethod
    def from_row(cls, row: Any) -> ApiToken:
        m = row._mapping
        return cls(
            id=m["id"],
            name=m["name"],
            prefix=m["prefix"],
            role=Role(m["role"]),
            created_by=m["created_by"],
            created_at=m["created_at"],
            last_used_at=m["last_used_at"],
            revoked_at=m["revoked_at"],
        )

    def as_json(self) -> dict[str, Any]:
        def iso(t: datetime | None) -> str | None:
            return t.isoformat() if t else None

        return {
            "id": self.id,
            "name": self.name,
            "prefix": self.prefix,
            "role": self.role.value,
            "created_by": self.created_by,
            "created_at": iso(self.created_at),
            "last_used_at": iso(self.last_used_at),
            "revoked_at": iso(self.revoked_at),
        }


def _hash(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


async def create_token(
    engine: AsyncEngine, name: str, role: Role, *, created_by: str | None
) -> tuple[ApiToken, str]:
    """A new token; returns it and its secret, which is never available again."""
    clean = name.strip()
    if not NAME.match(clean):
        raise StaffError("a token name is 1-64 letters, digits, spaces and . _ : @ -")
    secret = PREFIX + secrets.token_urlsafe(32)
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                tokens_t.insert()
                .values(
                    name=clean,
                    token_hash=_hash(secret),
                    prefix=secret[: len(PREFIX) + 6],
                    role=role.value,
                    created_by=created_by,
                )
                .returning(*tokens_t.c)
            )
        ).one()
    return ApiToken.from_row(row), secret


async def list_tokens(engine: AsyncEngine) -> list[ApiToken]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(tokens_t).order_by(tokens_t.c.id))
        return [ApiToken.from_row(r) for r in rows]


async def revoke_token(engine: AsyncEngine, token_id: int) -> ApiToken:
    if not 1 <= token_id < 2**63:  # the column is a bigint: no such token, not a DB error
        raise StaffError(f"no API token with id {token_id}")
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                tokens_t.update()
                .where(tokens_t.c.id == token_id)
                .values(revoked_at=sa.func.coalesce(tokens_t.c.revoked_at, sa.func.now()))
                .returning(*tokens_t.c)
            )
        ).first()
    if row is None:
        raise StaffError(f"no API token with id {token_id}")
    return ApiToken.from_row(row)


async def authenticate_token(engine: AsyncEngine, secret: str) -> ApiToken | None:
    """The active token whose secret this is, else None."""
    if not secret.startswith(PREFIX) or len(secret) > 128:
        return None
    key = _hash(secret)
    async with engine.connect() as conn:
        row = (await conn.execute(sa.select(tokens_t).where(tokens_t.c.token_hash == key))).first()
    if row is None or row.revoked_at is not None:
        return None
    now = datetime.now(UTC)
    if row.last_used_at is None or now - row.last_used_at >= timedelta(seconds=TOUCH_EVERY_S):
        async with engine.begin() as conn:
            await conn.execute(
                tokens_t.update().where(tokens_t.c.id == row.id).values(last_used_at=now)
            )
    return ApiToken.from_row(row)
