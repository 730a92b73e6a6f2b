"""The restaurant catalog: what the model sees, argument parsing, and result shaping."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tools.errors import InvalidArguments, UnknownTool
from tools.ledger import OperationRecord
from tools.registry import Registry, RetryPolicy, ToolKind, ToolSpec, _clean_schema
from tools.restaurant.catalog import restaurant_catalog
from tools.results import MAX_MESSAGE_CHARS, bounded, compact, operation_output, read_output
from tools.states import OperationStatus

S = OperationStatus


@pytest.fixture
def catalog() -> Registry:
    return restaurant_catalog()


def test_catalog_offers_the_restaurant_tools_with_realtime_definitions(catalog: Registry) -> None:
    defs = {d["name"]: d for d in catalog.definitions()}
    assert set(defs) == {
        "check_availability",
        "book_table",
        "cancel_booking",
        "get_booking",
        "confirm_operation",
        "verify_pin",
        "resolve_conflict",
    }
    book = defs["book_table"]
    assert book["type"] == "function"
    params = book["parameters"]
    assert params["type"] == "object"
    assert set(params["required"]) == {"date", "time", "party_size", "name"}
    assert params["additionalProperties"] is False
    assert "title" not in params and "title" not in params["properties"]["date"]
    assert params["properties"]["date"]["format"] == "date"


def test_descriptions_say_when_to_call_and_when_not(catalog: Registry) -> None:
    assert "never to check availability" in catalog.get("book_table").description
    assert "books nothing" in catalog.get("check_availability").description
    for spec in catalog:
        assert len(spec.description) > 60, spec.name


def test_tool_declarations_match_the_domain(catalog: Registry) -> None:
    book = catalog.get("book_table")
    assert book.kind is ToolKind.MUTATION and book.needs_confirmation
    # The demo SOR cannot withdraw a request in flight: a made booking is undone by the
    # compensating cancel_booking, which takes the booking id as its reference.
    assert book.provider_idempotent and not book.cancellable_at_provider
    assert book.compensated_by == "cancel_booking" and book.provider_action == "sor.book_table"
    assert catalog.get("cancel_booking").reference_arg == "booking_id"
    assert book.reconcile == "sor.lookup_by_key"
    cancel = catalog.get("cancel_booking")
    assert cancel.kind is ToolKind.MUTATION and cancel.needs_verification
    assert catalog.get("get_booking").kind is ToolKind.READ
    assert catalog.get("confirm_operation").kind is ToolKind.CONTROL


def test_unknown_tool_is_refused(catalog: Registry) -> None:
    with pytest.raises(UnknownTool):
        catalog.get("order_pizza")


@pytest.mark.parametrize(
    "raw",
    [
        "{not json",
        "[1, 2]",
        '{"date": "2026-12-05", "time": "9pm", "party_size": 4, "name": "Ada"}',
        '{"date": "2026-12-05", "time": "21:00", "party_size": 0, "name": "Ada"}',
        '{"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada", "vip": true}',
        '{"date": "2026-12-05", "time": "21:00", "party_size": 4}',
    ],
)
def test_bad_arguments_raise_a_speakable_invalid_arguments(catalog: Registry, raw: str) -> None:
    with pytest.raises(InvalidArguments) as err:
        catalog.get("book_table").parse(raw)
    assert str(err.value) and len(str(err.value)) < 300


def test_arguments_are_normalized(catalog: Registry) -> None:
    spec = catalog.get("book_table")
    args = spec.parse(
        '{"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "  Ada   Lovelace "}'
    )
    assert spec.normalize(args) == {
        "date": "2026-12-05",
        "time": "21:00",
        "party_size": 4,
        "name": "Ada Lovelace",
    }
    ref = catalog.get("cancel_booking").parse('{"booking_id": "bk 7qx2"}')
    assert ref.model_dump() == {"booking_id": "BK7QX2"}


def test_registry_refuses_dangling_compensation_and_duplicates() -> None:
    spec = restaurant_catalog().get("book_table")
    with pytest.raises(ValueError):
        Registry([spec]).check()
    with pytest.raises(ValueError):
        Registry([spec, spec])


def test_retry_backoff_grows_with_jitter_and_is_capped() -> None:
    import random

    policy = RetryPolicy(max_attempts=5, base_backoff_s=1.0, max_backoff_s=4.0, jitter=0.25)
    rng = random.Random(7)
    delays = [policy.backoff_s(n, rng) for n in (1, 2, 3, 4, 5)]
    assert 0.75 <= delays[0] <= 1.25 and 1.5 <= delays[1] <= 2.5
    assert all(d <= 5.0 for d in delays)


def test_only_idempotent_tools_may_retry(catalog: Registry) -> None:
    book = catalog.get("book_table")
    assert book.may_retry(1) and not book.may_retry(4)
    one_shot = ToolSpec(
        name="x",
        description="d",
        args_model=book.args_model,
        kind=ToolKind.MUTATION,
        provider_action="p",
        needs_confirmation=False,
        retry=RetryPolicy(max_attempts=5),
    )
    assert not one_shot.may_retry(1)


# --- result shaping -----------------------------------------------------------------------


def test_availability_is_compact_and_never_says_booked(catalog: Registry) -> None:
    out = read_output(
        catalog.get("check_availability"),
        {
            "date": "2026-12-05",
            "time": "21:00",
            "party_size": 4,
            "available": True,
            "seats_left": 12,
            "internal": {"x": [1] * 1000},
        },
    )
    assert out["available"] is True
    assert "booked" not in out["message"].lower().replace("nothing is booked", "")
    assert "internal" not in out


def test_missing_booking_is_said_plainly(catalog: Registry) -> None:
    out = read_output(catalog.get("get_booking"), {"found": False})
    assert out["status"] == "not_found"


def test_outputs_are_bounded() -> None:
    assert len(bounded("word " * 500)) <= MAX_MESSAGE_CHARS
    out = compact({f"k{i}": "x" * 1000 for i in range(50)})
    assert len(out) <= 8 and all(len(v) <= 120 for v in out.values())


def _op(status: OperationStatus, **over: Any) -> OperationRecord:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    base: dict[str, Any] = dict(
        operation_id=uuid.uuid4(),
        tenant_id="t",
        idempotency_key="k",
        key_source="derived",
        call_id="c",
        caller="+1",
        turn_id=1,
        tool="book_table",
        args={"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"},
        args_hash="h",
        resource=None,
        status=status,
        cancel_requested=False,
        attempts=1,
        deadline=None,
        expires_at=None,
        next_attempt_at=None,
        result=None,
        error=None,
        provider_ref=None,
        compensates_operation_id=None,
        readback=None,
        confirm_by=None,
        overflow=None,
        created_at=now,
        updated_at=now,
        committed_at=None,
        finished_at=None,
    )
    base.update(over)
    return OperationRecord(**base)


@pytest.mark.parametrize("status", [s for s in S if s is not S.COMMITTED])
def test_only_committed_is_ever_phrased_as_done(catalog: Registry, status: OperationStatus) -> None:
    msg = operation_output(catalog.get("book_table"), _op(status))["message"].lower()
    assert "booked" not in msg and "done and confirmed" not in msg
    assert "not" in msg or "cancelled" in msg or "could not" in msg


def test_committed_result_names_the_reference(catalog: Registry) -> None:
    out = operation_output(
        catalog.get("book_table"),
        _op(
            S.COMMITTED,
            provider_ref="BK7QX2MHN4",
            result={"id": "BK7QX2MHN4", "status": "confirmed"},
        ),
    )
    assert "confirmed by the restaurant" in out["message"] and out["reference"] == "BK7QX2MHN4"


class FakeClient:
    """Stands in for the SOR client under the provider's read hook."""

    async def check_availability(self, day: Any, time: str, party_size: int) -> Any:
        from tools.restaurant.protocol import Availability

        return Availability(
            date=day, time=time, party_size=party_size, available=False, seats_left=0
        )

    async def get_booking(self, booking_id: str) -> Any:
        return None


