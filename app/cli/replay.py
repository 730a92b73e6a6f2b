"""`voice-agent replay CALL_ID`: rebuild a recorded call from its events and ledger rows, run it
again against the current code, and say whether the decisions came out the same.

The recording is read from the database (`--database-url`, else DATABASE_URL, else the embedded
PostgreSQL): the call's events (caller speech and transcripts, keypad, responses, function calls
and their outputs, what the agent said and how much of it was heard, announcements) and its
ledger rows (tool_calls with their admission decisions, operations with their transitions,
deliveries). From them a scenario of `voice-agent eval` (app/cli/eval_file.py) is rebuilt:

- the model: one step per response, in order, as the simulator consumes them: the same
  function calls with the same arguments (an operation id the previous output named, and the
  call's own today/tomorrow, become placeholders, so the replay names its own; arguments the
  ledger keeps redacted, a spoken PIN, become a placeholder, and the replay says so); what the
  agent said (a field of the latest function output, such as the readback, as that field; a
  late result as the engine's own note);
- the caller: the same lines (speech-like audio with the recorded transcript) and keys, each
  after the same amount of agent audio heard and the same silence after it, then the hangup;
- the provider: the demo system of record answering as recorded: its latency, a failure
  before commit per recorded retry, a lost answer for an outcome that went through `unknown`
  (the tool's deadline then shortened to 1 s, so the timeout comes quickly).

The scenario runs on the offline stack the eval runner brings up, in the same database (the
replayed call is a new call from the demo caller's number). Then the decisions of both calls
are printed side by side: each admission (admit / deny / confirm-needed ...), each operation's
end (with `reconciled` when it went through unknown, the retries), and what the caller was
told and by which channel. The verdict is `same`, or `changed` with the first differing
decision and both values. Exit status 0 same, 1 changed, 2 bad input (no such call, no
database, a call of another catalog). `--save PATH` writes the rebuilt scenario with the
recorded call's outcome as its expectations, so `voice-agent eval PATH` keeps it as a test.

Supported: calls of the restaurant catalog (what eval runs) on one agent; a call that used
other tools or handed off between agents is refused with a line that says so.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from sqlalchemy.exc import DBAPIError, OperationalError
from sqlalchemy.ext.asyncio import AsyncEngine

from app.cli.eval_file import CallerStep, EvalScenario, Expect, ProviderFaults
from app.cli.evals import NOISY_LOGGERS, run_scenario
from app.db import make_engine
from app.server import prepare_database
from app.settings import Settings
from telephony.sim.scenario import FunctionCallStep, Reply, Scenario, Step
from tools.control import CONFIRM_OPERATION, RESOLVE_CONFLICT, VERIFY_PIN
from tools.delivery_states import DeliveryState
from tools.restaurant.catalog import restaurant_tools
from tools.states import TERMINAL, OperationStatus

# Tools a restaurant call may use: the catalog's and the engine's control tools.
CONTROL_TOOLS = frozenset({CONFIRM_OPERATION, VERIFY_PIN, RESOLVE_CONFLICT, "transfer_call"})
# What a redacted argument is replayed with (the real one was never stored).
PLACEHOLDER_PIN = "0000"
# The recorded timeout is reproduced with this tool deadline (seconds), not the declared one.
TIMEOUT_DEADLINE_S = 1.0
MAX_PAUSE_S = 30.0
HANGUP_AFTER_S = 0.3
DECISION_NAMES = {
    "allow": "admit",
    "deny": "deny",
    "needs_confirmation": "confirm-needed",
    "needs_verification": "verify-needed",
}


class ReplayError(Exception):
    """Input the replay cannot work from: said as one line, exit status 2."""


@dataclass(frozen=True)
class Decision:
    """One decision of a call: what it is about and what was decided."""

    what: str
    value: str


@dataclass
class Recording:
    """A call's durable record: its events and ledger rows, in order."""

    call_id: str
    started_at: dt.datetime
    events: list[dict[str, Any]]
    tool_calls: list[dict[str, Any]]
    operations: list[dict[str, Any]]
    trails: dict[str, list[dict[str, Any]]]
    deliveries: dict[str, list[dict[str, Any]]]


@dataclass
class Rebuilt:
    """The scenario rebuilt from a recording, and what it could not reproduce exactly."""

    scenario: EvalScenario
    notes: list[str] = field(default_factory=list)


