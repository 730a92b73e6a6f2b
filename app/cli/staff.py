"""`voice-agent staff …` and `voice-agent token …`: console accounts and API tokens.

    voice-agent staff add NAME [--role viewer|operator|admin] [--password-stdin]
    voice-agent staff list
    voice-agent staff disable NAME | enable NAME
    voice-agent staff password NAME [--password-stdin]
    voice-agent staff unlock NAME | --source ADDRESS | NAME --source ADDRESS
    voice-agent token add NAME [--role viewer|operator|admin]
    voice-agent token list
    voice-agent token revoke ID

A password is asked for on the terminal (twice), read from stdin with `--password-stdin`, or
generated and shown once. A token's secret is shown once, when it is made.

The accounts and tokens modules (and sqlalchemy's asyncio layer under them) are imported by the
commands that use them: every `voice-agent` command builds this parser at start.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from app.access.passwords import generate_password
from app.access.roles import Role
from app.access.usernames import StaffError

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncEngine


def _read_password(args: argparse.Namespace) -> tuple[str, bool]:
    """(password, generated)."""
    if args.password_stdin:
        return sys.stdin.readline().rstrip("\r\n"), False
    if not sys.stdin.isatty():
        return generate_password(), True
    first = getpass.getpass("password (empty: generate one): ")
    if not first:
        return generate_password(), True
    if getpass.getpass("again: ") != first:
        raise StaffError("the two passwords differ")
    return first, False


def _when(value: Any) -> str:
    return value.strftime("%Y-%m-%d %H:%M UTC") if value else "-"


async def _with_engine(work: Callable[[AsyncEngine], Awaitable[int]]) -> int:
    from app.db import make_engine, resolve_database_url, upgrade
    from app.settings import get_settings

    settings = get_settings()
    url = await asyncio.to_thread(resolve_database_url, settings.database_url, settings.data_dir)
    await asyncio.to_thread(upgrade, url)
    engine = make_engine(url, pool_size=1, max_overflow=0)
    try:
        return await work(engine)
    finally:
        await engine.dispose()


def _run(work: Callable[[AsyncEngine], Awaitable[int]]) -> int:
    try:
        return asyncio.run(_with_engine(work))
    except StaffError as exc:
        print(f"voice-agent: {exc}", file=sys.stderr)
        return 2


def _staff_add(args: argparse.Namespace) -> int:
    from app.access import staff

    password, generated = _read_password(args)

    async def work(engine: AsyncEngine) -> int:
        account = await staff.create_staff(engine, args.name, password, Role(args.role))
        print(f"staff account {account.username} ({account.role}) created")
        if generated:
            print(f"password (shown once): {password}")
        return 0

    return _run(work)


def _staff_list(args: argparse.Namespace) -> int:
    from app.access import staff

    async def work(engine: AsyncEngine) -> int:
        accounts = await staff.list_staff(engine)
        print(f"{'name':<24} {'role':<9} {'state':<9} {'last login':<21} created")
        for a in accounts:
            state = "active" if a.active else "disabled"
            print(
                f"{a.username:<24} {a.role:<9} {state:<9} {_when(a.last_login_at):<21} "
                f"{_when(a.created_at)}"
            )
        return 0

    return _run(work)


def _staff_disable(args: argparse.Namespace) -> int:
    from app.access import staff

    async def work(engine: AsyncEngine) -> int:
        account = await staff.set_disabled(engine, args.name, True)
        print(f"staff account {account.username} disabled (its sessions ended)")
        return 0

    return _run(work)


def _staff_enable(args: argparse.Namespace) -> int:
    from app.access import staff

    async def work(engine: AsyncEngine) -> int:
        account = await staff.set_disabled(engine, args.name, False)
        print(f"staff account {account.username} enabled")
        return 0

    return _run(work)


def _staff_password(args: argparse.Namespace) -> int:
    from app.access import staff

    password, generated = _read_password(args)

    async def work(engine: AsyncEngine) -> int:
        account = await staff.set_password(engine, args.name, password)
        print(f"password of {account.username} changed (its sessions ended)")
        if generated:
            print(f"password (shown once): {password}")
        return 0

    return _run(work)


def _staff_unlock(args: argparse.Namespace) -> int:
    from app.access import staff

    if args.name is None and args.source is None:
        print("voice-agent: staff unlock needs NAME, --source ADDRESS or both", file=sys.stderr)
        return 2

    async def work(engine: AsyncEngine) -> int:
        if args.source is None:
            cleared = await staff.unlock(engine, args.name)
            name = args.name.strip().lower()
            print(f"login failures of {name} cleared ({cleared}); it may log in again")
            return 0
        cleared = await staff.unlock_source(engine, args.source, args.name)
        whose = "" if args.name is None else f" for {args.name.strip().lower()}"
        print(
            f"login failures from {args.source.strip()}{whose} cleared ({cleared}); "
            "logins through it may be tried again"
        )
        return 0

    return _run(work)


def _token_add(args: argparse.Namespace) -> int:
    from app.access import api_tokens

    async def work(engine: AsyncEngine) -> int:
        token, secret = await api_tokens.create_token(
            engine, args.name, Role(args.role), created_by="cli"
        )
        print(f"API token {token.id} {token.name!r} ({token.role}); shown once:")
        print(secret)
        return 0

    return _run(work)


def _token_list(args: argparse.Namespace) -> int:
    from app.access import api_tokens

    async def work(engine: AsyncEngine) -> int:
        print(f"{'id':>4} {'name':<24} {'starts with':<12} {'role':<9} {'state':<8} last used")
        for t in await api_tokens.list_tokens(engine):
            state = "active" if t.active else "revoked"
            print(
                f"{t.id:>4} {t.name:<24} {t.prefix:<12} {t.role:<9} {state:<8} "
                f"{_when(t.last_used_at)}"
            )
        return 0

    return _run(work)


def _token_revoke(args: argparse.Namespace) -> int:
    from app.access import api_tokens

    async def work(engine: AsyncEngine) -> int:
        token = await api_tokens.revoke_token(engine, args.id)
        print(f"API token {token.id} {token.name!r} revoked")
        return 0

    return _run(work)


def add_commands(sub: Any) -> None:
    """Add `staff` and `token` to the CLI's subcommands."""
    roles = [r.value for r in Role]
    role_help = (
        "viewer (reads calls, numbers masked), operator (also acts on operations) or admin "
        "(also manages staff and tokens) (default: %(default)s)"
    )

    def parser(parent: Any, name: str, help_text: str) -> Any:
        # The one-line help doubles as the subcommand's description (`--help`).
        return parent.add_parser(
            name, help=help_text, description=help_text[:1].upper() + help_text[1:] + "."
        )

    p = parser(sub, "staff", "console staff accounts")
    ssub = p.add_subparsers(dest="staff_command", required=True)
    add = parser(ssub, "add", "add an account")
    add.add_argument("name", help="the account's login name")
    add.add_argument("--role", choices=roles, default=Role.VIEWER.value, help=role_help)
    add.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    add.set_defaults(func=_staff_add)
    parser(ssub, "list", "list accounts").set_defaults(func=_staff_list)
    for name, func, help_text in (
        ("disable", _staff_disable, "disable an account (ends its sessions)"),
        ("enable", _staff_enable, "enable a disabled account"),
    ):
        cmd = parser(ssub, name, help_text)
        cmd.add_argument("name", help="the account's login name")
        cmd.set_defaults(func=func)
    unlock = parser(
        ssub, "unlock", "clear failed logins: an account's from every source, or a source's"
    )
    unlock.add_argument(
        "name", nargs="?", help="the account's login name (default: none, with --source)"
    )
    unlock.add_argument(
        "--source",
        metavar="ADDRESS",
        help="the client address whose failed logins to clear, for every account (with NAME: "
        "that pair only); 20 from one address lock every login through it (default: none, "
        "NAME's from every address)",
    )
    unlock.set_defaults(func=_staff_unlock)
    pw = parser(ssub, "password", "set an account's password")
    pw.add_argument("name", help="the account's login name")
    pw.add_argument("--password-stdin", action="store_true", help="read the password from stdin")
    pw.set_defaults(func=_staff_password)

    p = parser(sub, "token", "API tokens for integrations")
    tsub = p.add_subparsers(dest="token_command", required=True)
    tadd = parser(tsub, "add", "make a token (its secret is shown once)")
    tadd.add_argument("name", help="a name that says who uses the token")
    tadd.add_argument("--role", choices=roles, default=Role.VIEWER.value, help=role_help)
    tadd.set_defaults(func=_token_add)
    parser(tsub, "list", "list tokens").set_defaults(func=_token_list)
    rev = parser(tsub, "revoke", "revoke a token")
    rev.add_argument("id", type=int, help="the token's id (voice-agent token list)")
    rev.set_defaults(func=_token_revoke)
