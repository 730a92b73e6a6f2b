"""Staff accounts of the console: roles, creation, password checks, disabling.

Three roles, each including the one before: a `viewer` reads calls and operations with phone
numbers masked; an `operator` also sees full numbers and acts on operations; an `admin` also
manages staff accounts and API tokens.
"""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TextIO

import sqlalchemy as sa
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access import login_limits
from app.access.passwords import (
    check_strength,
    generate_password,
    hash_password_async,
    needs_rehash,
    verify_password_async,
)
from app.access.roles import Role as Role
from app.access.usernames import USERNAME, StaffError, check_username
from app.console_models import console_sessions_table as sessions_t
from app.console_models import staff_accounts_table as staff_t

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StaffAccount:
    """One row of `staff_accounts`, without its password hash."""

    id: int
    username: str
    role: Role
    created_at: datetime
    last_login_at: datetime | None
    disabled_at: datetime | None

    @property
    def active(self) -> bool:
        return self.disabled_at is None

    @classmethod
    def from_row(cls, row: Any) -> StaffAccount:
        m = row._mapping
        return cls(
            id=m["id"],
            username=m["username"],
            role=Role(m["role"]),
            created_at=m["created_at"],
            last_login_at=m["last_login_at"],
            disabled_at=m["disabled_at"],
        )


async def create_staff(
    engine: AsyncEngine, username: str, password: str, role: Role
) -> StaffAccount:
    """Add an account; StaffError if the name is taken or the password is too weak."""
    name = check_username(username)
    try:
        check_strength(password)
    except ValueError as exc:
        raise StaffError(str(exc)) from exc
    hashed = await hash_password_async(password)
    try:
        async with engine.begin() as conn:
            row = (
                await conn.execute(
                    staff_t.insert()
                    .values(username=name, password_hash=hashed, role=role.value)
                    .returning(*staff_t.c)
                )
            ).one()
    except IntegrityError as exc:
        raise StaffError(f"a staff account named {name!r} already exists") from exc
    return StaffAccount.from_row(row)


async def list_staff(engine: AsyncEngine) -> list[StaffAccount]:
    async with engine.connect() as conn:
        rows = await conn.execute(sa.select(staff_t).order_by(staff_t.c.username))
        return [StaffAccount.from_row(r) for r in rows]


async def get_staff(engine: AsyncEngine, username: str) -> StaffAccount | None:
    async with engine.connect() as conn:
        row = (
            await conn.execute(sa.select(staff_t).where(staff_t.c.username == username.lower()))
        ).first()
    return StaffAccount.from_row(row) if row is not None else None


async def count_staff(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(
            (await conn.execute(sa.select(sa.func.count()).select_from(staff_t))).scalar_one()
        )


async def set_disabled(engine: AsyncEngine, username: str, disabled: bool) -> StaffAccount:
    """Disable (ending every session of the account at once) or re-enable an account."""
    name = username.strip().lower()
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                staff_t.update()
                .where(staff_t.c.username == name)
                .values(disabled_at=datetime.now(UTC) if disabled else None)
                .returning(*staff_t.c)
            )
        ).first()
        if row is None:
            raise StaffError(f"no staff account named {name!r}")
        if disabled:
            await conn.execute(sessions_t.delete().where(sessions_t.c.staff_id == row.id))
    return StaffAccount.from_row(row)


async def set_password(engine: AsyncEngine, username: str, password: str) -> StaffAccount:
    """Replace an account's password; its sessions end."""
    name = username.strip().lower()
    try:
        check_strength(password)
    except ValueError as exc:
        raise StaffError(str(exc)) from exc
    hashed = await hash_password_async(password)
    async with engine.begin() as conn:
        row = (
            await conn.execute(
                staff_t.update()
                .where(staff_t.c.username == name)
                .values(password_hash=hashed, password_changed_at=sa.func.now())
                .returning(*staff_t.c)
            )
        ).first()
        if row is None:
            raise StaffError(f"no staff account named {name!r}")
        await conn.execute(sessions_t.delete().where(sessions_t.c.staff_id == row.id))
    return StaffAccount.from_row(row)


async def unlock(engine: AsyncEngine, username: str) -> int:
    """Clear the login failures of `username` from every source (its lockouts and its share of
    each source's count); how many failures were cleared. StaffError if the name is neither an
    account nor has failures."""
    name = username.strip().lower()
    cleared = await login_limits.clear(engine, name)
    if cleared == 0 and await get_staff(engine, name) is None:
        raise StaffError(f"no staff account named {name!r}")
    return cleared


async def unlock_source(engine: AsyncEngine, source: str, username: str | None = None) -> int:
    """Clear the login failures from `source` (an IP address) for every account, or for
    `username` only; how many failures were cleared. StaffError if it is not an address."""
    try:
        address = ipaddress.ip_address(source.strip())
    except ValueError:
        raise StaffError(f"{source.strip()!r} is not an IP address") from None
    name = username.strip().lower() if username is not None else None
    return await login_limits.clear(engine, name, str(address))


async def authenticate(engine: AsyncEngine, username: str, password: str) -> StaffAccount | None:
    """The active account whose name and password match, else None (same cost either way)."""
    name = username.strip().lower()
    row = None
    if USERNAME.match(name) and len(password) <= 1024:
        async with engine.connect() as conn:
            row = (await conn.execute(sa.select(staff_t).where(staff_t.c.username == name))).first()
    ok = await verify_password_async(row.password_hash if row is not None else None, password)
    if not ok or row is None or row.disabled_at is not None:
        return None
    async with engine.begin() as conn:
        values: dict[str, Any] = {"last_login_at": sa.func.now()}
        if needs_rehash(row.password_hash):
            values["password_hash"] = await hash_password_async(password)
        await conn.execute(staff_t.update().where(staff_t.c.id == row.id).values(**values))
    return StaffAccount.from_row(row)


def _controlling_terminal() -> TextIO | None:
    """The terminal itself (/dev/tty), not stderr: stderr carries the log stream, which may be
    collected; a password printed there would be kept with the logs."""
    try:
        return open("/dev/tty", "w", encoding="utf-8")  # closed by the caller
    except OSError:
        return None


async def ensure_first_admin(
    engine: AsyncEngine,
    username: str,
    password: str | None,
    *,
    terminal: TextIO | None = None,
) -> str | None:
    """With no staff account at all, create the admin `username`.

    Its password is `password` (CONSOLE_PASSWORD) or a generated one, which is written once to
    `terminal` (else the controlling terminal, /dev/tty, when there is one), never to stderr
    or the log. Returns the generated password, if one was made.
    """
    if await count_staff(engine) > 0:
        return None
    generated = password is None
    secret = password if password is not None else generate_password()
    try:
        await create_staff(engine, username, secret, Role.ADMIN)
    except StaffError as exc:
        if "already exists" in str(exc):
            return None  # another replica created it at the same moment
        raise StaffError(f"CONSOLE_USER/CONSOLE_PASSWORD: {exc}") from exc
    if not generated:
        return None
    tty = _controlling_terminal() if terminal is None else None
    out = terminal if terminal is not None else tty
    if out is not None:
        try:
            print(
                f"console admin created: {check_username(username)} / {secret}  (shown once; "
                f"change it with `voice-agent staff password {check_username(username)}`)",
                file=out,
                flush=True,
            )
        finally:
            if tty is not None:
                tty.close()
    else:
        log.warning(
            "console admin %r created with a generated password that is not shown (stderr is "
            "not a terminal); set one with `voice-agent staff password %s`",
            check_username(username),
            check_username(username),
        )
    return secret
