"""Issue 22 (items 3, 4, 6 and the console parts of 9), from outside over real sockets against
the real server and Postgres: login limits that concurrent guesses cannot overrun, a lockout
per (account, source) keyed on the real client, `staff unlock` on the CLI and the console,
viewers' phone searches, integer path ids, and the console's security headers.
"""

from __future__ import annotations

import asyncio
import re
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from fastapi.routing import APIRoute
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.security_headers import HEADERS
from app.access.staff import Role
from app.console_models import login_failures_table as failures_t
from tests.console_support import (
    PASSWORD,
    add_staff,
    bearer,
    csrf_of,
    logged_in,
    seed_call,
    seed_operation,
)
from tests.e2e_support import running_service, wait_until
from tests.server_proc import ServerProcess
from tests.test_console_auth import _cli
from tools.states import OperationStatus

WRONG = "not the password at all"


def _api_routes(app: Any) -> list[tuple[str, set[str], APIRoute]]:
    """(path, methods, route) of every APIRoute, included routers flattened."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # FastAPI before included routers kept their own route objects
        found = [(getattr(r, "path", None), getattr(r, "methods", None), r) for r in app.routes]
    else:
        found = [(c.path, c.methods, c.original_route) for c in iter_route_contexts(app.routes)]
    return [
        (path or route.path, set(methods or route.methods), route)
        for path, methods, route in found
        if isinstance(route, APIRoute)
    ]


def _client(base_url: str, source: str = "127.0.0.1", **kw: Any) -> httpx.AsyncClient:
    """A client whose connections come from `source` (any 127.x address is this machine)."""
    transport = httpx.AsyncHTTPTransport(local_address=source)
    return httpx.AsyncClient(base_url=base_url, transport=transport, timeout=30, **kw)


async def _form(http: httpx.AsyncClient, **headers: str) -> str:
    """The login form's CSRF token (its cookie stays in `http`)."""
    return csrf_of((await http.get("/console/login", headers=headers)).text)


async def _login(
    base_url: str, name: str, password: str, source: str = "127.0.0.1", **headers: str
) -> httpx.Response:
    async with _client(base_url, source) as http:
        token = await _form(http, **headers)
        return await http.post(
            "/console/login",
            data={"username": name, "password": password, "csrf_token": token},
            headers=headers,
        )


async def _failures(engine: AsyncEngine, name: str) -> list[str]:
    async with engine.connect() as conn:
        rows = await conn.execute(
            sa.select(failures_t.c.source).where(failures_t.c.username == name)
        )
        return sorted(r[0] for r in rows)


# --- 3. concurrent guesses cannot overrun the limit ---------------------------------------


async def test_thirty_concurrent_wrong_passwords_check_at_most_the_limit_on_the_form(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "fay", Role.ADMIN)
    async with running_service(engine, login_max_failures_per_account_source=5) as svc:
        # Every guess gets its form first, then all 30 posts go at once.
        clients = [_client(svc.url) for _ in range(30)]
        try:
            tokens = [await _form(http) for http in clients]
            responses = await asyncio.gather(
                *(
                    http.post(
                        "/console/login",
                        data={"username": "fay", "password": f"{WRONG} {i}", "csrf_token": t},
                    )
                    for i, (http, t) in enumerate(zip(clients, tokens, strict=True))
                )
            )
        finally:
            for http in clients:
                await http.aclose()
        right = await _login(svc.url, "fay", PASSWORD)
    codes = sorted(r.status_code for r in responses)
    assert codes == [401] * 5 + [429] * 25, codes
    assert len(await _failures(engine, "fay")) == 5  # only the checked ones were counted
    assert right.status_code == 429  # this (account, source) stays locked for the window


async def test_thirty_concurrent_wrong_basic_credentials_check_at_most_the_limit(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "gus", Role.VIEWER)
    async with running_service(engine, login_max_failures_per_account_source=5) as svc:
        async with _client(svc.url) as http:
            responses = await asyncio.gather(
                *(http.get("/api/calls", auth=("gus", f"{WRONG} {i}")) for i in range(30))
            )
    codes = sorted(r.status_code for r in responses)
    assert codes == [401] * 5 + [429] * 25, codes
    assert all(int(r.headers["retry-after"]) > 0 for r in responses if r.status_code == 429)


