"""The console in a real browser: Playwright driving Debian's Chromium (never a downloaded one).

Screenshots of the calls list and a call page are saved under `artifacts/` (gitignored).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import secrets
import threading
import uuid
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from app.access.staff import Role
from app.cli.demo import _script as demo_script
from app.db import create_database, drop_database, make_engine, upgrade
from telephony.sim.scenario import load_scenario
from tests.console_support import PASSWORD, add_staff, seed_call, seed_operation
from tests.e2e_support import CONSOLE, call_stack, running_service, wait_until
from tests.sor_support import start_sor
from tools.restaurant.client import SorClient
from tools.restaurant.protocol import BookingRequest
from tools.restaurant.sor import Faults, SystemOfRecord
from tools.states import OperationStatus

S = OperationStatus
CHROMIUM = "/usr/bin/chromium"
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # The recording is played by the test, not by a person clicking.
    "--autoplay-policy=no-user-gesture-required",
]
ARTIFACTS = Path(__file__).resolve().parent.parent / "artifacts"
WAIT_MS = 15_000

# CI installs the browser and sets VOICE_AGENT_REQUIRE_BROWSER=1, so there these never skip.
pytestmark = pytest.mark.skipif(
    not os.path.exists(CHROMIUM) and os.environ.get("VOICE_AGENT_REQUIRE_BROWSER") != "1",
    reason="Debian's chromium is not installed (.ci/run installs it)",
)


async def js_true(page: Any, expression: str) -> None:
    """Wait until `expression` is true in the page. Not `page.wait_for_function`: Playwright
    compiles its predicate with `new Function` in the page, which the console's CSP (no
    'unsafe-eval') refuses; `page.evaluate` goes through the DevTools protocol instead."""
    await wait_until(
        lambda: page.evaluate(f"Boolean({expression})"), WAIT_MS / 1000, what=expression
    )


@pytest.fixture
async def browser() -> AsyncIterator[Any]:
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        chromium = await p.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        try:
            yield chromium
        finally:
            await chromium.close()


async def log_in(browser: Any, base: str, name: str, password: str, **context: Any) -> Any:
    ctx = await browser.new_context(**context)
    page = await ctx.new_page()
    page.set_default_timeout(WAIT_MS)
    await page.goto(f"{base}/console/login")
    await page.fill("input[name=username]", name)
    await page.fill("input[name=password]", password)
    await page.click("button[type=submit]")
    await page.wait_for_url(f"{base}/console/calls")
    return page


@pytest.fixture
async def sor(clean_db: str) -> AsyncIterator[SystemOfRecord]:
    sor = await start_sor(clean_db, Faults(latency_s=1.0))
    try:
        yield sor
    finally:
        await sor.stop()


@dataclass(frozen=True)
class DemoCall:
    """The demo's call, ended and recorded, and the service that serves its console."""

    base: str
    database_url: str
    call_id: str


@pytest.fixture(scope="module")
def demo_call(database_url: str) -> Iterator[DemoCall]:
    """One simulated demo call (a read, a barge-in, a booking, its outcome), shared by the
    tests that only look at it in the console: it is ~30 s of audio in real time. On a
    database of its own (`clean_db` empties the session's before every test), its stack
    served from a thread with its own event loop until the module's tests are done; nothing
    the tests do changes the call. (Under xdist the two may still land on two workers, each
    playing it once: `--dist loadgroup` would keep them together, but it groups nothing with
    pytest 9.2, pytest-dev/pytest-xdist#1386.)"""
    server = database_url  # create_database reaches the server through any of its URLs
    name = f"va_demo_{os.getpid()}_{secrets.token_hex(3)}"
    url = create_database(server, name)
    try:
        upgrade(url)
        ready: Future[DemoCall] = Future()
        stop = threading.Event()
        thread = threading.Thread(
            target=asyncio.run, args=(_serve_demo_call(url, ready, stop),), daemon=True
        )
        thread.start()
        try:
            yield ready.result(timeout=180)
        finally:
            stop.set()
            thread.join(60)
    finally:
        drop_database(server, name)


