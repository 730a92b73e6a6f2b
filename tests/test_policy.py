"""Each policy rule on its own, then the engine's ordering. Pure: no database."""

from __future__ import annotations

from datetime import UTC, date, datetime, timedelta
from typing import Any

import pytest

from tools.identity import CallerIdentity
from tools.policy import (
    LedgerFacts,
    Outcome,
    PolicyConfig,
    PolicyInput,
    evaluate,
    rule_admission_deadline,
    rule_caller_allowed,
    rule_concurrency,
    rule_confirmation,
    rule_frequency,
    rule_preconditions,
    rule_tool_permitted,
    rule_verification,
)
from tools.registry import ConcurrencyLimit, OverflowPolicy
from tools.restaurant.catalog import (
    BookingRefArgs,
    BookTableArgs,
    CheckAvailabilityArgs,
    restaurant_catalog,
)

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
CALLER = CallerIdentity(phone="+15550001")
KNOWN = CallerIdentity(phone="+15550002", account_id="acc-2", role="customer")


def book(**over: Any) -> BookTableArgs:
    data: dict[str, Any] = {"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"}
    data.update(over)
    return BookTableArgs.model_validate(data)


def make(
    tool: str = "book_table",
    args: Any = None,
    *,
    identity: CallerIdentity = CALLER,
    facts: LedgerFacts | None = None,
    config: PolicyConfig | None = None,
    concurrency: ConcurrencyLimit | None = None,
    **extra: Any,
) -> PolicyInput:
    spec = restaurant_catalog(booking_concurrency=concurrency).get(tool)
    if args is None:
        args = {
            "book_table": book(),
            "check_availability": CheckAvailabilityArgs(
                date=date(2026, 12, 5), time="21:00", party_size=4
            ),
            "cancel_booking": BookingRefArgs(booking_id="BK1"),
            "get_booking": BookingRefArgs(booking_id="BK1"),
        }[tool]
    return PolicyInput(
        tenant_id="t1",
        call_id="call-1",
        identity=identity,
        spec=spec,
        args=args,
        facts=facts or LedgerFacts(),
        now=NOW,
        config=config or PolicyConfig(),
        **extra,
    )


# --- permission ---------------------------------------------------------------------------


def test_tenant_that_does_not_offer_a_tool_denies_it() -> None:
    cfg = PolicyConfig(tenant_tools={"t1": frozenset({"check_availability"})})
    d = rule_tool_permitted(make(config=cfg))
    assert d is not None and d.outcome is Outcome.DENY and d.reason
    assert rule_tool_permitted(make("check_availability", config=cfg)) is None


def test_tool_restricted_to_a_role_denies_other_callers() -> None:
    cfg = PolicyConfig(tool_roles={"book_table": frozenset({"staff"})})
    assert rule_tool_permitted(make(identity=KNOWN, config=cfg)) is not None
    staff = CallerIdentity(phone="+1", account_id="s", role="staff")
    assert rule_tool_permitted(make(identity=staff, config=cfg)) is None


# --- caller -------------------------------------------------------------------------------


def test_withheld_number_is_denied_a_tool_that_needs_caller_id() -> None:
    d = rule_caller_allowed(make(identity=CallerIdentity(phone="anonymous")))
    assert d is not None and d.outcome is Outcome.DENY
    assert "withheld" in d.reason
    # A read does not need a caller ID.
    assert rule_caller_allowed(make("check_availability", identity=CallerIdentity(None))) is None


def test_blocked_number_is_denied() -> None:
    cfg = PolicyConfig(blocked_callers=frozenset({"+15550001"}))
    d = rule_caller_allowed(make(config=cfg))
    assert d is not None and d.outcome is Outcome.DENY


# --- verification -------------------------------------------------------------------------


def test_verification_asks_a_known_caller_for_a_pin() -> None:
    d = rule_verification(make("cancel_booking", identity=KNOWN))
    assert d is not None and d.outcome is Outcome.NEEDS_VERIFICATION
    assert d.prompt and "PIN" in d.prompt


def test_verification_denies_an_unknown_caller_with_a_speakable_reason() -> None:
    d = rule_verification(make("cancel_booking", identity=CALLER))
    assert d is not None and d.outcome is Outcome.DENY
    assert "PIN" in d.reason and len(d.reason) < 200


def test_verification_passes_for_a_verified_caller_or_the_owner() -> None:
    verified = CallerIdentity(phone="+15550002", account_id="acc-2", verified=True)
    assert rule_verification(make("cancel_booking", identity=verified)) is None
    owner = make("cancel_booking", identity=CALLER, facts=LedgerFacts(caller_owns_target=True))
    assert rule_verification(owner) is None