async def _rows(engine: AsyncEngine, sql: str, **params: Any) -> list[dict[str, Any]]:
    async with engine.connect() as conn:
        result = await conn.execute(sa.text(sql), params)
        return [dict(r) for r in result.mappings().all()]


async def load_recording(engine: AsyncEngine, call_id: str) -> Recording:
    """The call's events and ledger rows; ReplayError when there is no such call."""
    try:
        uuid.UUID(call_id)
    except ValueError:
        raise ReplayError(f"{call_id!r} is not a call id (a UUID, as the console shows)") from None
    calls = await _rows(engine, "SELECT id, created_at FROM calls WHERE id = :c", c=call_id)
    if not calls:
        raise ReplayError(f"no call {call_id} in this database")
    events = await _rows(
        engine,
        "SELECT seq, kind, at, data FROM call_events WHERE call_id = :c ORDER BY seq",
        c=call_id,
    )
    tool_calls = await _rows(
        engine, "SELECT * FROM tool_calls WHERE call_id = :c ORDER BY id", c=call_id
    )
    operations = await _rows(
        engine,
        "SELECT * FROM operations WHERE call_id = :c ORDER BY created_at, operation_id",
        c=call_id,
    )
    trails: dict[str, list[dict[str, Any]]] = {}
    deliveries: dict[str, list[dict[str, Any]]] = {}
    for op in operations:
        key = str(op["operation_id"])
        trails[key] = await _rows(
            engine,
            "SELECT from_status, to_status, at FROM operation_events "
            "WHERE operation_id = :o AND kind = 'transition' ORDER BY id",
            o=key,
        )
        deliveries[key] = await _rows(
            engine,
            "SELECT channel, state, outcome FROM deliveries WHERE operation_id = :o "
            "ORDER BY created_at",
            o=key,
        )
    started = events[0]["at"] if events else calls[0]["created_at"]
    return Recording(call_id, started, events, tool_calls, operations, trails, deliveries)


# --- the decisions ------------------------------------------------------------------------


def decisions_of(rec: Recording) -> list[Decision]:
    """The call's decisions in order: admissions, then each operation's end and its telling."""
    out: list[Decision] = []
    for index, row in enumerate(rec.tool_calls, start=1):
        decision = str(row["decision"])
        out.append(
            Decision(f"admission {index} {row['tool']}", DECISION_NAMES.get(decision, decision))
        )
    for index, op in enumerate(rec.operations, start=1):
        key = str(op["operation_id"])
        trail = [str(t["to_status"]) for t in rec.trails.get(key, [])]
        end = str(op["status"])
        if OperationStatus.UNKNOWN in trail:
            end += " (reconciled after unknown)"
        retries = trail.count(OperationStatus.FAILED_RETRYABLE)
        if retries:
            end += f" (after {retries} retr{'y' if retries == 1 else 'ies'})"
        out.append(Decision(f"operation {index} {op['tool']}", end))
        told = rec.deliveries.get(key, [])
        value = "; ".join(f"{d['outcome']} by {d['channel']}: {d['state']}" for d in told)
        out.append(Decision(f"told {index} {op['tool']}", value or "not told"))
    return out


def first_difference(
    recorded: list[Decision], replayed: list[Decision]
) -> tuple[int, Decision | None, Decision | None] | None:
    """Where the two lists first differ (index, recorded, replayed), None when the same."""
    for index in range(max(len(recorded), len(replayed))):
        a = recorded[index] if index < len(recorded) else None
        b = replayed[index] if index < len(replayed) else None
        if a != b:
            return index, a, b
    return None


def side_by_side(recorded: list[Decision], replayed: list[Decision]) -> list[str]:
    """The two calls' decisions as aligned lines, a `!` where they differ."""
    width = max((len(d.value) for d in recorded), default=8)
    width = max(width, len("recorded"))
    what_w = max((len(d.what) for d in [*recorded, *replayed]), default=8)
    lines = [f"  {'decision':<{what_w}}  {'recorded':<{width}}  replay"]
    for index in range(max(len(recorded), len(replayed))):
        a = recorded[index] if index < len(recorded) else None
        b = replayed[index] if index < len(replayed) else None
        what = (a or b).what if (a or b) is not None else ""  # type: ignore[union-attr]
        mark = " " if a == b else "!"
        left = a.value if a is not None else "-"
        right = b.value if b is not None else "-"
        if a is not None and b is not None and a.what != b.what:
            right = f"{b.what}: {b.value}"
        lines.append(f"{mark} {what:<{what_w}}  {left:<{width}}  {right}")
    return lines