async def _serve_demo_call(url: str, ready: Future[DemoCall], stop: threading.Event) -> None:
    try:
        engine = make_engine(url, pool_size=5, max_overflow=5)
        sor = await start_sor(url, Faults(latency_s=1.0))
        try:
            scenario = load_scenario(None)
            async with call_stack(
                engine, scenario, with_worker=True, database_url=url, sor_base_url=sor.url
            ) as stack:
                caller = stack.caller(from_number="+15557650123")
                await demo_script(caller, scenario, lambda _line: None)
                await caller.aclose()
                call_id = await stack.call_id(caller)
                await stack.events(caller)
                await wait_until(
                    lambda: _has_recording(engine, call_id), 20, "the call's recording stored"
                )
                ready.set_result(DemoCall(stack.service.url, url, call_id))
                await asyncio.to_thread(stop.wait)
        finally:
            await sor.stop()
            await engine.dispose()
    except BaseException as exc:  # the test waiting on `ready` reports it
        if not ready.done():
            ready.set_exception(exc)
        else:
            raise


async def test_staff_find_a_simulated_call_see_its_lanes_and_play_its_recording(
    demo_call: DemoCall, browser: Any
) -> None:
    base, call_id = demo_call.base, demo_call.call_id
    engine = make_engine(demo_call.database_url)
    try:
        await _more_calls(engine)
    finally:
        await engine.dispose()
    page = await log_in(browser, base, *CONSOLE, viewport={"width": 1400, "height": 1000})
    ARTIFACTS.mkdir(exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / "console-calls.png"), full_page=True)
    # Find the call by the caller's number.
    await page.fill("input[name=phone]", "765 0123")
    await page.click("form.filters button[type=submit]")
    await page.wait_for_selector(f"tr[data-call-id='{call_id}']")
    rows = await page.locator("table.calls tbody tr").count()
    await page.screenshot(path=str(ARTIFACTS / "console-calls-search.png"), full_page=True)
    await page.click(f"tr[data-call-id='{call_id}'] a")
    await page.wait_for_url(f"{base}/console/calls/{call_id}")
    lanes = {
        key: await page.locator(f".lane-{key} .item").all_inner_texts()
        for key in ("caller", "agent", "tools", "operations", "sor", "delivery", "call")
    }
    cut = await page.locator(".lane-agent .item.cut .unheard").count()
    transcript = await page.locator(".transcript li").all_inner_texts()
    await page.screenshot(path=str(ARTIFACTS / "console-call.png"), full_page=True)
    # Play the recording: the playhead moves along the timeline.
    await js_true(page, "document.getElementById('recording').readyState >= 1")
    duration = await page.evaluate("document.getElementById('recording').duration")
    await page.evaluate("document.getElementById('recording').play()")
    await js_true(page, "document.getElementById('recording').currentTime > 1.0")
    head = page.locator(".playhead")
    first = float(await head.get_attribute("data-t") or 0)
    await js_true(page, f"Number(document.querySelector('.playhead').dataset.t) > {first + 500}")
    moved = float(await head.get_attribute("data-t") or 0)
    visible = await head.is_visible()
    await page.evaluate("document.getElementById('recording').pause()")
    await page.screenshot(path=str(ARTIFACTS / "console-call-playing.png"), full_page=False)
    phone = await log_in(browser, base, *CONSOLE, viewport={"width": 390, "height": 844})
    await phone.goto(f"{base}/console/calls/{call_id}")
    await phone.screenshot(path=str(ARTIFACTS / "console-call-phone.png"), full_page=True)
    await phone.context.close()
    await page.context.close()

    assert rows == 1
    assert any("Please check" in t or "table" in t.lower() for t in lanes["caller"]), lanes
    assert lanes["agent"] and "barge-in" in lanes["agent"]
    assert cut >= 1  # the cut answer shows what was generated but never heard
    assert any("check_availability" in t for t in lanes["tools"])
    assert any("book_table → needs_confirmation" in t for t in lanes["tools"])
    assert any("book_table: committed" in t for t in lanes["operations"])
    assert any(t.startswith("confirmed BK") for t in lanes["sor"]), lanes["sor"]
    assert any("announced" in t for t in lanes["delivery"]), lanes["delivery"]
    assert any("call ended" in t for t in lanes["call"])
    assert any("Caller" in line for line in transcript) and any(
        "Agent" in line for line in transcript
    )
    assert duration > 10
    assert visible and moved > first + 500


