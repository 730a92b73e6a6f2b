"""`voice-agent eval FILE.yaml…`: run scenario files (app/cli/eval_file.py) as calls on the
offline stack and check what came of each.

Each scenario gets its own stack, as `voice-agent demo` builds it: the database (DATABASE_URL,
else the embedded PostgreSQL), the Realtime simulator playing the file's `model` script, the
demo system of record with the file's `provider` faults, the service with its in-process worker
and sweeper, the fake Twilio REST API, and a fake Twilio caller doing the file's `caller` steps.
The caller's lines are speech-like audio as long as the line; the scripted model takes its
steps' `caller_transcript` as what it heard, so a run is the same every time. Afterwards the
durable state is read back (the call's operations and their transitions, deliveries, events),
with the side effects at the system of record (only this call's idempotency keys) and what the
caller heard (the agent's transcript as played, cut where a barge-in cut it).

One line per scenario: PASS, or FAIL with each failed expectation and its actual value. Exit
status 0 when all pass, 1 when one fails, 2 when a file is not a scenario. `--junit PATH`
writes a JUnit XML report.

Of the ten races (tests/races/), two are written in this format and pass:
barge_in_before_admitted (tests/scenarios/barge_in_before_admitted.yaml) and
timeout_after_mutation_sent (tests/scenarios/timeout_reconciled.yaml). The format can also say
barge_in_after_running (`faults: {executor.claimed: hold}`, the caller speaks, `release`) and the
idempotent half of retry_with_and_without_provider_idempotency (`provider: {fail_before_commit:
1}`), not yet written as files. The others need what a file cannot say yet: duplicate signed
callbacks, a Realtime socket dropped mid-call, a second agent, a killed process, two concurrent
calls, a provider without idempotency keys, a database outage, or (for
late_result_after_intent_change) checks on the compensation chosen.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from pydantic import SecretStr
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli.demo_harness import WAIT_S, demo_caller_number, free_socket
from app.cli.eval_file import CallerStep, EvalFileError, EvalScenario, load_eval
from app.main import create_app
from app.server import ServiceServer, prepare_database, uvicorn_config
from app.settings import Settings
from telephony.sim.fake_caller import FakeTwilioCaller
from telephony.sim.fake_twilio_api import FakeTwilioApi
from telephony.sim.simulator import RealtimeSimulator
from tools import faults
from tools.catalog import Catalog, CatalogContext
from tools.registry import ToolKind
from tools.restaurant import plugin
from tools.restaurant.sor import Faults, SystemOfRecord

# How long the agent must send nothing before `listen` counts it as done speaking.
QUIET_S = 0.5
FRAME_MS = 20
NOISY_LOGGERS = (
    "httpx",
    "websockets",
    "telephony",
    "uvicorn",
    "alembic",
    "procrastinate",
    "app",
    "tools",
)


@dataclass
class Observed:
    """What came of one call, read back after it ended."""

    operations: list[str] = field(default_factory=list)
    transitions: list[str] = field(default_factory=list)
    bookings: int = 0
    cancellations: int = 0
    announced: int = 0
    sms: int = 0
    barge_ins: int = 0
    heard: list[str] = field(default_factory=list)
    # The call's row id (replay reads its decisions back from it).
    call_id: str = ""


@dataclass
class Outcome:
    """One scenario's result."""

    name: str
    file: Path
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)
    observed: Observed | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def line(self) -> str:
        if self.passed and self.observed is not None:
            o = self.observed
            return (
                f"PASS {self.name} ({self.seconds:.1f} s): operations={o.operations} | "
                f"bookings={o.bookings} | announced={o.announced} | sms={o.sms} | "
                f"heard={len(o.heard)} lines"
            )
        return f"FAIL {self.name} ({self.seconds:.1f} s): " + "; ".join(self.failures)


def check(expect: Any, observed: Observed) -> list[str]:
    """Each expectation the observed call does not meet, with the actual value."""
    failures: list[str] = []
    for name in (
        "operations",
        "transitions",
        "bookings",
        "cancellations",
        "announced",
        "sms",
        "barge_ins",
    ):
        wanted = getattr(expect, name)
        if wanted is None:
            continue
        actual = getattr(observed, name)
        if isinstance(wanted, list):
            wanted = [str(w) for w in wanted]
        if wanted != actual:
            failures.append(f"expected {name} = {wanted}, got {actual}")
    heard = [line.lower() for line in observed.heard]

    def times(phrase: str) -> int:
        return sum(line.count(phrase.lower()) for line in heard)

    said = " / ".join(f'"{line}"' for line in observed.heard) or "nothing"
    for phrase in expect.hears:
        if times(phrase) == 0:
            failures.append(f"expected to hear {phrase!r}; heard {said}")
    for phrase in expect.hears_once:
        if (n := times(phrase)) != 1:
            failures.append(f"expected to hear {phrase!r} once, heard it {n} times: {said}")
    for phrase in expect.never_hears:
        if (n := times(phrase)) != 0:
            failures.append(f"expected never to hear {phrase!r}, heard it {n} times: {said}")
    return failures