def test_verification_is_locked_after_too_many_wrong_pins() -> None:
    locked = CallerIdentity(phone="+15550002", account_id="acc-2", locked=True)
    d = rule_verification(make("cancel_booking", identity=locked))
    assert d is not None and d.outcome is Outcome.DENY and "PIN" in d.reason


def test_tools_without_verification_skip_the_rule() -> None:
    assert rule_verification(make("book_table")) is None


# --- preconditions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("over", "needle"),
    [
        ({"date": "2026-11-30"}, "passed"),
        ({"date": "2027-06-01"}, "days ahead"),
        ({"date": "2026-12-01", "time": "12:10"}, "too soon"),
        ({"time": "23:30"}, "between"),
        ({"time": "09:00"}, "between"),
        ({"party_size": 30}, "at most 8"),
    ],
)
def test_schema_valid_arguments_can_still_fail_preconditions(
    over: dict[str, Any], needle: str
) -> None:
    d = rule_preconditions(make(args=book(**over)))
    assert d is not None and d.outcome is Outcome.DENY
    assert needle in d.reason


def test_good_arguments_pass_preconditions() -> None:
    assert rule_preconditions(make()) is None


def test_party_size_limit_comes_from_the_catalog_limits() -> None:
    spec = restaurant_catalog(limits={"max_party_size": 40}).get("book_table")
    inp = make(args=book(party_size=30))
    assert rule_preconditions(inp.with_(spec=spec)) is None


# --- frequency ----------------------------------------------------------------------------


def test_caller_over_the_mutation_rate_is_denied() -> None:
    cfg = PolicyConfig(max_mutations_per_caller=3)
    assert rule_frequency(make(config=cfg, facts=LedgerFacts(caller_recent_mutations=2))) is None
    d = rule_frequency(make(config=cfg, facts=LedgerFacts(caller_recent_mutations=3)))
    assert d is not None and d.outcome is Outcome.DENY


def test_tenant_over_the_mutation_rate_is_denied() -> None:
    cfg = PolicyConfig(max_mutations_per_tenant=10)
    d = rule_frequency(make(config=cfg, facts=LedgerFacts(tenant_recent_mutations=10)))
    assert d is not None and d.outcome is Outcome.DENY


def test_frequency_limits_do_not_apply_to_reads() -> None:
    cfg = PolicyConfig(max_mutations_per_caller=0)
    assert rule_frequency(make("check_availability", config=cfg)) is None


# --- concurrency and overflow -------------------------------------------------------------


def _busy(limit: ConcurrencyLimit, n: int) -> PolicyInput:
    return make(concurrency=limit, facts=LedgerFacts(in_flight_on_resource=n))


def test_under_the_concurrency_limit_nothing_is_said() -> None:
    assert rule_concurrency(_busy(ConcurrencyLimit(2), 1)) is None


def test_overflow_reject_denies() -> None:
    d = rule_concurrency(_busy(ConcurrencyLimit(2, OverflowPolicy.REJECT), 2))
    assert d is not None and d.outcome is Outcome.DENY and "try again" in d.reason


def test_overflow_queue_admits_up_to_the_queue_then_denies() -> None:
    limit = ConcurrencyLimit(2, OverflowPolicy.QUEUE, max_queued=1)
    d = rule_concurrency(_busy(limit, 2))
    assert d is not None and d.outcome is Outcome.ALLOW and d.overflow is OverflowPolicy.QUEUE
    full = rule_concurrency(_busy(limit, 3))
    assert full is not None and full.outcome is Outcome.DENY


def test_overflow_degrade_admits_with_a_text_message_promise() -> None:
    d = rule_concurrency(_busy(ConcurrencyLimit(1, OverflowPolicy.DEGRADE), 5))
    assert d is not None and d.outcome is Outcome.ALLOW and d.overflow is OverflowPolicy.DEGRADE


# --- deadline and confirmation ------------------------------------------------------------


def test_confirmation_after_its_window_is_denied() -> None:
    late = make(admit_by=NOW - timedelta(seconds=1))
    d = rule_admission_deadline(late)
    assert d is not None and d.outcome is Outcome.DENY
    assert rule_admission_deadline(make(admit_by=NOW + timedelta(seconds=1))) is None