async def test_restaurant_reads_bind_read_actions_to_the_sor(catalog: Registry) -> None:
    from tools.restaurant.provider import SorProvider

    provider = SorProvider(FakeClient())  # type: ignore[arg-type]
    spec = catalog.get("check_availability")
    raw = await provider.read(
        spec, spec.parse('{"date": "2026-12-05", "time": "21:00", "party_size": 2}')
    )
    out = read_output(spec, raw)
    assert out["available"] is False and "No table is free" in out["message"]
    get = catalog.get("get_booking")
    missing = await provider.read(get, get.parse('{"booking_id": "BK1"}'))
    assert read_output(get, missing)["status"] == "not_found"


class _Odd(BaseModel):
    """Arguments whose schema JSON cannot give back exactly: a tuple default, a huge bound."""

    pair: tuple[int, int] = (1, 2)
    big: int = Field(default=0, le=2**70)


@pytest.mark.parametrize(
    "model", [_Odd, *[s.args_model for s in restaurant_catalog()._specs.values()]]
)
def test_a_tools_parameters_are_its_schema_and_each_definition_its_own_copy(
    model: type[BaseModel],
) -> None:
    spec = ToolSpec(name="t", description="d", kind=ToolKind.READ, args_model=model)
    first, second = spec.definition(), spec.definition()
    expected = _clean_schema(model.model_json_schema())
    assert first["parameters"] == expected and second["parameters"] == expected
    first["parameters"]["properties"].clear()
    assert spec.definition()["parameters"] == expected == second["parameters"]