def _shortened(catalog: Catalog, deadline_s: float | None) -> Catalog:
    """The catalog with its mutations' deadline set to `deadline_s` (None: as declared)."""
    if deadline_s is None:
        return catalog
    tools = [
        replace(t, deadline_s=deadline_s) if t.kind is ToolKind.MUTATION else t
        for t in catalog.tools
    ]
    return Catalog(
        tools, catalog.providers, name=catalog.name, instructions=catalog.instructions
    ).checked()


async def _rows(engine: AsyncEngine, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(sa.text(sql), params)
        return [dict(r) for r in result.mappings().all()]


async def _operations(engine: AsyncEngine, call_id: uuid.UUID) -> list[dict[str, Any]]:
    return await _rows(
        engine, "SELECT * FROM operations WHERE call_id = :c ORDER BY created_at", c=str(call_id)
    )


async def _heard(engine: AsyncEngine, call_id: uuid.UUID) -> list[str]:
    rows = await _rows(
        engine,
        "SELECT data FROM call_events WHERE call_id = :c AND kind = 'agent_transcript' "
        "ORDER BY seq",
        c=call_id,
    )
    return [str(r["data"].get("text", "")) for r in rows]


async def _until(
    predicate: Callable[[], Awaitable[bool]],
    what: str,
    timeout: float = WAIT_S,  # noqa: ASYNC109
) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not reached within {timeout:.0f} s")
        await asyncio.sleep(0.05)


class _Call:
    """A scenario's call on its running stack: the caller's steps, then the read-back."""

    def __init__(
        self,
        scenario: EvalScenario,
        caller: FakeTwilioCaller,
        engine: AsyncEngine,
        sor: SystemOfRecord,
        gates: dict[str, faults.Gate],
    ) -> None:
        self.scenario = scenario
        self.caller = caller
        self.engine = engine
        self.sor = sor
        self.gates = gates
        self.call_id: uuid.UUID | None = None
        # Agent audio heard when the caller last acted; `listen` waits for more than this.
        self.mark_ms = 0.0

    async def _call_id(self) -> uuid.UUID:
        if self.call_id is None:
            rows = await _rows(
                self.engine, "SELECT id FROM calls WHERE call_sid = :s", s=self.caller.call_sid
            )
            if not rows:
                raise TimeoutError("the call has no row")
            self.call_id = uuid.UUID(str(rows[0]["id"]))
        return self.call_id

    async def _latest_operation(self) -> dict[str, Any] | None:
        ops = await _operations(self.engine, await self._call_id())
        return ops[-1] if ops else None

    async def step(self, step: CallerStep) -> None:
        caller = self.caller
        match step.kind:
            case "say":
                assert step.say is not None
                await caller.say(step.say)
                self.mark_ms = caller.heard_ms
            case "keypad":
                assert step.keypad is not None
                for digit in step.keypad:
                    await caller.send_dtmf(digit)
                    await caller.play_silence(100)
                self.mark_ms = caller.heard_ms
            case "listen":
                await self._listen()
            case "hear":
                assert step.hear is not None
                phrase = step.hear.lower()

                async def heard() -> bool:
                    lines = await _heard(self.engine, await self._call_id())
                    return any(phrase in line.lower() for line in lines)

                await _until(heard, f"hearing {step.hear!r}")
            case "hear_ms":
                assert step.hear_ms is not None
                target = caller.heard_ms + step.hear_ms
                await caller.wait_for(lambda c: c.heard_ms >= target - FRAME_MS, WAIT_S)
            case "pause":
                assert step.pause is not None
                await caller.play_silence(step.pause * 1000)
            case "wait_operation":

                async def reached() -> bool:
                    op = await self._latest_operation()
                    return op is not None and op["status"] == step.wait_operation

                await _until(reached, f"operation {step.wait_operation}")
            case "wait_delivery":

                async def delivered() -> bool:
                    op = await self._latest_operation()
                    if op is None:
                        return False
                    rows = await _rows(
                        self.engine,
                        "SELECT state FROM deliveries WHERE operation_id = :o",
                        o=op["operation_id"],
                    )
                    return bool(rows) and rows[0]["state"] == step.wait_delivery

                await _until(delivered, f"delivery {step.wait_delivery}")
            case "wait_fault":
                assert step.wait_fault is not None
                await asyncio.wait_for(self.gates[step.wait_fault].reached.wait(), WAIT_S)
            case "release":
                assert step.release is not None
                self.gates[step.release].open()
            case "release_provider":
                self.sor.release()
            case "hangup":
                await caller.hangup()

    async def _listen(self) -> None:
        """Until the agent has spoken since the caller last acted, and then gone quiet."""
        caller = self.caller
        since = self.mark_ms
        await caller.wait_for(lambda c: c.heard_ms > since + FRAME_MS, WAIT_S)
        async with asyncio.timeout(WAIT_S):
            while True:
                await caller.wait_for(lambda c: c.buffered_ms == 0, WAIT_S)
                received = caller.media_received_bytes
                await asyncio.sleep(QUIET_S)
                if caller.media_received_bytes == received and caller.buffered_ms == 0:
                    break
        self.mark_ms = caller.heard_ms

    async def observe(self, api: FakeTwilioApi) -> Observed:
        call_id = await self._call_id()
        ops = await _operations(self.engine, call_id)
        observed = Observed(operations=[str(o["status"]) for o in ops], call_id=str(call_id))
        if ops:
            trail = await _rows(
                self.engine,
                "SELECT to_status FROM operation_events WHERE operation_id = :o "
                "AND kind = 'transition' ORDER BY id",
                o=ops[0]["operation_id"],
            )
            observed.transitions = [str(t["to_status"]) for t in trail]
            keys = [str(o["idempotency_key"]) for o in ops]
            effects = await self.sor.side_effects(idempotency_keys=keys)
            observed.bookings = effects.bookings_inserted
            observed.cancellations = effects.cancellations
        kinds = [
            r["kind"]
            for r in await _rows(
                self.engine, "SELECT kind FROM call_events WHERE call_id = :c", c=call_id
            )
        ]
        observed.announced = kinds.count("result_announced")
        observed.barge_ins = kinds.count("barge_in")
        observed.sms = len(api.created_messages())
        observed.heard = await _heard(self.engine, call_id)
        return observed


async def run_scenario(scenario: EvalScenario, file: Path, settings: Settings, url: str) -> Outcome:
    """Run one scenario on a stack of its own; never raises for what the call did."""
    outcome = Outcome(scenario.name, file)
    began = time.monotonic()
    secret = secrets.token_hex(16)
    sock = free_socket()
    port = sock.getsockname()[1]
    gates = {point: faults.Gate(most_s=scenario.timeout_s) for point in scenario.faults}
    async with AsyncExitStack() as stack:
        for point, gate in gates.items():
            stack.enter_context(faults.armed(point, gate))
        sim = await stack.enter_async_context(RealtimeSimulator(scenario.model))
        api = await stack.enter_async_context(FakeTwilioApi())
        sor = SystemOfRecord(
            url,
            host="127.0.0.1",
            faults=Faults.model_validate(scenario.provider.model_dump()),
            callback_secret=secret,
            seats_per_slot=100_000,
        )
        await sor.start()
        stack.push_async_callback(sor.stop)
        stack.callback(sor.release)  # a held answer must not outlive the scenario
        for gate in gates.values():
            stack.callback(gate.open)
        catalog = _shortened(
            plugin.catalog(CatalogContext(sor_base_url=sor.url)), scenario.tool_deadline_s
        )
        stack.push_async_callback(catalog.aclose)
        run_settings = settings.model_copy(
            update={
                "database_url": url,
                "openai_api_key": None,
                "openai_base_url": sim.base_url,
                "twilio_api_base_url": api.base_url,
                "twilio_account_sid": api.account_sid,
                "twilio_auth_token": SecretStr(api.auth_token),
                "public_base_url": f"http://127.0.0.1:{port}",
                "host": "127.0.0.1",
                "port": port,
                "sor_base_url": sor.url,
                "sor_callback_secret": SecretStr(secret),
                "sweep_interval_s": 0.5,
                "tools": None,
                "tools_file": None,
            }
        )
        app = create_app(run_settings, with_worker=True, catalog=catalog)
        server = ServiceServer(
            uvicorn_config(app, run_settings, log_level="warning", access_log=False)
        )
        serving = asyncio.create_task(server.serve(sockets=[sock]), name="eval-server")

        async def stop_server() -> None:
            server.should_exit = True
            await serving
            sock.close()

        stack.push_async_callback(stop_server)
        async with asyncio.timeout(30):
            while not server.started:
                if serving.done():
                    serving.result()
                    outcome.failures.append("the service did not start")
                    return outcome
                await asyncio.sleep(0.02)
        caller = FakeTwilioCaller(
            run_settings.public_base_url,
            auth_token=api.auth_token,
            account_sid=api.account_sid,
            from_number=demo_caller_number(),
        )
        api.attach(caller)
        runtime = app.state.runtime
        call = _Call(scenario, caller, runtime.engine, sor, gates)
        try:
            async with asyncio.timeout(scenario.timeout_s):
                await caller.dial()
                for index, step in enumerate(scenario.caller, start=1):
                    try:
                        await call.step(step)
                    except TimeoutError as exc:
                        detail = f": {exc}" if str(exc) else ""
                        outcome.failures.append(
                            f"caller step {index} ({step.describe()}) timed out{detail}"
                        )
                        break
        except TimeoutError:
            outcome.failures.append(f"the scenario took longer than {scenario.timeout_s:.0f} s")
        finally:
            if not caller.closed:
                await caller.hangup()
            await caller.aclose()
        for gate in gates.values():
            gate.open()
        sor.release()
        entry = runtime.registry.get(caller.call_sid)
        if entry is not None:
            try:
                async with asyncio.timeout(WAIT_S):
                    await entry.done.wait()
            except TimeoutError:
                outcome.failures.append("the call did not end after the caller hung up")
        await runtime.events.flush()
        try:
            outcome.observed = await call.observe(api)
        except TimeoutError as exc:
            outcome.failures.append(str(exc))
    if outcome.observed is not None:
        outcome.failures.extend(check(scenario.expect, outcome.observed))
    outcome.seconds = time.monotonic() - began
    return outcome


def write_junit(outcomes: list[Outcome], path: Path) -> None:
    """A JUnit XML report: one testsuite, one testcase per scenario."""
    failed = sum(not o.passed for o in outcomes)
    suite = ET.Element(
        "testsuite",
        name="voice-agent eval",
        tests=str(len(outcomes)),
        failures=str(failed),
        errors="0",
        time=f"{sum(o.seconds for o in outcomes):.3f}",
    )
    for outcome in outcomes:
        case = ET.SubElement(
            suite,
            "testcase",
            classname=outcome.file.stem,
            name=outcome.name,
            file=str(outcome.file),
            time=f"{outcome.seconds:.3f}",
        )
        if outcome.failures:
            failure = ET.SubElement(case, "failure", message=outcome.failures[0])
            failure.text = "\n".join(outcome.failures)
        else:
            ET.SubElement(case, "system-out").text = outcome.line()
    ET.ElementTree(suite).write(path, encoding="utf-8", xml_declaration=True)


async def run_evals(
    files: list[Path], settings: Settings, junit: Path | None, echo: Callable[[str], None]
) -> int:
    scenarios: list[tuple[Path, EvalScenario]] = []
    problems: list[str] = []
    for file in files:
        try:
            scenarios.append((file, load_eval(file)))
        except EvalFileError as exc:
            problems.append(str(exc))
    if problems:
        raise EvalFileError("\n".join(problems))
    url = await prepare_database(settings)
    outcomes: list[Outcome] = []
    for file, scenario in scenarios:
        try:
            outcome = await run_scenario(scenario, file, settings, url)
        except Exception as exc:  # a broken stack fails the scenario, not the whole run
            logging.getLogger(__name__).debug("scenario %s crashed", scenario.name, exc_info=True)
            outcome = Outcome(scenario.name, file, failures=[f"the run broke: {exc!r}"])
        echo(outcome.line())
        outcomes.append(outcome)
    failed = sum(not o.passed for o in outcomes)
    echo(f"{len(outcomes) - failed} passed, {failed} failed")
    if junit is not None:
        write_junit(outcomes, junit)
    return 1 if failed else 0


def run_eval_command(files: list[str], junit: str | None, settings: Settings) -> int:
    """Entry point of `voice-agent eval`: 0 all passed, 1 one failed, 2 a bad file."""
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return asyncio.run(
            run_evals(
                [Path(f) for f in files],
                settings,
                Path(junit) if junit else None,
                lambda line: print(line, flush=True),
            )
        )
    except EvalFileError as exc:
        for line in str(exc).splitlines():
            print(f"voice-agent eval: {line}", file=sys.stderr)
        return 2
