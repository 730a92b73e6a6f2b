"""The restaurant-booking tools: the demo domain's tools, their arguments and results.

`tools.restaurant.plugin.catalog` binds them to the demo system of record as a `Catalog`.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tools.control import control_tools
from tools.policy import date_within, int_at_most, not_blank, slot_in_future, time_between
from tools.registry import (
    ConcurrencyLimit,
    ConflictRule,
    Registry,
    RetryPolicy,
    ToolKind,
    ToolSpec,
)

HHMM = r"^([01]\d|2[0-3]):[0-5]\d$"

# Who confirms an outcome, as the caller hears it.
LABEL = "the restaurant"

# The persona the Realtime session starts with (the engine adds its call rules).
INSTRUCTIONS = (
    "You are a friendly, efficient phone assistant for a restaurant. You are speaking with a "
    "caller on the telephone, so keep every answer short and natural, one or two sentences, "
    "and never read out lists, markup or long numbers unless asked."
)

# Demo limits; a deployment passes its own to `restaurant_catalog`.
DEFAULT_LIMITS: Mapping[str, Any] = {
    "max_party_size": 8,
    "max_days_ahead": 60,
    "opening_hours": ("12:00", "22:00"),  # first and last seating
    "min_lead_minutes": 30,
}


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)


class CheckAvailabilityArgs(_Args):
    date: dt.date = Field(description="Day of the visit, YYYY-MM-DD.")
    time: str = Field(pattern=HHMM, description="Time of the visit, HH:MM on a 24-hour clock.")
    party_size: int = Field(ge=1, le=100, description="Number of guests.")


class BookTableArgs(CheckAvailabilityArgs):
    name: str = Field(min_length=1, max_length=80, description="Name for the booking.")

    @field_validator("name")
    @classmethod
    def _one_space(cls, v: str) -> str:
        return " ".join(v.split())


class BookingRefArgs(_Args):
    booking_id: str = Field(
        min_length=1, max_length=64, description="Booking reference, as the caller gave it."
    )

    @field_validator("booking_id")
    @classmethod
    def _upper(cls, v: str) -> str:
        return v.replace(" ", "").upper()


def _describe_slot(a: Any) -> str:
    people = "person" if a.party_size == 1 else "people"
    return f"a table for {a.party_size} {people} on {a.date:%A %d %B %Y} at {a.time}"


def _describe_booking(a: Any) -> str:
    return f"{_describe_slot(a)} under the name {a.name}"


def _describe_cancel(a: Any) -> str:
    return f"the cancellation of booking {a.booking_id}"


def _shape_availability(r: Mapping[str, Any]) -> dict[str, Any]:
    when = f"{r.get('date')} at {r.get('time')} for {r.get('party_size')}"
    if r.get("available"):
        msg = f"A table is free on {when}. Nothing is booked yet."
    else:
        msg = f"No table is free on {when}."
        alts = r.get("alternatives")
        if alts:
            msg += " Free times nearby: " + ", ".join(str(a) for a in list(alts)[:3]) + "."
    out: dict[str, Any] = {"status": "ok", "available": bool(r.get("available")), "message": msg}
    if r.get("alternatives"):
        out["alternatives"] = list(r["alternatives"])[:3]
    return out


def _shape_booking(r: Mapping[str, Any]) -> dict[str, Any]:
    if not r or r.get("found") is False:
        return {"status": "not_found", "message": "I couldn't find a booking with that reference."}
    state = r.get("status", "confirmed")
    return {
        "status": "ok",
        "booking_id": r.get("id"),
        "booking_status": state,
        "message": (
            f"Booking {r.get('id')}: {r.get('party_size')} people on {r.get('date')} at "
            f"{r.get('time')} under {r.get('name')}, {state}."
        ),
    }


def _shape_booking_ref(r: Mapping[str, Any]) -> dict[str, Any]:
    return {"status": "ok", "booking_id": r.get("id"), "booking_status": r.get("status")}


def restaurant_tools(
    *,
    limits: Mapping[str, Any] | None = None,
    booking_concurrency: ConcurrencyLimit | None = None,
) -> list[ToolSpec]:
    """The demo restaurant's tools. `booking_concurrency` caps bookings in flight per day."""
    lim = {**DEFAULT_LIMITS, **(limits or {})}
    slot_checks = (
        date_within("date"),
        slot_in_future("date", "time"),
        time_between("time"),
        int_at_most(
            "party_size",
            "max_party_size",
            "people",
            verb="book",
            beyond="For more, please contact the restaurant directly.",
        ),
    )
    tools = [
        ToolSpec(
            name="check_availability",
            description=(
                "Check whether a table is free for a date, time and party size. Call it "
                "when the caller asks about availability or before offering to book. It "
                "books nothing; never say a table is booked after calling it."
            ),
            args_model=CheckAvailabilityArgs,
            kind=ToolKind.READ,
            provider_action="sor.check_availability",
            limits=lim,
            preconditions=slot_checks,
            deadline_s=3.0,
            shape_result=_shape_availability,
            provider_label=LABEL,
        ),
        ToolSpec(
            name="book_table",
            description=(
                "Request a table booking. Call only after the caller clearly asked to "
                "book and gave date, time, party size and name; never to check "
                "availability. It does not book at once: it returns a readback you must "
                "read to the caller, then call confirm_operation with their answer."
            ),
            args_model=BookTableArgs,
            kind=ToolKind.MUTATION,
            provider_action="sor.book_table",
            provider_idempotent=True,
            needs_confirmation=True,
            needs_caller_id=True,
            limits=lim,
            preconditions=(*slot_checks, not_blank("name", "name for the booking")),
            deadline_s=10.0,
            retry=RetryPolicy(
                max_attempts=4, base_backoff_s=0.5, max_backoff_s=8.0, total_deadline_s=120.0
            ),
            reconcile="sor.lookup_by_key",
            # The demo SOR cannot withdraw a request in flight; a booking it made is undone
            # by cancel_booking (compensation).
            cancellable_at_provider=False,
            compensated_by="cancel_booking",
            concurrency=booking_concurrency,
            resource=lambda a: f"tables:{a.date}",
            describe=_describe_booking,
            shape_result=_shape_booking_ref,
            provider_label=LABEL,
            # A second booking by the same caller for the same day contradicts the first
            # (the caller changed 21:00 to 21:30): it waits, and the caller decides.
            conflicts=ConflictRule(
                key=lambda a: f"booking-day:{a.date}", what="a booking for the same day"
            ),
        ),
        ToolSpec(
            name="cancel_booking",
            description=(
                "Cancel an existing booking by its reference. Call only when the caller "
                "asks to cancel and gave the reference. Only the number that made the "
                "booking, or a caller who entered their PIN, may cancel."
            ),
            args_model=BookingRefArgs,
            kind=ToolKind.MUTATION,
            provider_action="sor.cancel_booking",
            provider_idempotent=True,
            # Sent once the caller is verified as the booking's owner: no readback.
            needs_confirmation=False,
            needs_verification=True,
            needs_caller_id=True,
            deadline_s=10.0,
            retry=RetryPolicy(max_attempts=4, base_backoff_s=0.5, max_backoff_s=8.0),
            reconcile="sor.lookup_by_key",
            resource=lambda a: f"booking:{a.booking_id}",
            reference_arg="booking_id",
            describe=_describe_cancel,
            shape_result=_shape_booking_ref,
            provider_label=LABEL,
        ),
        ToolSpec(
            name="get_booking",
            description=(
                "Look up a booking by its reference to tell the caller its details or "
                "status. Call when the caller asks about an existing booking. Changes "
                "nothing."
            ),
            args_model=BookingRefArgs,
            kind=ToolKind.READ,
            provider_action="sor.get_booking",
            deadline_s=3.0,
            shape_result=_shape_booking,
            provider_label=LABEL,
        ),
    ]
    return tools


def restaurant_catalog(
    *,
    limits: Mapping[str, Any] | None = None,
    booking_concurrency: ConcurrencyLimit | None = None,
) -> Registry:
    """The restaurant's tools plus the control tools they need, as the model is offered them."""
    tools = restaurant_tools(limits=limits, booking_concurrency=booking_concurrency)
    registry = Registry([*tools, *control_tools(tools)])
    registry.check()
    return registry
