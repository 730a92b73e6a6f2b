"""The console's JSON API over a real socket: authorization on every route, filters, keyset
pages, strict parameters, masking by role, and the OpenAPI schema."""

from __future__ import annotations

import re
import uuid
from collections.abc import AsyncIterator, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from fastapi.routing import APIRoute, APIWebSocketRoute
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.routing import Mount, WebSocketRoute

from app.access.staff import Role
from telephony.call_events import CallEvent, CallEventKind
from tests.console_support import (
    add_staff,
    age_operation,
    bearer,
    logged_in,
    seed_call,
    seed_operation,
)
from tests.e2e_support import Service, running_service
from tools.states import OperationStatus

S = OperationStatus
# A UUID, an ISO timestamp or a number of milliseconds: values that may hold any digits.
ID_OR_TIME = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
    r"|\d{4}-\d\d-\d\dT[\d:.]+(?:[+-]\d\d:\d\d|Z)?"
    r"|'t_ms': [\d.]+"
)

# Deliberately reachable without a console login: webhooks prove themselves with signatures
# (or a signed stream token), health and metrics are for probes, the login page is the way in.
PUBLIC = {
    ("POST", "/twilio/voice"),
    ("POST", "/twilio/status"),
    ("POST", "/twilio/stream-ended"),
    ("POST", "/twilio/transfer-answered"),
    ("POST", "/twilio/transfer-ended"),
    ("POST", "/twilio/warm-answered"),
    ("POST", "/twilio/warm-briefed"),
    ("POST", "/twilio/warm-status"),
    ("POST", "/twilio/outbound-answer"),
    ("POST", "/twilio/amd"),
    ("POST", "/twilio/sms-status"),
    ("POST", "/twilio/sms"),
    ("POST", "/openai/webhook"),
    ("POST", "/operations/{operation_id}/callback"),
    ("WS", "/twilio/media"),
    ("GET", "/healthz"),
    ("GET", "/readyz"),
    ("GET", "/metrics"),
    ("GET", "/console/login"),
    ("POST", "/console/login"),
    ("MOUNT", "/console/static"),
}
# Of those, the ones that must still refuse a request that does not prove itself.
SIGNED = {
    ("POST", "/twilio/voice"),
    ("POST", "/twilio/status"),
    ("POST", "/twilio/stream-ended"),
    ("POST", "/twilio/transfer-answered"),
    ("POST", "/twilio/transfer-ended"),
    ("POST", "/twilio/warm-answered"),
    ("POST", "/twilio/warm-briefed"),
    ("POST", "/twilio/warm-status"),
    ("POST", "/twilio/outbound-answer"),
    ("POST", "/twilio/amd"),
    ("POST", "/twilio/sms-status"),
    ("POST", "/twilio/sms"),
    ("POST", "/openai/webhook"),
    ("POST", "/operations/{operation_id}/callback"),
}
_PARAMS = {
    "call_id": str(uuid.uuid4()),
    "operation_id": str(uuid.uuid4()),
    "token_id": "1",
    "username": "nobody",
    "change": "disable",
    "action": "reconcile",
}


def walk_routes(app: Any) -> Iterator[tuple[str, str]]:
    """(method or WS or MOUNT, path) of every route, included routers flattened."""
    try:
        from fastapi.routing import iter_route_contexts
    except ImportError:  # FastAPI before included routers kept their own route objects
        contexts: Any = [
            (r, getattr(r, "path", None), getattr(r, "methods", None)) for r in app.routes
        ]
    else:
        contexts = [(c.original_route, c.path, c.methods) for c in iter_route_contexts(app.routes)]
    for route, path, methods in contexts:
        if isinstance(route, APIRoute):
            for method in sorted(set(methods or route.methods) - {"HEAD"}):
                yield method, path or route.path
        elif isinstance(route, APIWebSocketRoute | WebSocketRoute):
            yield "WS", path or route.path
        elif isinstance(route, Mount):
            yield "MOUNT", path or route.path
        else:
            yield "?", str(path or route)