async def _more_calls(engine: AsyncEngine) -> None:
    """Other calls around it, so the list looks like a day's work."""
    now = dt.datetime.now(dt.UTC)
    for minutes, number, status, leg in (
        (5, "+15551112222", "completed", "twilio"),
        (12, "+442071234567", "busy", "twilio"),
        (30, "+15553334444", "failed", "sip"),
        (45, "anonymous", "completed", "twilio"),
    ):
        await seed_call(
            engine,
            from_number=number,
            status=status,
            leg=leg,
            created_at=now - dt.timedelta(minutes=minutes),
        )
    stuck = await seed_call(
        engine, from_number="+15556667777", created_at=now - dt.timedelta(hours=1)
    )
    await seed_operation(engine, stuck, S.UNKNOWN)


async def _has_recording(engine: AsyncEngine, call_id: str) -> bool:
    async with engine.connect() as conn:
        found = await conn.exec_driver_sql(
            "SELECT 1 FROM call_recordings WHERE call_id = %(c)s", {"c": uuid.UUID(call_id)}
        )
        return found.first() is not None


async def test_reconciling_an_unknown_operation_updates_its_history_live_for_others(
    engine: AsyncEngine, clean_db: str, sor: SystemOfRecord, browser: Any
) -> None:
    key = f"browser:{uuid.uuid4().hex}"
    day = dt.datetime.now(dt.UTC).date() + dt.timedelta(days=3)
    async with SorClient(sor.url) as client:
        # The system of record committed it; our side never heard the answer.
        made = await client.book_table(
            key, BookingRequest(date=day, time="19:00", party_size=2, name="Ada")
        )
    call_id = await seed_call(engine)
    op_id = await seed_operation(
        engine,
        call_id,
        S.UNKNOWN,
        key=key,
        args={"date": day.isoformat(), "time": "19:00", "party_size": 2, "name": "Ada"},
    )
    await add_staff(engine, "watcher", Role.VIEWER)
    await add_staff(engine, "fixer", Role.OPERATOR)
    async with running_service(engine, sor_base_url=sor.url, console_http_basic=False) as svc:
        base = svc.url
        watcher = await log_in(browser, base, "watcher", PASSWORD)
        await watcher.goto(f"{base}/console/operations/{op_id}")
        await watcher.wait_for_selector("#op-live[data-connected='1']")
        await watcher.evaluate("window.__notReloaded = true")
        before = await watcher.locator("#history-rows tr").count()
        fixer = await log_in(browser, base, "fixer", PASSWORD)
        await fixer.goto(f"{base}/console/operations/{op_id}")
        form = fixer.locator("form[data-action='reconcile']")
        await form.locator("input[name=why]").fill("caller says the restaurant has it")
        await form.locator("button[type=submit]").click()
        await fixer.wait_for_selector(".flash")
        flash = await fixer.locator(".flash").inner_text()
        # The watcher's page follows without a reload.
        await js_true(
            watcher, "document.getElementById('op-status').textContent.trim() === 'committed'"
        )
        history = await watcher.locator("#history-rows").inner_text()
        facts = await watcher.locator(".facts").inner_text()
        ARTIFACTS.mkdir(exist_ok=True)
        await watcher.screenshot(path=str(ARTIFACTS / "console-operation.png"), full_page=True)
        not_reloaded = await watcher.evaluate("window.__notReloaded === true")
        after = await watcher.locator("#history-rows tr").count()
        await watcher.context.close()
        await fixer.context.close()

    assert flash == "Reconciled: committed."
    assert not_reloaded and after == before + 2
    assert "staff:fixer" in history
    assert "reconcile now: caller says the restaurant has it" in history
    assert "unknown → committed" in history
    assert made.reference is not None and made.reference in facts  # the SOR's reference


