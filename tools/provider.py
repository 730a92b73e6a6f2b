"""What the executor asks of a provider (system of record), independent of any one SOR.

`perform` runs one attempt of an operation and names its outcome; `lookup` answers "what
happened to this operation's idempotency key", the only way an `unknown` is resolved.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol

from tools.ledger import OperationRecord
from tools.registry import ToolSpec


class Outcome(StrEnum):
    """How one provider attempt ended, as far as the caller can know."""

    committed = "committed"
    pending = "pending"  # accepted; the provider reports the outcome later (callback)
    failed_retryable = "failed_retryable"  # provably not applied
    failed_final = "failed_final"  # refused for good
    unknown = "unknown"  # sent, and the answer was lost


@dataclass(frozen=True, slots=True)
class ActionResult:
    """One attempt's outcome, with the provider's result when it gave one."""

    outcome: Outcome
    result: dict[str, Any] | None = None
    reference: str | None = None  # the provider's id for what it did (a booking id)
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Finding:
    """The provider's account of an idempotency key.

    `applied`: it happened (with its result); `rejected`: the provider answered it with a
    final refusal; `in_progress`: it may still happen; `not_found`: it never happened and
    is not in flight.
    """

    state: Literal["applied", "rejected", "in_progress", "not_found"]
    result: dict[str, Any] | None = None
    reference: str | None = None
    error: str | None = None


class Provider(Protocol):
    """A system of record the executor can act on and ask about."""

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        """One attempt of `op`, carrying its idempotency key. Never raises for outcomes."""
        ...

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        """What happened to `op.idempotency_key`. Raises `ToolError` when it cannot ask."""
        ...
