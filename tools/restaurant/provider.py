"""The demo SOR as a provider: binds the restaurant's provider actions to SOR client calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ValidationError

from tools.errors import ProviderError
from tools.ledger import OperationRecord
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import ToolSpec
from tools.restaurant.catalog import BookingRefArgs, CheckAvailabilityArgs
from tools.restaurant.client import ProviderResult, SorClient, SorClientError
from tools.restaurant.protocol import BookingRequest

BOOK = "sor.book_table"
CANCEL = "sor.cancel_booking"
CHECK_AVAILABILITY = "sor.check_availability"
GET_BOOKING = "sor.get_booking"


def _action_result(res: ProviderResult) -> ActionResult:
    return ActionResult(
        outcome=res.outcome,
        result=res.booking.model_dump(mode="json") if res.booking else None,
        reference=res.reference,
        error=res.error,
    )


class SorProvider:
    """Runs `sor.book_table` / `sor.cancel_booking`, answers key lookups and the two reads."""

    def __init__(self, client: SorClient) -> None:
        self.client = client

    async def aclose(self) -> None:
        await self.client.aclose()

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        action = spec.provider_action
        if action == CHECK_AVAILABILITY and isinstance(args, CheckAvailabilityArgs):
            found = await self.client.check_availability(args.date, args.time, args.party_size)
            return found.model_dump(mode="json")
        if action == GET_BOOKING and isinstance(args, BookingRefArgs):
            booking = await self.client.get_booking(args.booking_id)
            return booking.model_dump(mode="json") if booking is not None else {"found": False}
        raise ProviderError(f"no read bound for {action!r}")

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        action = spec.provider_action
        key = op.idempotency_key
        if action == BOOK:
            try:
                request = BookingRequest.model_validate(
                    {k: op.args.get(k) for k in ("date", "time", "party_size", "name")}
                )
            except ValidationError as exc:
                return ActionResult(
                    Outcome.failed_final, error=f"arguments the SOR cannot take: {exc}"
                )
            res = await self.client.book_table(
                key, request, callback_url=callback_url, timeout_s=timeout_s
            )
        elif action == CANCEL:
            booking_id = str(op.args.get("booking_id") or "")
            if not booking_id:
                return ActionResult(Outcome.failed_final, error="no booking_id to cancel")
            res = await self.client.cancel_booking(
                key, booking_id, callback_url=callback_url, timeout_s=timeout_s
            )
        else:
            return ActionResult(Outcome.failed_final, error=f"no provider action {action!r}")
        return _action_result(res)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        try:
            status = await self.client.key_status(op.idempotency_key)
        except SorClientError as exc:
            raise ProviderError(str(exc), retryable=True) from exc
        if status.state == "not_found":
            return Finding("not_found")
        if status.state == "in_progress":
            return Finding("in_progress")
        if status.result is not None:
            return Finding(
                "applied",
                result=status.result.model_dump(mode="json"),
                reference=status.result.id,
            )
        return Finding(
            "rejected", error=status.error.code if status.error else f"http_{status.status_code}"
        )