async def test_a_viewer_cannot_act_and_sees_phone_numbers_masked(
    engine: AsyncEngine, browser: Any
) -> None:
    call_id = await seed_call(engine, from_number="+15554443333")
    op_id = await seed_operation(engine, call_id, S.UNKNOWN, caller="+15554443333")
    await add_staff(engine, "vera", Role.VIEWER)
    async with running_service(engine, console_http_basic=False) as svc:
        base = svc.url
        page = await log_in(browser, base, "vera", PASSWORD)
        calls_text = await page.locator("table.calls").inner_text()
        await page.goto(f"{base}/console/operations/{op_id}")
        forms = await page.locator("form.action").count()
        note = await page.locator("#viewer-note").inner_text()
        op_text = await page.locator("main").inner_text()
        # Posting the form anyway (with the session's own CSRF token) is refused.
        csrf = await page.locator("form.who input[name=csrf_token]").get_attribute("value")
        forced = await page.request.post(
            f"{base}/console/operations/{op_id}/actions/reconcile",
            form={"csrf_token": csrf or "", "why": "let me"},
            max_redirects=0,
        )
        await page.context.close()
        async with engine.connect() as conn:
            status = (
                await conn.exec_driver_sql(
                    "SELECT status FROM operations WHERE operation_id = %(o)s", {"o": op_id}
                )
            ).scalar()

    assert "5554443333" not in calls_text and "•••••••••33" in calls_text
    assert "5554443333" not in op_text
    assert forms == 0 and "can look, not act" in note
    assert forced.status == 403
    assert status == "unknown"


async def test_a_logged_out_user_is_sent_to_the_login_page_and_back(
    engine: AsyncEngine, browser: Any
) -> None:
    await add_staff(engine, "olga", Role.OPERATOR)
    async with running_service(engine, console_http_basic=False) as svc:
        base = svc.url
        ctx = await browser.new_context()
        page = await ctx.new_page()
        page.set_default_timeout(WAIT_MS)
        await page.goto(f"{base}/console/operations?state=unknown")
        landed = page.url
        await page.fill("input[name=username]", "olga")
        await page.fill("input[name=password]", PASSWORD)
        await page.click("button[type=submit]")
        await page.wait_for_url(f"{base}/console/operations?state=unknown")
        await page.click("form.who button[type=submit]")  # log out
        await page.wait_for_url(f"{base}/console/login")
        await page.goto(f"{base}/console/calls")
        again = page.url
        cookies = await ctx.cookies()
        await ctx.close()

    assert landed.startswith(f"{base}/console/login?next=/console/operations")
    assert again.startswith(f"{base}/console/login?next=/console/calls")
    assert not [c for c in cookies if c["name"] == "va_session"]


async def test_a_forged_csrf_token_is_refused_and_changes_nothing(
    engine: AsyncEngine, browser: Any
) -> None:
    call_id = await seed_call(engine)
    op_id = await seed_operation(engine, call_id, S.UNKNOWN, tool="no_such_tool")
    await add_staff(engine, "oscar", Role.OPERATOR)
    async with running_service(engine, console_http_basic=False) as svc:
        base = svc.url
        page = await log_in(browser, base, "oscar", PASSWORD)
        await page.goto(f"{base}/console/operations/{op_id}")
        form = page.locator("form[data-action='record_outcome']")
        await form.locator("select[name=outcome]").select_option("failed_final")
        await form.locator("input[name=why]").fill("checked with the restaurant")
        await form.evaluate("f => { f.querySelector('input[name=csrf_token]').value = 'forged' }")
        async with page.expect_response(lambda r: r.request.method == "POST") as info:
            await form.locator("button[type=submit]").click()
        response = await info.value
        await page.context.close()
        async with engine.connect() as conn:
            status = (
                await conn.exec_driver_sql(
                    "SELECT status FROM operations WHERE operation_id = %(o)s", {"o": op_id}
                )
            ).scalar()
            trail = (
                await conn.exec_driver_sql(
                    "SELECT count(*) FROM operation_events WHERE operation_id = %(o)s",
                    {"o": op_id},
                )
            ).scalar()

    assert response.status == 403
    assert status == "unknown" and trail == 3  # admitted, running, unknown: nothing added


