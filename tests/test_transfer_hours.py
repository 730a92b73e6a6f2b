"""Transfer targets declared in a tools file (`transfers:`): each with its opening hours in its
own time zone and who may be put through. Outside the hours, or for a caller who has not proved
who they are, `transfer_call` is refused with what the agent can say (when it opens next) and
nothing reaches the leg; bad declarations are refused at their line."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from telephony.tool_gateway import FunctionCallRequest
from tests.cli_support import clean_env, error_lines, run_cli
from tests.test_agents_file import SHOP_TOOLS
from tests.test_gateway import (
    KNOWN_PHONE,
    PIN,
    CallerAnswers,
    Clock,
    FakeReads,
    TableQueue,
    ctx,
    jobs_table,  # noqa: F401 (a fixture)
)
from tools import ledger
from tools.catalog import CatalogError
from tools.gateway import ToolPipeline
from tools.identity import Account, StaticIdentityStore
from tools.restaurant.catalog import restaurant_catalog
from tools.tools_file import load_tools_text
from tools.transfers import OpenHours, TransferTarget, TransferTargetError, transfer_definition

NO_DATABASE = "postgresql://nobody@127.0.0.1:9/none"
SHOP = (
    SHOP_TOOLS
    + """\
transfers:
  front_desk:
    to: "+15550100009"
    hours: "mon-fri 09:00-17:00; sat 10:00-14:00"
    timezone: Europe/Rome
  accounts:
    to: sip:accounts@pbx.example
    who: verified