async def test_two_replicas_together_check_at_most_the_limit(
    engine: AsyncEngine, clean_db: str
) -> None:
    """Replicas share the count: the advisory locks order attempts across processes."""
    await add_staff(engine, "hal", Role.VIEWER)
    other = ServerProcess(
        {
            "DATABASE_URL": clean_db,
            "CONSOLE_PASSWORD": "console-test-password",
            "CONSOLE_HTTP_BASIC": "true",
            "LOGIN_MAX_FAILURES_PER_ACCOUNT_SOURCE": "5",
        }
    )
    await other.start()
    try:
        async with running_service(engine, login_max_failures_per_account_source=5) as svc:
            async with _client(svc.url) as here, _client(other.url) as there:
                responses = await asyncio.gather(
                    *(
                        (here if i % 2 else there).get("/api/calls", auth=("hal", f"{WRONG}{i}"))
                        for i in range(30)
                    )
                )
    finally:
        await other.stop()
    codes = sorted(r.status_code for r in responses)
    assert codes == [401] * 5 + [429] * 25, codes


# --- 6. a lockout per (account, source), keyed on the real client -------------------------


async def test_guessing_from_one_address_does_not_stop_the_right_password_from_another(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "ida", Role.ADMIN)
    async with running_service(engine, login_max_failures_per_account_source=3) as svc:
        wrong = [(await _login(svc.url, "ida", WRONG, "127.0.0.2")).status_code for _ in range(3)]
        locked = await _login(svc.url, "ida", PASSWORD, "127.0.0.2")
        elsewhere = await _login(svc.url, "ida", PASSWORD, "127.0.0.3")
        basic_elsewhere = None
        async with _client(svc.url, "127.0.0.4") as http:
            basic_elsewhere = await http.get("/api/me", auth=("ida", PASSWORD))
        still_locked = await _login(svc.url, "ida", PASSWORD, "127.0.0.2")
    assert wrong == [401, 401, 401]
    assert locked.status_code == 429 and "Too many failed logins" in locked.text
    assert elsewhere.status_code == 303  # the right password from a clean source works
    assert basic_elsewhere.status_code == 200
    assert still_locked.status_code == 429  # a success elsewhere does not clear the guesser