# --- the rebuild --------------------------------------------------------------------------


def _escape(text: str) -> str:
    """A literal for the simulator's templates (`{` and `}` doubled)."""
    return text.replace("{", "{{").replace("}", "}}")


def _as_template(value: str, output: dict[str, Any] | None, day: dt.date) -> str:
    """`value` as the scenario should say it: a field of the latest output, a relative date,
    else the literal."""
    for key, field_value in (output or {}).items():
        if isinstance(field_value, str) and field_value and field_value == value:
            return "{output[" + key + "]}"
    if value == day.isoformat():
        return "{today}"
    if value == (day + dt.timedelta(days=1)).isoformat():
        return "{tomorrow}"
    return _escape(value)


def _template_args(args: Any, output: dict[str, Any] | None, day: dt.date) -> Any:
    if isinstance(args, str):
        return _as_template(args, output, day)
    if isinstance(args, dict):
        return {k: _template_args(v, output, day) for k, v in args.items()}
    if isinstance(args, list):
        return [_template_args(v, output, day) for v in args]
    return args


def _output_of(row: dict[str, Any] | None) -> dict[str, Any] | None:
    output = row.get("output") if row else None
    return output if isinstance(output, dict) else None


def _spoken_by_response(
    events: list[dict[str, Any]], notes: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """Each response's agent lines. Recent calls record the response on the line; older ones
    are matched by order (the earliest response before the line that has none yet)."""
    responses = [e for e in events if e["kind"] == "response_created"]
    spoken: dict[str, list[dict[str, Any]]] = {}
    guessed = False
    for event in events:
        if event["kind"] != "agent_transcript":
            continue
        data = event["data"]
        rid = data.get("response_id")
        if rid is None:
            earlier = [
                r["data"]["response_id"]
                for r in responses
                if r["seq"] < event["seq"] and r["data"]["response_id"] not in spoken
            ]
            rid = (earlier or [None])[0]
            guessed = True
        if rid is not None:
            spoken.setdefault(str(rid), []).append(data)
    if guessed:
        notes.append(
            "the call was recorded before agent lines named their response: lines are matched "
            "to responses by order, and a line may land on the wrong step"
        )
    return spoken


def _reply(lines: list[dict[str, Any]], text: str | None = None) -> Reply | None:
    if not lines:
        return None
    said = " ".join(str(d.get("full_text") or d.get("text") or "") for d in lines).strip()
    audio_ms = sum(int(d.get("audio_ms") or 0) for d in lines)
    if not (text or said):
        return None
    return Reply(text=text or _escape(said), audio_ms=min(max(audio_ms, 20), 120_000))


def _model(rec: Recording, notes: list[str]) -> Scenario:
    """The simulator's script: one step per response after the greeting, in order."""
    day = rec.started_at.astimezone(dt.UTC).date()
    tool_rows = {str(r["provider_call_id"]): r for r in rec.tool_calls}
    spoken = _spoken_by_response(rec.events, notes)
    calls: dict[str, list[dict[str, Any]]] = {}
    for e in rec.events:
        if e["kind"] == "function_call":
            calls.setdefault(str(e["data"].get("response_id")), []).append(e["data"])
    greeting: Reply | None = None
    steps: list[Step] = []
    latest_output: dict[str, Any] | None = None
    heard_transcript: str | None = None
    for e in rec.events:
        data = e["data"]
        if e["kind"] == "function_output":
            latest_output = _output_of(tool_rows.get(str(data.get("call_id"))))
        elif e["kind"] == "caller_transcript" and data.get("text"):
            heard_transcript = str(data["text"])
        elif e["kind"] == "response_created":
            rid = str(data.get("response_id"))
            lines = spoken.get(rid, [])
            if data.get("reason") == "greeting" and greeting is None and not steps:
                greeting = _reply(lines)
                continue
            said = " ".join(str(d.get("full_text") or d.get("text") or "") for d in lines)
            text: str | None = None
            if data.get("reason") == "late_result":
                text = "{note}"
            elif said.strip():
                text = _as_template(said.strip(), latest_output, day)
            made = calls.get(rid, [])
            function_call: FunctionCallStep | None = None
            if made:
                first = made[0]
                row = tool_rows.get(str(first.get("call_id")))
                raw = first.get("arguments")
                if row is not None and not (isinstance(raw, dict) and raw.get("redacted")):
                    raw = row["raw_arguments"]  # the event keeps 500 characters of them
                if isinstance(raw, dict) and raw.get("redacted"):
                    arguments: Any = {"digits": PLACEHOLDER_PIN}
                    notes.append(
                        f"{first.get('name')}'s arguments were redacted (a PIN): replayed "
                        f"with the placeholder {PLACEHOLDER_PIN!r}"
                    )
                else:
                    try:
                        arguments = json.loads(raw) if isinstance(raw, str) else raw or {}
                    except ValueError:
                        arguments = {}
                        notes.append(f"{first.get('name')}'s recorded arguments are not JSON")
                same = [c for c in made if c.get("name") == first.get("name")]
                if len(same) != len(made):
                    notes.append(
                        f"response {rid} made {len(made)} different calls; the replay makes "
                        f"the first ({first.get('name')}) only"
                    )
                function_call = FunctionCallStep(
                    name=str(first.get("name")),
                    arguments=_template_args(arguments, latest_output, day),
                    preamble=_reply(lines, text),
                    repeat=len(same),
                )
                steps.append(Step(caller_transcript=heard_transcript, function_call=function_call))
            else:
                reply = _reply(lines, text) or Reply(text="…", audio_ms=20)
                steps.append(Step(caller_transcript=heard_transcript, reply=reply))
            heard_transcript = None
    return Scenario(name=f"replay of {rec.call_id}", greeting=greeting, steps=steps)


@dataclass
class _Line:
    """An agent line as the caller heard it, on the wall clock."""

    start: dt.datetime
    end: dt.datetime
    left_ms: int  # heard, not yet counted before a caller action
    cut: bool


def _caller(rec: Recording, notes: list[str]) -> list[CallerStep]:
    """The caller's steps: each line or key after as much agent audio as was heard before it
    and the silence since, as recorded; then the hangup and the waits for what came after it.

    A line's event is written once it has played (or been cut), often after the caller began
    to speak over its end, so lines are placed by when they played, not by event order."""
    events = rec.events
    lines: list[_Line] = []
    for e in events:
        heard = int(e["data"].get("heard_ms") or 0) if e["kind"] == "agent_transcript" else 0
        if heard > 0:
            start = e["at"] - dt.timedelta(milliseconds=heard)
            lines.append(_Line(start, e["at"], heard, bool(e["data"].get("cut"))))
    steps: list[CallerStep] = []
    last_acted = rec.started_at

    def before_acting(at: dt.datetime, hanging_up: bool = False) -> None:
        heard_ms = 0
        quiet_since = last_acted
        last_cut = False
        for line in lines:
            if line.left_ms <= 0 or line.start >= at:
                continue
            if line.cut or line.end <= at:
                part = line.left_ms
            else:  # still playing when the caller acted
                part = min(line.left_ms, int((at - line.start).total_seconds() * 1000))
            heard_ms += part
            line.left_ms -= part
            quiet_since = max(quiet_since, min(line.end, at))
            last_cut = line.cut
        if heard_ms > 0:
            steps.append(CallerStep(hear_ms=min(heard_ms, 120_000)))
        gap = (at - quiet_since).total_seconds()
        if hanging_up and heard_ms > 0 and not last_cut:
            # `hear_ms` is met a frame early: let the line the caller heard to its end end
            # before hanging up, or the hangup would cut it.
            gap = max(gap, HANGUP_AFTER_S)
        if gap >= 0.1:
            steps.append(CallerStep(pause=round(min(gap, MAX_PAUSE_S), 2)))

    digits = ""
    for index, e in enumerate(events):
        kind, data, at = e["kind"], e["data"], e["at"]
        if kind != "dtmf" and digits:
            steps.append(CallerStep(keypad=digits))
            digits = ""
        if kind == "speech_started":
            line = next(
                (
                    str(x["data"].get("text") or "")
                    for x in events[index + 1 :]
                    if x["kind"] in ("caller_transcript", "speech_started")
                ),
                "",
            )
            if not line:
                notes.append("a caller utterance had no transcript: replayed as 'Mm.'")
            before_acting(at)
            steps.append(CallerStep(say=line or "Mm."))
            last_acted = at
        elif kind == "speech_stopped":
            last_acted = at
        elif kind == "dtmf":
            digit = str(data.get("digit") or "")
            if digit and digit in "0123456789*#ABCD":
                if not digits:
                    before_acting(at)
                digits += digit
                last_acted = at
            else:
                notes.append("a keypad digit was not recorded: left out")
        elif kind == "call_ended":
            before_acting(at, hanging_up=True)
            break
    steps.append(CallerStep(hangup=True))
    if rec.operations:
        last = rec.operations[-1]
        status = str(last["status"])
        if status in TERMINAL:
            steps.append(CallerStep(wait_operation=OperationStatus(status)))
        told = rec.deliveries.get(str(last["operation_id"]), [])
        if told and str(told[-1]["state"]) in ("heard", "texted", "not_needed", "failed"):
            steps.append(CallerStep(wait_delivery=DeliveryState(str(told[-1]["state"]))))
    return steps


def _provider(rec: Recording, notes: list[str]) -> tuple[ProviderFaults, float | None]:
    """The system of record's faults that make it answer as it did, and the tool deadline."""
    fail = lose = hang = 0
    latency = 0.0
    deadline: float | None = None
    for op in rec.operations:
        trail = rec.trails.get(str(op["operation_id"]), [])
        to = [str(t["to_status"]) for t in trail]
        if OperationStatus.RUNNING not in to:
            continue
        fail += to.count(OperationStatus.FAILED_RETRYABLE)
        if OperationStatus.UNKNOWN in to:
            deadline = TIMEOUT_DEADLINE_S
            if op["status"] == OperationStatus.COMMITTED:
                lose += 1
            else:
                hang += 1
        elif not latency:
            started = next((t["at"] for t in trail if t["to_status"] == "running"), None)
            ended = trail[-1]["at"]
            if started is not None and op["status"] in TERMINAL:
                latency = round(min(max((ended - started).total_seconds(), 0.0), 5.0), 1)
        if op["status"] == OperationStatus.FAILED_FINAL and OperationStatus.UNKNOWN not in to:
            notes.append(
                f"operation {op['operation_id']} failed for good at the provider; the stand-in "
                "does not refuse on cue, so the replay may commit it"
            )
    if deadline is not None:
        notes.append(
            f"a recorded timeout is reproduced with a {TIMEOUT_DEADLINE_S:g} s tool deadline "
            "and a provider that holds its answer"
        )
    faults = ProviderFaults(
        latency_s=latency, fail_before_commit=fail, lose_response=lose, hang=hang
    )
    return faults, deadline


def _expect(rec: Recording) -> Expect:
    """The recorded call's outcome, as a scenario's expectations."""
    kinds = [e["kind"] for e in rec.events]
    committed = [op["tool"] for op in rec.operations if op["status"] == "committed"]
    trail = (
        [str(t["to_status"]) for t in rec.trails.get(str(rec.operations[0]["operation_id"]), [])]
        if rec.operations
        else []
    )
    sms = sum(1 for told in rec.deliveries.values() for d in told if d["channel"] == "sms")
    return Expect.model_validate(
        {
            "operations": [str(op["status"]) for op in rec.operations],
            "transitions": trail or None,
            "bookings": committed.count("book_table"),
            "cancellations": committed.count("cancel_booking"),
            "announced": kinds.count("result_announced"),
            "sms": sms,
            "barge_ins": kinds.count("barge_in"),
        }
    )


def check_supported(rec: Recording) -> None:
    """ReplayError unless the call is one the replay can rebuild (restaurant tools, one agent)."""
    known = {spec.name for spec in restaurant_tools()} | CONTROL_TOOLS
    used = {str(r["tool"]) for r in rec.tool_calls} | {
        str(e["data"].get("name")) for e in rec.events if e["kind"] == "function_call"
    }
    other = sorted(used - known)
    if other:
        raise ReplayError(
            f"call {rec.call_id} used tools outside the restaurant catalog ({', '.join(other)}); "
            "replay supports the restaurant catalog only"
        )
    if any(e["kind"] == "agent_handoff" for e in rec.events):
        raise ReplayError(
            f"call {rec.call_id} handed off between agents; replay supports one agent only"
        )
    if not any(e["kind"] == "stream_started" for e in rec.events):
        raise ReplayError(f"call {rec.call_id} never streamed audio: nothing to replay")


def rebuild(rec: Recording) -> Rebuilt:
    """The eval scenario that plays the recorded call again."""
    notes: list[str] = []
    model = _model(rec, notes)
    caller = _caller(rec, notes)
    provider, deadline = _provider(rec, notes)
    ended = [e["at"] for e in rec.events if e["kind"] == "call_ended"]
    length = (ended[0] - rec.started_at).total_seconds() if ended else 60.0
    scenario = EvalScenario(
        name=f"replay of call {rec.call_id}",
        model=model,
        caller=caller,
        expect=_expect(rec),
        provider=provider,
        tool_deadline_s=deadline,
        timeout_s=min(max(60.0, length * 2 + 30), 900),
    )
    return Rebuilt(scenario, notes)


def scenario_yaml(rebuilt: Rebuilt, rec: Recording) -> str:
    """The scenario as a file `voice-agent eval` runs, with a header saying where it came from."""
    data = rebuilt.scenario.model_dump(mode="json", exclude_none=True, exclude_defaults=True)
    data["name"] = rebuilt.scenario.name
    data["caller"] = [
        step.kind
        if getattr(step, step.kind) is True
        else step.model_dump(mode="json", exclude_none=True)
        for step in rebuilt.scenario.caller
    ]
    data["expect"] = rebuilt.scenario.expect.model_dump(mode="json", exclude_none=True)
    for empty in ("hears", "hears_once", "never_hears"):
        if not data["expect"].get(empty):
            data["expect"].pop(empty, None)
    header = [
        f"# Rebuilt by `voice-agent replay {rec.call_id}` from the call recorded at "
        f"{rec.started_at.isoformat(timespec='seconds')}.",
        "# Expectations are what happened in that call. Run it: voice-agent eval THIS_FILE",
        *(f"# Note: {note}" for note in rebuilt.notes),
    ]
    body = yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=100)
    return "\n".join(header) + "\n" + body


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, "utf-8")