async def test_a_call_in_progress_updates_live_and_gets_its_player_when_it_ends(
    engine: AsyncEngine, browser: Any
) -> None:
    from app.calls.recording import CallRecorder
    from telephony.call_events import CallEvent, CallEventKind

    call_id = await seed_call(engine, status="in_progress")
    await add_staff(engine, "liv", Role.VIEWER)
    async with running_service(engine, console_http_basic=False) as svc:
        events = svc.runtime.events
        events.emit(CallEvent(call_id, CallEventKind.CALL_STARTED, {"from": "+15551230000"}))
        await events.flush()
        page = await log_in(browser, svc.url, "liv", PASSWORD)
        await page.goto(f"{svc.url}/console/calls/{call_id}")
        await page.wait_for_selector("#call-live[data-connected='1']")
        await page.evaluate("window.__notReloaded = true")
        no_player = await page.locator("#recording").count()
        events.emit(CallEvent(call_id, CallEventKind.CALLER_TRANSCRIPT, {"text": "Is it raining?"}))
        await page.wait_for_selector(".transcript li:has-text('Is it raining?')")
        live = await page.evaluate("window.__notReloaded === true")
        # The call ends; its recording is stored a moment later: the page gets its player.
        events.emit(CallEvent(call_id, CallEventKind.CALL_ENDED, {"reason": "hangup"}))
        await events.flush()
        recorder = CallRecorder("audio/pcmu", max_ms=60_000)
        recorder.caller_audio(b"\x00" * 8000, 0)
        await svc.runtime.console.recordings.save(call_id, recorder.render())
        await page.wait_for_selector("#recording", timeout=WAIT_MS)
        await page.context.close()
    assert no_player == 0 and live