def _concrete(path: str) -> str:
    return re.sub(r"\{(\w+)(?::\w+)?\}", lambda m: _PARAMS.get(m.group(1), "x"), path)


@pytest.fixture
async def service(engine: AsyncEngine) -> AsyncIterator[Service]:
    async with running_service(engine, console_http_basic=False) as svc:
        yield svc


async def test_every_route_refuses_anonymous_callers_except_the_deliberately_public_ones(
    service: Service,
) -> None:
    routes = list(walk_routes(service.app))
    assert len(routes) > 25  # the walk sees the whole app, console included
    unknown_kinds = [r for r in routes if r[0] == "?"]
    assert unknown_kinds == [], "a route of a kind this test cannot check"
    refused: dict[tuple[str, str], int] = {}
    async with httpx.AsyncClient(base_url=service.url, timeout=20) as http:
        for method, path in routes:
            if (method, path) in PUBLIC and (method, path) not in SIGNED:
                continue
            url = _concrete(path)
            anonymous = await http.request(method, url)
            forged = await http.request(
                method, url, headers={"Authorization": "Bearer va_not-a-token"}
            )
            cookie = await http.request(method, url, headers={"Cookie": "va_session=forged"})
            if (method, path) in SIGNED:
                assert anonymous.status_code in (401, 403), (method, path, anonymous.status_code)
                continue
            for response in (anonymous, forged, cookie):
                if path.startswith("/console"):
                    # Pages send a browser to the login page (and back afterwards).
                    ok = response.status_code == 303 and response.headers["location"].startswith(
                        "/console/login?next="
                    )
                else:
                    ok = response.status_code == 401
                assert ok, (method, path, response.status_code, response.text[:200])
            refused[(method, path)] = anonymous.status_code
    # The JSON API, the pages and the actions are all among the refused.
    assert ("GET", "/api/calls") in refused
    assert ("GET", "/api/calls/{call_id}/recording") in refused
    assert ("POST", "/api/operations/{operation_id}/actions/reconcile") in refused
    assert ("GET", "/console/calls/{call_id}") in refused
    assert ("GET", "/api/openapi.json") in refused


async def test_calls_list_filters_by_phone_time_range_status_leg_and_unsettled_operations(
    service: Service, engine: AsyncEngine
) -> None:
    now = datetime.now(UTC)
    alex = await seed_call(engine, from_number="+15551230000", created_at=now - timedelta(hours=3))
    sam = await seed_call(
        engine,
        from_number="+442071234567",
        status="in_progress",
        created_at=now - timedelta(hours=2),
    )
    sip = await seed_call(
        engine,
        from_number="+15559876543",
        leg="sip",
        status="failed",
        created_at=now - timedelta(hours=1),
    )
    open_op = await seed_call(engine, from_number="+15551239999", created_at=now)
    await seed_operation(engine, open_op, S.UNKNOWN)
    await seed_operation(engine, alex, S.COMMITTED)  # settled: does not count
    headers = await bearer(engine, Role.OPERATOR)

    async def ids(**params: object) -> list[str]:
        async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
            response = await http.get("/api/calls", params=params)  # type: ignore[arg-type]
        assert response.status_code == 200, response.text
        return [c["id"] for c in response.json()["calls"]]

    assert await ids() == [open_op, sip, sam, alex]
    # Phone: the end of the number, whatever way it is typed.
    assert await ids(phone="1230000") == [alex]
    assert await ids(phone="+1 (555) 123-0000") == [alex]
    assert await ids(phone="5551230000") == [alex]
    assert await ids(phone="1234567") == [sam]
    assert await ids(phone="0000000") == [open_op, sip, sam, alex]  # the To number matches all
    assert await ids(phone="77777") == []
    # Time range: [since, until).
    assert await ids(
        since=(now - timedelta(hours=2, minutes=1)).isoformat(),
        until=(now - timedelta(minutes=30)).isoformat(),
    ) == [sip, sam]
    # Status, leg, several values.
    assert await ids(status=["in_progress", "failed"]) == [sip, sam]
    assert await ids(leg="sip") == [sip]
    # Calls whose operations are not all settled.
    assert await ids(unsettled="true") == [open_op]
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        listed = (await http.get("/api/calls", params={"unsettled": "true"})).json()["calls"][0]
    assert (listed["operations"], listed["unsettled"]) == (1, 1)


