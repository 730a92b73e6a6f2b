"""What the engine asks of a provider (system of record), independent of any one SOR.

`perform` runs one attempt of an operation and names its outcome; `lookup` answers "what
happened to this operation's idempotency key", the only way an `unknown` is resolved; `read`
answers a read tool inline; `cancel` (optional) asks the provider to withdraw a request it
has not settled. A catalog (`tools.catalog.Catalog`) names its providers, and each tool names
the provider it runs on (`provider_action="<provider>.<action>"`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel

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


@runtime_checkable
class Provider(Protocol):
    """A system of record the executor can act on and ask about (the mutation hooks)."""

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


@runtime_checkable
class ReadProvider(Protocol):
    """A system of record that answers read tools inline (the pipeline's read hook)."""

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        """The raw answer to a read; `spec.shape_result` makes it speakable. Raises
        `ToolError` (or any error) when it cannot answer: the caller hears "couldn't check"."""
        ...


@runtime_checkable
class CancellingProvider(Protocol):
    """A system of record that can withdraw a request it has not settled yet (optional)."""

    async def cancel(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float
    ) -> ActionResult:
        """Ask the provider to withdraw `op` (by its idempotency key). `committed` means the
        provider confirmed the withdrawal (nothing was or will be done); `failed_final` means
        it refused (it is done, or will be); anything else leaves the outcome to the provider."""
        ...


@runtime_checkable
class ClosingProvider(Protocol):
    """A provider holding resources (connections) the process closes at shutdown."""

    async def aclose(self) -> None: ...