_WATCH_CSP = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective} ${e.blockedURI} ${e.sourceFile}:${e.lineNumber}`);
});
"""


async def test_console_pages_and_live_refresh_run_under_the_csp_with_no_violation(
    engine: AsyncEngine, browser: Any
) -> None:
    """Every page under its Content-Security-Policy: nothing refused, the live sections still
    refresh (through the template, not innerHTML), and Trusted Types refuse innerHTML."""
    from tools import ledger

    call_id = await seed_call(engine, from_number="+15551230000")
    op_id = await seed_operation(engine, call_id, S.UNKNOWN, reference="BKCSP0001")
    await add_staff(engine, "csp", Role.ADMIN)
    async with running_service(engine, console_http_basic=False) as svc:
        base = svc.url
        page = await log_in(browser, base, "csp", PASSWORD)
        await page.context.add_init_script(_WATCH_CSP)
        seen: dict[str, list[str]] = {}
        for path in ("/console/tokens", "/console/staff", f"/console/calls/{call_id}"):
            await page.goto(f"{base}{path}")
            seen[path] = await page.evaluate("window.__csp")
        calls = await page.context.new_page()
        await calls.goto(f"{base}/console/calls")
        await calls.wait_for_selector("#calls-live[data-connected='1']")
        await page.goto(f"{base}/console/operations/{op_id}")
        await page.wait_for_selector("#op-live[data-connected='1']")
        async with engine.begin() as conn:  # the outcome arrives: both pages follow it live
            moved = await ledger.transition(
                conn, op_id, S.UNKNOWN, S.COMMITTED, actor="test", reason="csp test",
                provider_ref="BKCSP0001",
            )  # fmt: skip
        await js_true(
            page, "document.getElementById('op-status').textContent.trim() === 'committed'"
        )
        await js_true(calls, "Number(document.getElementById('calls-live').dataset.version) >= 1")
        seen["operation (live)"] = await page.evaluate("window.__csp")
        seen["calls (live)"] = await calls.evaluate("window.__csp")
        blocked = await page.evaluate(
            "() => { try { document.body.innerHTML = '<b>x</b>'; return 'written'; }"
            " catch (e) { return e.name; } }"
        )
        await page.context.close()
    assert moved is not None
    assert seen == {key: [] for key in seen}
    assert blocked == "TypeError"  # require-trusted-types-for 'script'


# Where an item is drawn, in ms on the timeline's axis: its left edge (a point drawn flipped
# has its mark at its right edge) along its track, scaled by the axis' duration.
DRAWN_MS = """(el) => {
  const box = el.getBoundingClientRect();
  const track = el.closest('.track').getBoundingClientRect();
  const duration = Number(el.closest('.lanes').dataset.durationMs);
  const x = el.classList.contains('flip') ? box.right : box.left;
  return (x - track.left) / track.width * duration;
}"""


async def test_a_booking_call_draws_the_readback_after_the_request_at_the_times_the_api_reports(
    demo_call: DemoCall, browser: Any
) -> None:
    base, call_id = demo_call.base, demo_call.call_id
    page = await log_in(browser, base, *CONSOLE, viewport={"width": 1400, "height": 1000})
    failed: list[str] = []
    page.on(
        "response",
        lambda r: failed.append(f"{r.status} {r.url}") if r.status >= 400 else None,
    )
    await page.goto(f"{base}/console/calls/{call_id}")
    await js_true(page, "document.querySelector('#call-live[data-connected]')")
    api = await (await page.request.get(f"{base}/api/calls/{call_id}/timeline")).json()
    readback = page.locator(".lane-agent .item[title*=': Please confirm']").first
    tool = page.locator(".lane-tools .item", has_text="book_table").first
    request = page.locator(".lane-caller .item[title*=': Lovely, please book it']").first
    drawn = {
        "readback": await readback.evaluate(DRAWN_MS),
        "tool": await tool.evaluate(DRAWN_MS),
        "request": await request.evaluate(DRAWN_MS),
    }
    # A browser asks every page for its icon (/favicon.ico when the page names none).
    icon = await page.locator("link[rel=icon]").get_attribute("href")
    icon_status = (await page.request.get(f"{base}{icon}")).status
    transcript = await page.locator(".transcript li .text").all_inner_texts()
    t_labels = await page.locator(".transcript li .t").all_inner_texts()
    # Every other console page: nothing it asks for is missing.
    op_id = next(op["operation_id"] for op in api["operations"])
    for path in ("/console/calls", "/console/operations", f"/console/operations/{op_id}"):
        await page.goto(f"{base}{path}")
        await page.wait_for_load_state("networkidle")
    await page.context.close()

    events = api["events"]
    said = next(
        e for e in events
        if e["kind"] == "agent_transcript" and e["data"]["text"].startswith("Please confirm")
    )  # fmt: skip
    asked = next(
        e for e in events if e["source"] == "tool_call" and e["data"]["tool"] == "book_table"
    )
    spoke = next(
        e for e in events
        if e["kind"] == "speech_started"
        and e["data"].get("turn_id") == next(
            t["data"].get("turn_id") for t in events
            if t["kind"] == "caller_transcript" and t["data"]["text"].startswith("Lovely")
        )
    )  # fmt: skip
    print(f"api: readback {said['t_ms']} ms, book_table {asked['t_ms']} ms, request "
          f"{spoke['t_ms']} ms; drawn {drawn}")  # fmt: skip
    assert abs(drawn["readback"] - said["t_ms"]) <= 20, (drawn, said)
    assert abs(drawn["tool"] - asked["t_ms"]) <= 20, (drawn, asked)
    assert abs(drawn["request"] - spoke["t_ms"]) <= 20, (drawn, spoke)
    # The readback begins once the model asked for the booking, which the caller asked for.
    assert drawn["request"] < drawn["tool"] < drawn["readback"], drawn
    # The model's request comes no later than when its tool call's row was written.
    the_call = next(
        e for e in events
        if e["kind"] == "function_call" and e["data"].get("name") == "book_table"
    )  # fmt: skip
    assert the_call["t_ms"] <= said["t_ms"], (the_call, said)
    request_line = next(i for i, t in enumerate(transcript) if t.startswith("Lovely"))
    readback_line = next(i for i, t in enumerate(transcript) if t.startswith("Please confirm"))
    assert request_line < readback_line, transcript
    assert all(e["t_ms"] >= 0 for e in events), [e for e in events if e["t_ms"] < 0]
    assert not any(label.startswith(("-", "\N{MINUS SIGN}")) for label in t_labels), t_labels
    assert not failed, failed
    assert icon_status == 200