async def test_the_leg_filter_offers_the_stored_legs_and_each_finds_only_its_calls(
    service: Service, engine: AsyncEngine
) -> None:
    from app.legs.openai_sip import calls as openai_sip
    from app.models import LegKind

    # What the legs write (the SIP leg writes the literal; the interconnect its constant).
    assert openai_sip.LEG == LegKind.OPENAI_SIP
    by_leg = {leg: await seed_call(engine, leg=leg) for leg in ("twilio", "sip", openai_sip.LEG)}
    await add_staff(engine, "olive", Role.OPERATOR)
    async with logged_in(service.url, "olive") as (client, _):
        page = (await client.get("/console/calls")).text
        select = page[page.index('<select name="leg">') :]
        select = select[: select.index("</select>")]
        offered = [v for v in re.findall(r'<option value="([^"]*)"', select) if v]
        assert sorted(offered) == sorted(by_leg)
        for leg in offered:
            listed = (await client.get("/console/calls", params={"leg": leg})).text
            shown = set(re.findall(r'href="/console/calls/([0-9a-f-]{36})"', listed))
            assert shown == {by_leg[leg]}, (leg, shown)
    headers = await bearer(engine, Role.VIEWER)
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        for leg, call_id in by_leg.items():
            response = await http.get("/api/calls", params={"leg": leg})
            assert [c["id"] for c in response.json()["calls"]] == [call_id], leg


async def test_calls_list_pages_by_keyset_without_gaps_or_repeats_while_calls_arrive(
    service: Service, engine: AsyncEngine
) -> None:
    base = datetime.now(UTC) - timedelta(days=1)
    seeded = [await seed_call(engine, created_at=base + timedelta(minutes=i)) for i in range(20)]
    # Two calls in the same microsecond: the id breaks the tie, so neither is skipped.
    twins = [await seed_call(engine, created_at=base + timedelta(minutes=30)) for _ in range(2)]
    expected = [*sorted(twins, reverse=True), *reversed(seeded)]
    headers = await bearer(engine, Role.VIEWER)
    seen: list[str] = []
    cursor = None
    pages = 0
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        while True:
            params = {"limit": 6, **({"cursor": cursor} if cursor else {})}
            body = (await http.get("/api/calls", params=params)).json()
            seen += [c["id"] for c in body["calls"]]
            pages += 1
            if pages == 2:
                await seed_call(engine)  # a new call arrives: later pages do not shift
            cursor = body["next_cursor"]
            if cursor is None:
                break
    assert seen == expected
    assert pages == 4