"""
)
ROME_WEDNESDAY_NOON = datetime(2026, 12, 2, 11, 0, tzinfo=UTC)  # 12:00 in Rome
ROME_SATURDAY_EVENING = datetime(2026, 12, 5, 19, 30, tzinfo=UTC)  # 20:30 in Rome


def test_hours_are_open_within_their_spans_in_their_own_time_zone() -> None:
    hours = OpenHours.parse("mon-fri 09:00-17:00; sat 10:00-14:00", "Europe/Rome")
    assert hours.is_open(ROME_WEDNESDAY_NOON)
    assert not hours.is_open(ROME_SATURDAY_EVENING)
    assert not hours.is_open(datetime(2026, 12, 2, 16, 0, tzinfo=UTC))  # 17:00 in Rome: closed
    opens = hours.next_opening(ROME_SATURDAY_EVENING)
    assert opens is not None and (opens.strftime("%a %H:%M"), opens.utcoffset()) == (
        "Mon 09:00",
        datetime(2026, 12, 7, 8, tzinfo=UTC).astimezone(opens.tzinfo).utcoffset(),
    )
    # A span past midnight belongs to the day it starts; a week's range can wrap (sat-sun).
    late = OpenHours.parse("fri 22:00-02:00; sat-sun 12:00-13:00")
    assert late.is_open(datetime(2026, 12, 4, 23, tzinfo=UTC))  # Friday 23:00
    assert late.is_open(datetime(2026, 12, 5, 1, 30, tzinfo=UTC))  # Saturday 01:30
    assert not late.is_open(datetime(2026, 12, 5, 2, 0, tzinfo=UTC))
    assert late.is_open(datetime(2026, 12, 6, 12, 30, tzinfo=UTC))  # Sunday


@pytest.mark.parametrize(
    ("text", "zone", "problem"),
    [
        ("weekdays 9-5", "UTC", "write days and times as"),
        ("mon-fri 09:00-25:00", "UTC", "out of range"),
        ("mon 09:00-09:00", "UTC", "the span is empty"),
        ("mon 09:00-17:00", "Mars/Olympus", "time zone 'Mars/Olympus' is unknown"),
    ],
)
def test_hours_that_cannot_be_read_are_refused_saying_how_to_write_them(
    text: str, zone: str, problem: str
) -> None:
    with pytest.raises(TransferTargetError, match=problem):
        OpenHours.parse(text, zone)


def test_a_tools_file_declares_targets_with_hours_and_who_and_the_model_is_told() -> None:
    catalog = load_tools_text(SHOP, source="shop.yaml", environ={})
    assert catalog.transfers is not None
    desk, accounts = catalog.transfers["front_desk"], catalog.transfers["accounts"]
    assert desk.destination == "+15550100009" and desk.hours is not None
    assert accounts.verified_only and accounts.hours is None
    definition = transfer_definition(catalog.transfers)
    assert definition["parameters"]["properties"]["target"]["enum"] == ["accounts", "front_desk"]
    assert "accounts: verified callers only" in definition["description"]
    assert (
        "front_desk: open mon-fri 09:00-17:00; sat 10:00-14:00 (Europe/Rome)"
        in (definition["description"])
    )


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        (('hours: "mon-fri 09:00-17:00; sat 10:00-14:00"', 'hours: "always"'),
         "shop.yaml:12: transfers.front_desk: hours 'always': write days and times as"),
        (("timezone: Europe/Rome", "timezone: Rome"),
         "shop.yaml:15: transfers.front_desk.timezone: time zone 'Rome' is unknown"),
        (("to: sip:accounts@pbx.example", "to: accounts"),
         "shop.yaml:17: transfers.accounts.to: 'accounts' is neither an E.164 number"),
        (("  accounts:", "  Accounts:"), "shop.yaml:16: transfers.Accounts: target name"),
        (("who: verified", "who: vip"), "shop.yaml:18: transfers.accounts.who: Input should be"),
    ],
    ids=["hours", "zone", "destination", "name", "who"],
)  # fmt: skip
def test_a_bad_transfer_declaration_is_refused_at_its_line(
    change: tuple[str, str], expected: str
) -> None:
    with pytest.raises(CatalogError) as exc:
        load_tools_text(SHOP.replace(*change), source="shop.yaml", environ={})
    assert expected in str(exc.value), str(exc.value)


async def test_tools_check_lists_the_targets_and_serve_refuses_targets_in_two_places(
    tmp_path: Path,
) -> None:
    shop = tmp_path / "shop.yaml"
    shop.write_text(SHOP)
    env = clean_env(DATABASE_URL=NO_DATABASE, TOOLS_FILE=str(shop))
    code, out, err = await run_cli("tools", "check", env=env, cwd=tmp_path)
    assert code == 0, err
    assert "transfer targets (tools file):" in out
    assert "  front_desk: +*******0009; open mon-fri 09:00-17:00; sat 10:00-14:00" in out
    assert "  accounts: sip:accounts@pbx.example; verified callers only" in out
    env["TRANSFER_TARGETS"] = "billing=+15550100010"
    code, _, err = await run_cli("tools", "check", env=env, cwd=tmp_path)
    assert code == 2, err
    (line,) = error_lines(err)
    assert "the tools file declares `transfers` too. Fix: name the targets in one place" in line


class Pipeline:
    def __init__(self, engine: AsyncEngine, targets: dict[str, TransferTarget]) -> None:
        self.clock = Clock()
        store = StaticIdentityStore(
            [Account("acc-2", "t1", frozenset({KNOWN_PHONE}), pin=PIN, name="Grace")]
        )
        self.pipe = ToolPipeline(
            engine, restaurant_catalog(), enqueue=TableQueue(), read_executor=FakeReads(),
            identities=store, clock=self.clock, transfers=targets,
        )  # fmt: skip
        self.n = 0

    async def call(self, call: str, phone: str, name: str, args: dict[str, str]) -> dict:  # type: ignore[type-arg]
        self.n += 1
        request = FunctionCallRequest(
            call_id=f"fc_{self.n}", name=name, arguments=json.dumps(args), item_id=f"i{self.n}",
            response_id=f"r{self.n}", turn_id=self.n, evidence=CallerAnswers(),
        )  # fmt: skip
        reply = await self.pipe.handle(ctx(call, phone), request)
        return {"output": reply.output, "transfer": reply.transfer}


async def test_a_transfer_outside_the_hours_or_for_an_unverified_caller_is_refused_unsent(
    engine: AsyncEngine,
    jobs_table: None,  # noqa: F811
) -> None:
    catalog = load_tools_text(SHOP, source="shop.yaml", environ={})
    assert catalog.transfers is not None
    p = Pipeline(engine, catalog.transfers)
    p.clock.now = ROME_SATURDAY_EVENING
    closed = await p.call("call-h1", "+15550001", "transfer_call",
                          {"target": "front_desk", "reason": "a complaint"})  # fmt: skip
    unverified = await p.call("call-h1", KNOWN_PHONE, "transfer_call",
                              {"target": "accounts", "reason": "an invoice"})  # fmt: skip
    p.clock.now = ROME_WEDNESDAY_NOON
    open_now = await p.call("call-h2", "+15550001", "transfer_call",
                            {"target": "front_desk", "reason": "a complaint"})  # fmt: skip
    # A caller who proved who they are (their PIN) may reach the verified-only target.
    await p.call("call-h3", KNOWN_PHONE, "verify_pin", {"digits": PIN})
    verified = await p.call("call-h3", KNOWN_PHONE, "transfer_call",
                            {"target": "accounts", "reason": "an invoice"})  # fmt: skip
    assert closed["transfer"] is None and closed["output"]["status"] == "denied"
    said = closed["output"]["message"]
    assert "Front desk is closed now. It opens Monday at 09:00 (Europe/Rome)." in said, said
    assert "Nothing was sent" in said
    assert unverified["transfer"] is None
    assert "Only callers who have confirmed who they are" in unverified["output"]["message"]
    assert open_now["transfer"] is not None and open_now["transfer"].target == "front_desk"
    assert verified["transfer"] is not None and verified["transfer"].target == "accounts"
    async with engine.connect() as conn:
        row = await ledger.get_tool_call(conn, "call-h1", "fc_1")
    assert row is not None and row.decision == "deny"
    assert row.decision_reason is not None and row.decision_reason.startswith("front_desk:")


async def test_a_call_back_is_arranged_for_when_the_target_opens_or_when_asked_and_said_only_then(
    engine: AsyncEngine, clean_db: str
) -> None:
    """`schedule_callback` admits a real outbound call (its row and its `place_call` operation,
    the job scheduled for then) in the tool call's transaction; the model is told the time only
    once it is arranged; a retried tool call arranges one; a withheld number arranges none."""
    import sqlalchemy as sa
    from prometheus_client import REGISTRY

    from app.ops.outbound import callback_scheduler
    from app.settings import Settings
    from tools.executor import make_app

    catalog = load_tools_text(SHOP, source="shop.yaml", environ={})
    assert catalog.transfers is not None
    jobs = make_app(clean_db, max_pool_size=1)
    p = Pipeline(engine, catalog.transfers)
    p.pipe.callbacks = callback_scheduler(Settings(), jobs)
    arranged_before = REGISTRY.get_sample_value("voice_agent_callbacks_arranged_total") or 0
    p.clock.now = ROME_SATURDAY_EVENING
    assert "schedule_callback" in [d["name"] for d in p.pipe.definitions()]
    args = {"reason": "a complaint about a bill", "target": "front_desk"}
    when_open = await p.call("call-c1", "+15550001", "schedule_callback", args)
    request = FunctionCallRequest(  # the same tool call delivered again
        call_id="fc_1", name="schedule_callback", arguments=json.dumps(args), item_id="i1",
        response_id="r1", turn_id=1, evidence=CallerAnswers(),
    )  # fmt: skip
    again = await p.pipe.handle(ctx("call-c1", "+15550001"), request)
    in_ten = await p.call("call-c2", "+15550002", "schedule_callback",
                          {"reason": "the caller is driving", "minutes_from_now": 10})  # fmt: skip
    no_time = await p.call("call-c3", "+15550003", "schedule_callback",
                           {"reason": "later", "target": "accounts"})  # fmt: skip
    withheld = await p.call("call-c4", "", "schedule_callback",
                            {"reason": "later", "minutes_from_now": 5})  # fmt: skip
    async with engine.connect() as conn:
        placed = (
            (
                await conn.execute(
                    sa.text(
                        "SELECT c.to_number, c.direction, c.outbound, o.tool, o.status, "
                        "j.scheduled_at FROM calls c JOIN operations o ON o.operation_id::text = "
                        "c.outbound->>'placing_operation_id' JOIN procrastinate_jobs j ON "
                        "j.args->>'operation_id' = o.operation_id::text ORDER BY c.created_at"
                    )
                )
            )
            .mappings()
            .all()
        )
    out = when_open["output"]
    assert out["status"] == "callback_scheduled"
    assert "arranged for Monday at 09:00 (Europe/Rome)" in out["message"]
    assert again.output["operation_id"] == out["operation_id"]  # one call back, not two
    assert in_ten["output"]["at"] == (ROME_SATURDAY_EVENING + timedelta(minutes=10)).isoformat()
    assert (
        no_time["output"]["status"] == "denied"
        and "when suits them" in (no_time["output"]["message"])
    )
    assert withheld["output"]["status"] == "denied" and "withheld" in withheld["output"]["message"]
    assert [(r["to_number"], r["direction"], r["tool"], r["status"]) for r in placed] == [
        ("+15550001", "outbound", "place_call", "admitted"),
        ("+15550002", "outbound", "place_call", "admitted"),
    ]
    monday_nine_rome = datetime(2026, 12, 7, 8, 0, tzinfo=UTC)
    assert placed[0]["scheduled_at"] == monday_nine_rome
    assert "They wanted front desk" in placed[0]["outbound"]["purpose"]
    assert placed[0]["outbound"]["asked_in_call"] == "call-c1"
    assert REGISTRY.get_sample_value("voice_agent_callbacks_arranged_total") == arranged_before + 2
