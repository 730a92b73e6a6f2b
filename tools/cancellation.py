"""Cancelling an operation: a request, confirmed only by the provider.

Nothing sent yet (awaiting confirmation, admitted, failed and waiting to retry): the
operation is cancelled at once. Already sent (`running`, `unknown`): the cancel is marked,
and when the tool is `cancellable_at_provider` its provider's `cancel` hook is asked to
withdraw the request; only the provider's confirmation moves it to `cancelled`. Otherwise
the outcome decides, and a commit that lands anyway is undone by compensation (a new
operation), as the worker, the reconciler and the callback already do for a marked cancel.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.ext.asyncio import AsyncEngine

from tools import ledger
from tools.errors import OperationNotFound, ToolError
from tools.ledger import OperationRecord
from tools.provider import ActionResult, CancellingProvider, Outcome
from tools.registry import Registry
from tools.states import OperationStatus

S = OperationStatus
log = logging.getLogger(__name__)


async def request_cancel(
    engine: AsyncEngine,
    registry: Registry,
    provider: object,
    operation_id: uuid.UUID,
    *,
    actor: str,
    reason: str,
) -> OperationRecord:
    """Cancel `operation_id` as far as the truth allows; returns where it stands after."""
    async with engine.begin() as conn:
        op = await ledger.request_cancel(conn, operation_id, actor=actor, reason=reason)
    if op.status not in (S.RUNNING, S.UNKNOWN):
        return op  # cancelled now (nothing was sent), or already final
    spec = registry.get(op.tool)
    if not spec.cancellable_at_provider or not isinstance(provider, CancellingProvider):
        return op  # the outcome decides; a commit is compensated
    try:
        answer = await provider.cancel(op, spec, timeout_s=spec.deadline_s)
    except ToolError as exc:
        answer = ActionResult(Outcome.unknown, error=f"provider error: {exc}")
    async with engine.begin() as conn:
        current = await ledger.get_operation(conn, operation_id, for_update=True)
        if current is None:
            raise OperationNotFound(f"no operation {operation_id}")
        if answer.outcome is Outcome.committed and current.status in (S.RUNNING, S.UNKNOWN):
            moved = await ledger.transition(
                conn,
                operation_id,
                (S.RUNNING, S.UNKNOWN),
                S.CANCELLED,
                actor=actor,
                reason="the provider confirmed the cancel: nothing was or will be done",
                data={"cancel": answer.outcome.value},
            )
            return moved or current
        if answer.outcome is Outcome.committed and current.status is S.CANCELLED:
            # The attempt in flight answered first (withdrawn, so the worker cancelled it).
            await ledger.record_event(
                conn,
                operation_id,
                kind="note",
                actor=actor,
                reason="the provider confirmed the cancel",
                data={"cancel": answer.outcome.value},
            )
            return current
        await ledger.record_event(
            conn,
            operation_id,
            kind="note",
            actor=actor,
            reason=(
                f"the provider did not confirm the cancel ({answer.outcome.value}); the "
                "outcome decides, and a commit is compensated"
            ),
            data={"cancel": answer.outcome.value, "error": answer.error},
        )
        return current