@pytest.mark.parametrize(
    "query",
    [
        "offset=9223372036854775808",
        "limit=0",
        "limit=201",
        "limit=100000000000000000000000000000",
        "cursor=not-a-cursor",
        "cursor=" + "A" * 300,
        "since=yesterday",
        "until=2026-13-01T00:00:00",
        "status=exploded",
        "leg=SIP%20LEG",
        "phone=abc",
        "phone=%00",
        "phone=" + "1" * 40,
        "unsettled=maybe",
        "page=2",
    ],
)
async def test_bad_parameters_are_refused_with_422_never_a_500(
    service: Service, engine: AsyncEngine, query: str
) -> None:
    headers = await bearer(engine, Role.VIEWER)
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        response = await http.get(f"/api/calls?{query}")
    assert response.status_code == 422, (query, response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["detail"]


async def test_other_routes_are_strict_about_ids_and_parameters_too(
    service: Service, engine: AsyncEngine
) -> None:
    headers = await bearer(engine, Role.OPERATOR)
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        cases = {
            "/api/calls/not-a-uuid/timeline": 422,
            f"/api/calls/{uuid.uuid4()}/timeline": 404,
            f"/api/calls/{uuid.uuid4()}/timeline?x=1": 422,
            f"/api/calls/{uuid.uuid4()}/recording": 404,
            "/api/operations?state=bogus": 422,
            "/api/operations?limit=9223372036854775808": 422,
            "/api/operations?cursor=%00": 422,
            f"/api/operations/{uuid.uuid4()}": 404,
            "/api/operations/123": 422,
        }
        got = {path: (await http.get(path)).status_code for path in cases}
        action = await http.post(
            f"/api/operations/{uuid.uuid4()}/actions/reconcile", json={"why": "check"}
        )
        no_why = await http.post(f"/api/operations/{uuid.uuid4()}/actions/reconcile", json={})
        extra = await http.post(
            f"/api/operations/{uuid.uuid4()}/actions/reconcile", json={"why": "x", "force": True}
        )
    assert got == cases
    assert (action.status_code, no_why.status_code, extra.status_code) == (404, 422, 422)


async def test_viewers_see_phone_numbers_masked_and_operators_see_them_whole(
    service: Service, engine: AsyncEngine
) -> None:
    call_id = await seed_call(engine, from_number="+15551230000", to_number="+15550001111")
    service.runtime.events.emit(
        CallEvent(
            call_id, CallEventKind.CALL_STARTED, {"from": "+15551230000", "to": "+15550001111"}
        )
    )
    service.runtime.events.emit(
        CallEvent(
            call_id,
            CallEventKind.CALLER_TRANSCRIPT,
            {"text": "my number is +1 555 123 0000 and my PIN is 4 3 2 1", "turn_id": 1},
        )
    )
    await service.runtime.events.flush()
    op_id = await seed_operation(engine, call_id, S.UNKNOWN, caller="+15551230000")
    viewer = await bearer(engine, Role.VIEWER)
    operator = await bearer(engine, Role.OPERATOR)
    seen: dict[str, str] = {}
    async with httpx.AsyncClient(base_url=service.url) as http:
        for who, headers in (("viewer", viewer), ("operator", operator)):
            seen[who] = "\n".join(
                [
                    (await http.get("/api/calls", headers=headers)).text,
                    (await http.get(f"/api/calls/{call_id}/timeline", headers=headers)).text,
                    (await http.get("/api/operations", headers=headers)).text,
                    (await http.get(f"/api/operations/{op_id}", headers=headers)).text,
                ]
            )
    assert "5551230000" not in seen["viewer"] and "555 123 0000" not in seen["viewer"]
    assert "0001111" not in seen["viewer"]
    assert "•••••••••00" in seen["viewer"]  # the shape and the last two digits stay
    assert "4 3 2 1" not in seen["viewer"]
    assert "+15551230000" in seen["operator"] and "+15550001111" in seen["operator"]


async def test_keypad_digits_and_pin_arguments_are_hidden_from_every_role(
    service: Service, engine: AsyncEngine
) -> None:
    call_id = await seed_call(engine)
    for digit in "4321":
        service.runtime.events.emit(CallEvent(call_id, CallEventKind.DTMF, {"digit": digit}))
    service.runtime.events.emit(
        CallEvent(
            call_id,
            CallEventKind.FUNCTION_CALL,
            {"name": "verify_pin", "call_id": "fc_1", "arguments": '{"pin": "4321"}'},
        )
    )
    await service.runtime.events.flush()
    admin = await bearer(engine, Role.ADMIN)
    async with httpx.AsyncClient(base_url=service.url, headers=admin) as http:
        timeline = (await http.get(f"/api/calls/{call_id}/timeline")).json()
    # All of it but ids and times, where "4321" can turn up by chance.
    text = re.sub(ID_OR_TIME, "", str(timeline))
    assert "4321" not in text and "'4'" not in text
    digits = [e["data"]["digit"] for e in timeline["events"] if e["kind"] == "dtmf"]
    assert digits == ["•"] * 4
    call = next(e for e in timeline["events"] if e["kind"] == "function_call")
    assert call["data"]["arguments"] == {"redacted": True}


async def test_api_tokens_carry_roles_are_stored_hashed_and_stop_working_when_revoked(
    service: Service, engine: AsyncEngine
) -> None:
    admin = await bearer(engine, Role.ADMIN)
    async with httpx.AsyncClient(base_url=service.url) as http:
        made = await http.post(
            "/api/tokens", headers=admin, json={"name": "crm sync", "role": "viewer"}
        )
        assert made.status_code == 201, made.text
        secret = made.json()["token"]
        viewer = {"Authorization": f"Bearer {secret}"}
        me = (await http.get("/api/me", headers=viewer)).json()
        listed = (await http.get("/api/tokens", headers=admin)).json()["tokens"]
        viewer_on_admin = await http.get("/api/tokens", headers=viewer)
        op = await seed_operation(engine, None, S.UNKNOWN)
        viewer_acts = await http.post(
            f"/api/operations/{op}/actions/reconcile", headers=viewer, json={"why": "x"}
        )
        revoked = await http.post(f"/api/tokens/{made.json()['id']}/revoke", headers=admin)
        after = await http.get("/api/calls", headers=viewer)
    async with engine.connect() as conn:
        stored = (await conn.exec_driver_sql("SELECT token_hash, prefix FROM api_tokens")).all()
    assert me == {"name": "crm sync", "role": "viewer", "kind": "token"}
    assert all("token" not in t for t in listed)  # the secret is shown once, at creation
    assert viewer_on_admin.status_code == 403 and viewer_acts.status_code == 403
    assert revoked.status_code == 200 and after.status_code == 401
    assert secret not in str(stored)  # only hashes (and a short prefix) are kept
    assert any(secret.startswith(prefix) and len(prefix) < 12 for _, prefix in stored)


async def test_http_basic_is_refused_unless_switched_on(engine: AsyncEngine) -> None:
    await add_staff(engine, "basic-user", Role.VIEWER)
    auth = ("basic-user", "correct horse battery")
    async with running_service(engine, console_http_basic=False) as off:
        async with httpx.AsyncClient(base_url=off.url) as http:
            refused = await http.get("/api/calls", auth=auth)
    async with running_service(engine, console_http_basic=True) as on:
        async with httpx.AsyncClient(base_url=on.url) as http:
            allowed = await http.get("/api/calls", auth=auth)
            wrong = await http.get("/api/calls", auth=("basic-user", "guess-guess-guess"))
    assert refused.status_code == 401 and "CONSOLE_HTTP_BASIC" in refused.json()["detail"]
    assert allowed.status_code == 200
    assert wrong.status_code == 401


async def test_a_console_session_reads_the_api_and_must_send_its_csrf_token_to_act(
    service: Service, engine: AsyncEngine
) -> None:
    await add_staff(engine, "op", Role.OPERATOR)
    op = await seed_operation(engine, None, S.FAILED_RETRYABLE, tool="book_table")
    async with logged_in(service.url, "op") as (client, csrf):
        listed = await client.get("/api/operations")
        no_token = await client.post(f"/api/operations/{op}/actions/retry", json={"why": "go"})
        forged = await client.post(
            f"/api/operations/{op}/actions/retry",
            json={"why": "go"},
            headers={"X-CSRF-Token": "forged"},
        )
        good = await client.post(
            f"/api/operations/{op}/actions/retry",
            json={"why": "go"},
            headers={"X-CSRF-Token": csrf},
        )
    assert listed.status_code == 200
    assert (no_token.status_code, forged.status_code) == (403, 403)
    assert good.status_code == 200, good.text


async def test_openapi_schema_needs_a_login_and_documents_statuses_bodies_and_content_types(
    service: Service, engine: AsyncEngine
) -> None:
    viewer = await bearer(engine, Role.VIEWER)
    async with httpx.AsyncClient(base_url=service.url) as http:
        anonymous = await http.get("/api/openapi.json")
        default = await http.get("/openapi.json")
        schema = (await http.get("/api/openapi.json", headers=viewer)).json()
    assert anonymous.status_code == 401 and default.status_code == 404
    paths = schema["paths"]
    calls = paths["/api/calls"]["get"]
    assert {"200", "401", "403", "422"} <= set(calls["responses"])
    assert {p["name"] for p in calls["parameters"]} >= {
        "phone", "since", "until", "status", "leg", "unsettled", "limit", "cursor"
    }  # fmt: skip
    assert "offset" not in {p["name"] for p in calls["parameters"]}
    recording = paths["/api/calls/{call_id}/recording"]["get"]["responses"]
    assert "audio/wav" in recording["200"]["content"] and "206" in recording
    stream = paths["/api/calls/{call_id}/stream"]["get"]["responses"]["200"]
    assert "text/event-stream" in stream["content"]
    action = paths["/api/operations/{operation_id}/actions/record-outcome"]["post"]
    assert {"200", "404", "409", "422"} <= set(action["responses"])
    body = action["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    assert body.endswith("/RecordOutcomeBody")
    assert not any(p.startswith("/console") for p in paths)  # pages are not API


async def test_operations_are_listed_open_first_and_paged_without_repeats(
    service: Service, engine: AsyncEngine
) -> None:
    call_id = await seed_call(engine)
    settled = await seed_operation(engine, call_id, S.COMMITTED)
    flying = await seed_operation(engine, call_id, S.ADMITTED)
    unknown = await seed_operation(engine, call_id, S.UNKNOWN)
    person = await seed_operation(engine, None, S.UNKNOWN, tool="no_such_tool")
    stuck = await seed_operation(engine, None, S.FAILED_RETRYABLE)
    await age_operation(engine, stuck, 3600)
    waiting = await seed_operation(engine, None, S.AWAITING_CONFIRMATION)
    headers = await bearer(engine, Role.VIEWER)
    async with httpx.AsyncClient(base_url=service.url, headers=headers) as http:
        body = (await http.get("/api/operations")).json()
        paged: list[str] = []
        cursor = None
        while True:
            params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
            page = (await http.get("/api/operations", params=params)).json()
            paged += [o["operation_id"] for o in page["operations"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
        only_stuck = (await http.get("/api/operations", params={"state": "stuck"})).json()
        of_call = (await http.get("/api/operations", params={"call_id": call_id})).json()
        detail = (await http.get(f"/api/operations/{unknown}")).json()
    listed = [(o["operation_id"], o["console_state"]) for o in body["operations"]]
    assert listed == [
        (str(person), "awaiting_person"),
        (str(unknown), "unknown"),
        (str(stuck), "stuck"),
        (str(flying), "in_flight"),
        (str(waiting), "awaiting_caller"),
        (str(settled), "settled"),
    ]
    assert body["counts"] == {
        "awaiting_person": 1, "unknown": 1, "stuck": 1, "in_flight": 1,
        "awaiting_caller": 1, "settled": 1,
    }  # fmt: skip
    assert paged == [op for op, _ in listed]
    assert [o["operation_id"] for o in only_stuck["operations"]] == [str(stuck)]
    assert {o["operation_id"] for o in of_call["operations"]} == {
        str(settled), str(flying), str(unknown)
    }  # fmt: skip
    assert [e["to_status"] for e in detail["events"]] == ["admitted", "running", "unknown"]
    assert detail["operation"]["call_id"] == call_id and detail["operation"]["turn_id"] == 1
    assert detail["actions"]["reconcile"]["allowed"] is True
    assert detail["actions"]["resend_sms"] == {
        "allowed": False, "why": "no SMS delivery exists for this operation"
    }  # fmt: skip
