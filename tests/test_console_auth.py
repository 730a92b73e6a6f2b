"""Console access: staff accounts with argon2 hashes, session cookies, CSRF, login rate limits,
roles, the first admin, and the `voice-agent staff|token` commands."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sys
from datetime import timedelta

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access import staff
from app.access.staff import Role, StaffError
from app.console_models import console_sessions_table as sessions_t
from tests.console_support import PASSWORD, add_staff, csrf_of, logged_in, seed_operation
from tests.e2e_support import running_service
from tools.states import OperationStatus

S = OperationStatus


async def _login(http: httpx.AsyncClient, name: str, password: str) -> httpx.Response:
    form = await http.get("/console/login")
    return await http.post(
        "/console/login",
        data={"username": name, "password": password, "csrf_token": csrf_of(form.text)},
    )


async def test_passwords_are_stored_as_argon2id_hashes_and_weak_ones_refused(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "ana", Role.VIEWER)
    async with engine.connect() as conn:
        stored = (await conn.exec_driver_sql("SELECT password_hash FROM staff_accounts")).scalar()
    assert stored is not None and stored.startswith("$argon2id$") and PASSWORD not in stored
    assert await staff.authenticate(engine, "ANA ", PASSWORD) is not None  # names fold case
    assert await staff.authenticate(engine, "ana", "wrong password!") is None
    assert await staff.authenticate(engine, "nobody", PASSWORD) is None
    with pytest.raises(StaffError, match="at least 10"):
        await staff.create_staff(engine, "bo", "short", Role.VIEWER)
    with pytest.raises(StaffError, match="already exists"):
        await staff.create_staff(engine, "ana", PASSWORD, Role.ADMIN)
    with pytest.raises(StaffError, match="staff name"):
        await staff.create_staff(engine, "<script>", PASSWORD, Role.ADMIN)


async def test_login_sets_an_httponly_samesite_session_cookie_secure_behind_tls(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "cy", Role.OPERATOR)
    async with running_service(engine) as plain:
        async with httpx.AsyncClient(base_url=plain.url) as http:
            ok = await _login(http, "cy", PASSWORD)
    async with running_service(engine, public_base_url="https://voice.example.com") as tls:
        async with httpx.AsyncClient(base_url=tls.url) as http:
            # TLS ends at a proxy: the browser speaks https, so it sends Secure cookies back.
            form = await http.get("/console/login")
            login_cookie = form.cookies["va_login"]
            secure = await http.post(
                "/console/login",
                data={"username": "cy", "password": PASSWORD, "csrf_token": csrf_of(form.text)},
                headers={"Cookie": f"va_login={login_cookie}"},
            )
    cookie = next(v for k, v in ok.headers.multi_items() if k == "set-cookie" and "va_session" in v)
    tls_cookie = next(
        v for k, v in secure.headers.multi_items() if k == "set-cookie" and "va_session" in v
    )
    assert ok.status_code == 303 and ok.headers["location"] == "/console/calls"
    assert "HttpOnly" in cookie and "SameSite=lax" in cookie and "Secure" not in cookie
    assert "Secure" in tls_cookie and "HttpOnly" in tls_cookie


async def test_wrong_passwords_are_rate_limited_per_account_and_per_source(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "di", Role.VIEWER)
    await add_staff(engine, "ed", Role.VIEWER)
    async with running_service(
        engine, login_max_failures_per_account_source=3, login_max_failures_per_source=5
    ) as svc:
        async with httpx.AsyncClient(base_url=svc.url) as http:
            wrong = [(await _login(http, "di", "not the password")).status_code for _ in range(3)]
            # The account is locked now, even for the right password…
            locked = await _login(http, "di", PASSWORD)
            # …while another account still works from here, until the source is locked too.
            other = await _login(http, "ed", PASSWORD)
            http.cookies.clear()
            more = [(await _login(http, "ed", "not the password")).status_code for _ in range(2)]
            source_locked = await _login(http, "ed", PASSWORD)
    assert wrong == [401, 401, 401]
    assert locked.status_code == 429 and int(locked.headers["retry-after"]) > 0
    assert "Too many failed logins" in locked.text
    assert other.status_code == 303
    assert more == [401, 401]
    assert source_locked.status_code == 429


async def test_the_login_form_needs_its_own_csrf_token_and_only_redirects_within_the_console(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "fi", Role.VIEWER)
    async with running_service(engine) as svc:
        async with httpx.AsyncClient(base_url=svc.url) as http:
            forged = await http.post(
                "/console/login",
                data={"username": "fi", "password": PASSWORD, "csrf_token": "forged"},
            )
            form = await http.get("/console/login?next=//evil.example.com/")
            away = await http.post(
                "/console/login",
                data={
                    "username": "fi",
                    "password": PASSWORD,
                    "csrf_token": csrf_of(form.text),
                    "next": "https://evil.example.com/",
                },
            )
    assert forged.status_code == 403 and "va_session" not in forged.headers.get("set-cookie", "")
    assert away.status_code == 303 and away.headers["location"] == "/console/calls"


async def test_every_console_action_needs_the_sessions_csrf_token(engine: AsyncEngine) -> None:
    await add_staff(engine, "gus", Role.OPERATOR)
    op_id = await seed_operation(engine, None, S.UNKNOWN, tool="no_such_tool")
    async with running_service(engine) as svc:
        async with logged_in(svc.url, "gus") as (client, csrf):
            url = f"/console/operations/{op_id}/actions/record_outcome"
            form = {"why": "checked", "outcome": "failed_final"}
            missing = await client.post(url, data=form)
            forged = await client.post(url, data={**form, "csrf_token": "x" * 43})
            logout_forged = await client.post("/console/logout", data={"csrf_token": "nope"})
            done = await client.post(url, data={**form, "csrf_token": csrf})
            page = await client.get(f"/console/operations/{op_id}")
    assert (missing.status_code, forged.status_code, logout_forged.status_code) == (403, 403, 403)
    assert done.status_code == 303
    assert "Recorded as failed_final." in page.text and "staff:gus" in page.text


async def test_sessions_end_on_logout_idle_time_disabling_and_password_change(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "hal", Role.VIEWER)
    async with running_service(engine) as svc:
        async with logged_in(svc.url, "hal") as (client, csrf):
            await client.post("/console/logout", data={"csrf_token": csrf})
            after_logout = await client.get("/console/calls")
        async with logged_in(svc.url, "hal") as (client, _):
            async with engine.begin() as conn:
                await conn.execute(
                    sessions_t.update().values(last_seen_at=sa.func.now() - timedelta(hours=9))
                )
            after_idle = await client.get("/console/calls")
        async with logged_in(svc.url, "hal") as (client, _):
            await staff.set_disabled(engine, "hal", True)
            after_disable = await client.get("/api/calls")
            await staff.set_disabled(engine, "hal", False)
        async with logged_in(svc.url, "hal") as (client, _):
            await staff.set_password(engine, "hal", "a brand new password")
            after_change = await client.get("/console/calls")
    for response in (after_logout, after_idle, after_change):
        assert response.status_code == 303
        assert response.headers["location"].startswith("/console/login")
    assert after_disable.status_code == 401


async def test_roles_decide_who_acts_and_who_administers(engine: AsyncEngine) -> None:
    await add_staff(engine, "vi", Role.VIEWER)
    await add_staff(engine, "op", Role.OPERATOR)
    await add_staff(engine, "ad", Role.ADMIN)
    op_id = await seed_operation(engine, None, S.UNKNOWN, tool="no_such_tool")
    results: dict[str, tuple[int, int]] = {}
    async with running_service(engine) as svc:
        for name in ("vi", "op", "ad"):
            async with logged_in(svc.url, name) as (client, csrf):
                act = await client.post(
                    f"/api/operations/{op_id}/actions/record-outcome",
                    json={"why": "x", "outcome": "failed_final"},
                    headers={"X-CSRF-Token": csrf},
                )
                tokens = await client.get("/console/tokens")
                results[name] = (act.status_code, tokens.status_code)
    assert results["vi"] == (403, 403)
    assert results["op"] == (200, 403)
    assert results["ad"][1] == 200 and results["ad"][0] == 409  # already settled by "op"


async def test_the_first_admin_gets_a_generated_password_shown_once_on_the_terminal(
    engine: AsyncEngine, caplog: pytest.LogCaptureFixture
) -> None:
    terminal = io.StringIO()
    with caplog.at_level(logging.DEBUG):
        secret = await staff.ensure_first_admin(engine, "admin", None, terminal=terminal)
        again = await staff.ensure_first_admin(engine, "admin", None, terminal=terminal)
    assert secret is not None and again is None
    assert terminal.getvalue().count(secret) == 1
    assert secret not in caplog.text
    assert await staff.authenticate(engine, "admin", secret) is not None


async def test_a_weak_console_password_stops_the_service_with_a_message(
    engine: AsyncEngine,
) -> None:
    with pytest.raises(StaffError, match="CONSOLE_USER/CONSOLE_PASSWORD: a password needs"):
        await staff.ensure_first_admin(engine, "admin", "short")


async def _cli(db: str, *args: str, stdin: str | None = None) -> tuple[int, str, str]:
    env = {**os.environ, "DATABASE_URL": db, "LOG_LEVEL": "WARNING"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *args, env=env,
        stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate(stdin.encode() if stdin else b"")
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_staff_and_token_commands_manage_accounts_and_show_secrets_once(
    engine: AsyncEngine, clean_db: str
) -> None:
    added = await _cli(clean_db, "staff", "add", "Ivy", "--role", "operator", "--password-stdin",
                       stdin="a long enough password\n")  # fmt: skip
    generated = await _cli(clean_db, "staff", "add", "jo")
    duplicate = await _cli(clean_db, "staff", "add", "ivy", "--password-stdin", stdin="x" * 12)
    disabled = await _cli(clean_db, "staff", "disable", "jo")
    listed = await _cli(clean_db, "staff", "list")
    token = await _cli(clean_db, "token", "add", "crm", "--role", "viewer")
    tokens = await _cli(clean_db, "token", "list")
    revoked = await _cli(clean_db, "token", "revoke", "1")
    assert added[0] == 0 and "ivy (operator) created" in added[1]
    assert await staff.authenticate(engine, "ivy", "a long enough password") is not None
    assert generated[0] == 0 and "password (shown once): " in generated[1]
    password = generated[1].split("password (shown once): ")[1].strip()
    assert duplicate[0] == 2 and "already exists" in duplicate[2]
    assert disabled[0] == 0 and await staff.authenticate(engine, "jo", password) is None
    assert "ivy" in listed[1] and "disabled" in listed[1]
    secret = token[1].strip().splitlines()[-1]
    assert token[0] == 0 and secret.startswith("va_")
    assert secret not in tokens[1] and secret[:9] in tokens[1]
    assert revoked[0] == 0 and "revoked" in revoked[1]