async def test_behind_a_trusted_proxy_the_limit_is_keyed_on_x_forwarded_for(
    engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """uvicorn applies X-Forwarded-For only from FORWARDED_ALLOW_IPS: the ingress (here
    127.0.0.1) names the client; anyone else's header is ignored."""
    monkeypatch.setenv("FORWARDED_ALLOW_IPS", "127.0.0.1")
    await add_staff(engine, "jan", Role.VIEWER)
    attacker = {"X-Forwarded-For": "203.0.113.7"}
    staff_member = {"X-Forwarded-For": "198.51.100.9"}
    async with running_service(engine, login_max_failures_per_account_source=3) as svc:
        wrong = [(await _login(svc.url, "jan", WRONG, **attacker)).status_code for _ in range(3)]
        attacker_right = await _login(svc.url, "jan", PASSWORD, **attacker)
        staff_right = await _login(svc.url, "jan", PASSWORD, **staff_member)
        # An untrusted peer cannot pick its key with the header: it is counted as itself.
        spoofed = await _login(svc.url, "jan", WRONG, "127.0.0.9", **staff_member)
    assert wrong == [401, 401, 401]
    assert attacker_right.status_code == 429
    assert staff_right.status_code == 303
    assert spoofed.status_code == 401
    assert await _failures(engine, "jan") == ["127.0.0.9", "203.0.113.7", "203.0.113.7",
                                              "203.0.113.7"]  # fmt: skip


async def test_many_sources_slow_an_account_down_but_never_lock_it(engine: AsyncEngine) -> None:
    await add_staff(engine, "kim", Role.VIEWER)
    async with running_service(
        engine,
        login_max_failures_per_account_source=2,
        login_max_failures_per_account=4,
        # Long enough that the next try surely falls inside it, even on a loaded machine.
        login_account_slowdown_s=5.0,
    ) as svc:
        for source in ("127.0.0.2", "127.0.0.3"):
            for _ in range(2):
                assert (await _login(svc.url, "kim", WRONG, source)).status_code == 401
        slowed = await _login(svc.url, "kim", PASSWORD, "127.0.0.4")
        results: list[int] = []

        async def gets_in() -> bool:
            results.append((await _login(svc.url, "kim", PASSWORD, "127.0.0.4")).status_code)
            return results[-1] == 303

        await wait_until(gets_in, timeout=20, what="the right password after the slow-down")
    assert slowed.status_code == 429 and 1 <= int(slowed.headers["retry-after"]) <= 5
    assert set(results) <= {429, 303}


async def test_staff_unlock_clears_a_lockout_from_the_cli(
    engine: AsyncEngine, clean_db: str
) -> None:
    await add_staff(engine, "lou", Role.VIEWER)
    async with running_service(engine, login_max_failures_per_account_source=2) as svc:
        for _ in range(2):
            assert (await _login(svc.url, "lou", WRONG)).status_code == 401
        locked = await _login(svc.url, "lou", PASSWORD)
        unlocked = await _cli(clean_db, "staff", "unlock", "LOU")
        after = await _login(svc.url, "lou", PASSWORD)
    unknown = await _cli(clean_db, "staff", "unlock", "nobody")
    assert locked.status_code == 429
    assert unlocked[0] == 0 and "login failures of lou cleared (2)" in unlocked[1]
    assert after.status_code == 303
    assert unknown[0] == 2 and "no staff account named 'nobody'" in unknown[2]


async def test_staff_unlock_source_clears_a_shared_address_locked_for_every_account(
    engine: AsyncEngine, clean_db: str
) -> None:
    """Behind one shared address (a proxy FORWARDED_ALLOW_IPS does not trust, an office NAT),
    LOGIN_MAX_FAILURES_PER_SOURCE failures lock every login through it; `staff unlock --source`
    clears that address, and only that one."""
    for name in ("nia", "oli", "pat"):
        await add_staff(engine, name, Role.VIEWER)
    shared, other = "127.0.0.7", "127.0.0.8"
    async with running_service(
        engine, login_max_failures_per_account_source=5, login_max_failures_per_source=3
    ) as svc:
        for name in ("nia", "oli", "zed"):
            assert (await _login(svc.url, name, WRONG, shared)).status_code == 401
        assert (await _login(svc.url, "pat", WRONG, other)).status_code == 401
        locked = await _login(svc.url, "pat", PASSWORD, shared)
        bad = await _cli(clean_db, "staff", "unlock", "--source", "not-an-address")
        neither = await _cli(clean_db, "staff", "unlock")
        unlocked = await _cli(clean_db, "staff", "unlock", "--source", shared)
        after = await _login(svc.url, "pat", PASSWORD, shared)
    assert locked.status_code == 429
    assert bad[0] == 2 and "'not-an-address' is not an IP address" in bad[2]
    assert neither[0] == 2 and "needs NAME, --source ADDRESS or both" in neither[2]
    assert unlocked[0] == 0
    assert f"login failures from {shared} cleared (3)" in unlocked[1]
    assert after.status_code == 303
    # The other address's failure is someone else's and stays.
    assert await _failures(engine, "pat") == [other]


async def test_staff_unlock_name_and_source_clears_that_pair_only(
    engine: AsyncEngine, clean_db: str
) -> None:
    await add_staff(engine, "quin", Role.VIEWER)
    async with running_service(engine, login_max_failures_per_account_source=5) as svc:
        for source in ("127.0.0.7", "127.0.0.8"):
            assert (await _login(svc.url, "quin", WRONG, source)).status_code == 401
    pair = await _cli(clean_db, "staff", "unlock", "Quin", "--source", "127.0.0.7")
    assert pair[0] == 0 and "login failures from 127.0.0.7 for quin cleared (1)" in pair[1]
    assert await _failures(engine, "quin") == ["127.0.0.8"]


async def test_an_admin_sees_and_clears_a_lockout_on_the_staff_page(engine: AsyncEngine) -> None:
    await add_staff(engine, "max", Role.OPERATOR)
    await add_staff(engine, "boss", Role.ADMIN)
    async with running_service(engine, login_max_failures_per_account_source=2) as svc:
        for _ in range(2):
            assert (await _login(svc.url, "max", WRONG, "127.0.0.2")).status_code == 401
        async with logged_in(svc.url, "boss") as (admin, csrf):
            page = await admin.get("/console/staff")
            done = await admin.post("/console/staff/max/unlock", data={"csrf_token": csrf})
            flash = await admin.get(done.headers["location"])
            forged = await admin.post("/console/staff/max/unlock", data={"csrf_token": "x"})
        after = await _login(svc.url, "max", PASSWORD, "127.0.0.2")
    row = re.search(r'<tr data-lockout="max">(.*?)</tr>', page.text, re.S)
    assert row is not None and "127.0.0.2" in row.group(1) and ">2<" in row.group(1)
    assert "locked from 1 address" in page.text
    assert done.status_code == 303 and "max: unlocked (2 failed logins cleared)" in flash.text
    assert "No account is locked out." in flash.text
    assert forged.status_code == 403
    assert after.status_code == 303


# --- 4. viewers search by a full number only; searches are rate-limited -------------------


async def test_a_viewers_suffix_search_is_refused_and_a_full_number_works(
    engine: AsyncEngine,
) -> None:
    await seed_call(engine, from_number="+15551230076")
    await seed_call(engine, from_number="+15559990076")
    viewer = await bearer(engine, Role.VIEWER)
    operator = await bearer(engine, Role.OPERATOR)
    await add_staff(engine, "nia", Role.VIEWER)
    async with running_service(engine) as svc, httpx.AsyncClient(base_url=svc.url) as http:
        suffixes = [
            await http.get("/api/calls", params={"phone": p}, headers=viewer)
            for p in ("76", "076", "0076", "230076", "5551230076"[-7:])
        ]
        full = await http.get("/api/calls", params={"phone": "+1 555 123 0076"}, headers=viewer)
        no_country = await http.get("/api/calls", params={"phone": "5551230076"}, headers=viewer)
        op_suffix = await http.get("/api/calls", params={"phone": "0076"}, headers=operator)
        async with logged_in(svc.url, "nia") as (browser, _csrf):
            page = await browser.get("/console/calls", params={"phone": "0076"})
            page_full = await browser.get("/console/calls", params={"phone": "+15551230076"})
    assert [r.status_code for r in suffixes] == [403] * 5
    assert "full phone number" in suffixes[0].json()["detail"]
    assert [c["from"] for c in full.json()["calls"]] == ["+•••••••••76"]
    assert no_country.status_code == 200 and no_country.json()["calls"] == []  # matched whole
    assert len(op_suffix.json()["calls"]) == 2  # operators see numbers, so keep suffixes
    assert page.status_code == 403 and "full phone number" in page.text
    assert "+•••••••••76" not in page.text  # no rows for a refused search
    assert page_full.status_code == 200 and page_full.text.count("+•••••••••76") == 1


async def test_phone_searches_are_rate_limited_per_token_by_distinct_numbers(
    engine: AsyncEngine,
) -> None:
    first, second = await bearer(engine, Role.VIEWER), await bearer(engine, Role.VIEWER)
    numbers = [f"+1555123{n:04d}" for n in range(4)]
    async with running_service(engine, call_search_max_numbers=3) as svc:
        async with httpx.AsyncClient(base_url=svc.url) as http:

            async def search(number: str, who: dict[str, str]) -> httpx.Response:
                return await http.get("/api/calls", params={"phone": number}, headers=who)

            allowed = [(await search(n, first)).status_code for n in numbers[:3]]
            over = await search(numbers[3], first)
            repeated = await search(numbers[0], first)  # the live page refreshes it: free
            unfiltered = await http.get("/api/calls", headers=first)
            other_token = await search(numbers[3], second)
    assert allowed == [200, 200, 200]
    assert over.status_code == 429 and int(over.headers["retry-after"]) > 0
    assert "too many different phone numbers" in over.json()["detail"]
    assert repeated.status_code == 200 and unfiltered.status_code == 200
    assert other_token.status_code == 200


# --- 9. integer path ids are bounded; security headers on every console page --------------


async def test_a_huge_token_id_is_refused_cleanly_not_a_server_error(
    engine: AsyncEngine, clean_db: str
) -> None:
    await add_staff(engine, "ola", Role.ADMIN)
    admin_token = await bearer(engine, Role.ADMIN)
    async with running_service(engine) as svc:
        async with logged_in(svc.url, "ola") as (http, csrf):
            console = {
                n: await http.post(f"/console/tokens/{n}/revoke", data={"csrf_token": csrf})
                for n in ("99999999999999999999", str(2**63), "0", "-1")
            }
            biggest = await http.post(
                f"/console/tokens/{2**63 - 1}/revoke", data={"csrf_token": csrf}
            )
            api = await http.post("/api/tokens/99999999999999999999/revoke", headers=admin_token)
    cli = await _cli(clean_db, "token", "revoke", "99999999999999999999")
    assert {n: r.status_code for n, r in console.items()} == dict.fromkeys(console, 422)
    assert biggest.status_code == 303  # in range: "no API token with id …", not an error
    assert api.status_code == 422
    assert cli[0] == 2 and "no API token with id" in cli[2] and "Traceback" not in cli[2]


def test_every_integer_path_parameter_of_the_app_is_bounded() -> None:
    from app.main import create_app
    from tests.e2e_support import make_settings

    app = create_app(make_settings(1))
    checked, unbounded = [], []
    for path, _methods, route in _api_routes(app):
        for param in route.dependant.path_params:
            if param.field_info.annotation is not int:
                continue
            checked.append(f"{path} {param.name}")
            bounds = {type(m).__name__ for m in param.field_info.metadata}
            if not {"Ge", "Le"} <= bounds and not {"Gt", "Lt"} <= bounds:
                unbounded.append(f"{path} {param.name}")
    assert "/console/tokens/{token_id}/revoke token_id" in checked
    assert "/api/tokens/{token_id}/revoke token_id" in checked
    assert unbounded == []


async def test_every_console_page_sends_the_security_headers(engine: AsyncEngine) -> None:
    await add_staff(engine, "pam", Role.ADMIN)
    call_id = await seed_call(engine)
    op_id = await seed_operation(engine, call_id, OperationStatus.UNKNOWN)
    async with running_service(engine) as svc:
        async with httpx.AsyncClient(base_url=svc.url) as anonymous:
            pages = {
                "/console/login": await anonymous.get("/console/login"),
                "/console/calls (anonymous)": await anonymous.get("/console/calls"),
            }
        async with logged_in(svc.url, "pam") as (http, csrf):
            paths = ["/console", "/console/static/console.js", "/console/nowhere"]
            for path, methods, _route in _api_routes(svc.app):
                if path.startswith("/console") and "GET" in methods:
                    paths.append(
                        path.replace("{call_id}", call_id).replace("{operation_id}", str(op_id))
                    )
            for path in paths:
                pages[path] = await http.get(path)
                if "{" not in path and "?" not in path:
                    pages[path + "?fragment=1"] = await http.get(path, params={"fragment": "1"})
            pages["POST revoke"] = await http.post(
                "/console/tokens/1/revoke", data={"csrf_token": csrf}
            )
    assert "/console/staff" in pages and f"/console/calls/{call_id}" in pages
    for path, response in pages.items():
        assert response.status_code < 500, path
        for name, value in HEADERS.items():
            assert response.headers.get(name) == value, (path, name)
    policy = HEADERS["Content-Security-Policy"]
    assert (
        "script-src 'self'" in policy and "unsafe-inline" not in policy.split("style-src-attr")[0]
    )
    assert "frame-ancestors 'none'" in policy


async def test_live_fragments_come_inside_a_template_for_their_section(
    engine: AsyncEngine,
) -> None:
    await add_staff(engine, "quin", Role.OPERATOR)
    call_id = await seed_call(engine, from_number="+15551234567")
    op_id = await seed_operation(engine, call_id, OperationStatus.UNKNOWN)
    async with running_service(engine) as svc, logged_in(svc.url, "quin") as (http, _csrf):
        fragments = {
            section: (await http.get(path, params={"fragment": "1"})).text
            for section, path in (
                ("calls-live", "/console/calls"),
                ("call-live", f"/console/calls/{call_id}"),
                ("ops-live", "/console/operations"),
                ("op-live", f"/console/operations/{op_id}"),
            )
        }
    for section, text in fragments.items():
        body = text.strip()
        assert body.startswith(f'<template data-fragment="{section}">'), (section, body[:80])
        assert body.endswith("</template>"), section
    assert "+15551234567" in fragments["calls-live"]
