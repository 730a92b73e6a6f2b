"""The demo SOR as a `Provider`: binds tool provider actions to SOR client calls."""

from __future__ import annotations

from pydantic import ValidationError

from tools.errors import ProviderError
from tools.ledger import OperationRecord
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import ToolSpec
from tools.restaurant.client import ProviderResult, SorClient, SorClientError
from tools.restaurant.protocol import BookingRequest

BOOK = "sor.book_table"
CANCEL = "sor.cancel_booking"


def _action_result(res: ProviderResult) -> ActionResult:
    return ActionResult(
        outcome=res.outcome,
        result=res.booking.model_dump(mode="json") if res.booking else None,
        reference=res.reference,
        error=res.error,
    )


class SorProvider:
    """Runs `sor.book_table` / `sor.cancel_booking` and answers key lookups."""

    def __init__(self, client: SorClient) -> None:
        self.client = client

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