# --- the command --------------------------------------------------------------------------


async def replay(
    call_id: str, settings: Settings, database_url: str | None, save: Path | None, echo: Any
) -> int:
    """Rebuild, run and compare; 0 same, 1 changed. ReplayError for bad input."""
    settings = settings.model_copy(update={"database_url": database_url or settings.database_url})
    try:
        url = await prepare_database(settings)
    except (OperationalError, DBAPIError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReplayError(f"cannot reach the database: {first}") from None
    engine = make_engine(url, pool_size=2, max_overflow=2)
    try:
        try:
            rec = await load_recording(engine, call_id)
        except (OperationalError, DBAPIError) as exc:
            first = str(exc.orig or exc).strip().splitlines()[0]
            raise ReplayError(f"cannot read the database: {first}") from None
        check_supported(rec)
        rebuilt = rebuild(rec)
        recorded = decisions_of(rec)
        began = rec.started_at.isoformat(timespec="seconds")
        echo(f"replaying call {rec.call_id} (recorded {began})")
        for note in rebuilt.notes:
            echo(f"note: {note}")
        if save is not None:
            await asyncio.to_thread(_write, save, scenario_yaml(rebuilt, rec))
            echo(f"saved the scenario to {save} (voice-agent eval {save})")
        outcome = await run_scenario(rebuilt.scenario, save or Path("replay"), settings, url)
        replayed: list[Decision] = []
        if outcome.observed is not None and outcome.observed.call_id:
            again = await load_recording(engine, outcome.observed.call_id)
            replayed = decisions_of(again)
            echo(f"replay call {again.call_id}")
    finally:
        await engine.dispose()
    for line in side_by_side(recorded, replayed):
        echo(line)
    if not recorded and not replayed:
        echo("  (no tool call reached admission in either call)")
    for failure in outcome.failures:
        if "timed out" in failure or "broke" in failure or "did not" in failure:
            echo(f"note: {failure}")
    where = first_difference(recorded, replayed)
    if where is None:
        echo("same")
        return 0
    index, a, b = where
    left = f"{a.what}: {a.value}" if a else "nothing"
    right = f"{b.what}: {b.value}" if b else "nothing"
    echo(f"changed at decision {index + 1}: recorded {left}; replay {right}")
    return 1


def run_replay_command(
    call_id: str, save: str | None, database_url: str | None, settings: Settings
) -> int:
    """Entry point of `voice-agent replay`: 0 same, 1 changed, 2 bad input (one line)."""
    import logging

    for noisy in (*NOISY_LOGGERS, "twilio"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
    try:
        return asyncio.run(
            replay(
                call_id,
                settings,
                database_url,
                Path(save) if save else None,
                lambda line: print(line, flush=True),
            )
        )
    except ReplayError as exc:
        print(f"voice-agent replay: {exc}", file=sys.stderr)
        return 2