def test_confirmation_rule_gives_the_exact_readback() -> None:
    d = rule_confirmation(make())
    assert d is not None and d.outcome is Outcome.NEEDS_CONFIRMATION
    assert d.readback == (
        "Please confirm: a table for 4 people on Saturday 05 December 2026 at 21:00 under "
        "the name Ada. Say yes to confirm."
    )
    assert rule_confirmation(make(confirmed=True)) is None


# --- the engine ---------------------------------------------------------------------------


def test_engine_first_refusal_wins_in_rule_order() -> None:
    d = evaluate(make(args=book(party_size=30), identity=CallerIdentity(phone="anonymous")))
    assert d.rule == "caller_allowed"


def test_engine_asks_for_confirmation_when_everything_else_passes() -> None:
    assert evaluate(make()).outcome is Outcome.NEEDS_CONFIRMATION
    assert evaluate(make(confirmed=True)).outcome is Outcome.ALLOW


def test_engine_carries_the_overflow_through_confirmation() -> None:
    inp = make(
        concurrency=ConcurrencyLimit(1, OverflowPolicy.DEGRADE),
        facts=LedgerFacts(in_flight_on_resource=1),
    )
    assert evaluate(inp).overflow is OverflowPolicy.DEGRADE
    confirmed = evaluate(inp.with_(confirmed=True))
    assert confirmed.outcome is Outcome.ALLOW and confirmed.overflow is OverflowPolicy.DEGRADE


def test_engine_denies_a_schema_valid_call() -> None:
    # party_size 30 fits the schema (<= 100) but not the restaurant's limit.
    d = evaluate(make(args=book(party_size=30)))
    assert d.outcome is Outcome.DENY and d.rule == "preconditions"


# --- caller verification state ------------------------------------------------------------


def _verifier() -> Any:
    from tools.identity import Account, CallerVerification

    acc = Account("acc-2", "t1", frozenset({"+15550002"}), pin="4321")
    return CallerVerification("+15550002", acc, max_attempts=3)


def test_keypad_pin_submits_itself_at_full_length() -> None:
    from tools.identity import PinOutcome

    v = _verifier()
    assert [v.feed_dtmf(d) for d in "432"] == [PinOutcome.INCOMPLETE] * 3
    assert v.feed_dtmf("1") is PinOutcome.VERIFIED
    assert v.snapshot().verified and v.snapshot().known


def test_keypad_star_starts_over_and_hash_submits_early() -> None:
    from tools.identity import PinOutcome

    v = _verifier()
    v.feed_dtmf("9")
    v.feed_dtmf("*")
    assert v.feed_dtmf("4") is PinOutcome.INCOMPLETE
    assert v.feed_dtmf("#") is PinOutcome.WRONG
    assert v.snapshot().failed_attempts == 1 and not v.snapshot().verified


def test_spoken_digits_are_understood() -> None:
    from tools.identity import spoken_digits

    assert spoken_digits("four three two one") == "4321"
    assert spoken_digits("4 3-2, one") == "4321"
    assert spoken_digits("oh nine") == "09"


def test_three_wrong_pins_lock_even_the_right_one() -> None:
    from tools.identity import PinOutcome

    v = _verifier()
    assert [v.submit("0000") for _ in range(3)] == [
        PinOutcome.WRONG,
        PinOutcome.WRONG,
        PinOutcome.LOCKED,
    ]
    assert v.submit("4321") is PinOutcome.LOCKED and v.snapshot().locked


async def test_identity_store_knows_registered_numbers_only() -> None:
    from tools.identity import Account, StaticIdentityStore

    store = StaticIdentityStore([Account("a", "t1", frozenset({"+1555"}), pin="1")])
    assert (await store.lookup("t1", "+1555")) is not None
    assert await store.lookup("t2", "+1555") is None
    assert await store.lookup("t1", "anonymous") is None


async def test_the_mutation_limits_come_from_the_settings(engine: Any, clean_db: str) -> None:
    from app.settings import Settings
    from app.tool_wiring import build_tools, load_configured_catalog

    settings = Settings(
        database_url=clean_db, max_mutations_per_caller=2, max_mutations_per_tenant=7
    )
    catalog = load_configured_catalog(settings)
    try:
        wiring = build_tools(settings, engine, clean_db, catalog)
        policy = wiring.pipeline._policy
    finally:
        await catalog.aclose()
    assert (policy.max_mutations_per_caller, policy.max_mutations_per_tenant) == (2, 7)
    with pytest.raises(ValueError, match="greater than or equal to 1"):
        Settings(max_mutations_per_tenant=0)
