"""Errors of the tool area: one root (`ToolError`) with a small tree under it."""

from __future__ import annotations


class ToolError(Exception):
    """Root of every tool-layer error. `retryable` says whether trying again may succeed."""

    retryable: bool = False

    def __init__(self, message: str = "", *, retryable: bool | None = None) -> None:
        super().__init__(message)
        if retryable is not None:
            self.retryable = retryable


class UnknownTool(ToolError):
    """The model named a tool the registry does not hold."""


class InvalidArguments(ToolError):
    """Arguments that are not JSON or do not fit the tool's argument model."""


class IllegalTransition(ToolError):
    """A status change the state machine forbids (a programming error, never retried)."""


class OperationNotFound(ToolError):
    """No operation with that id."""


class IdempotencyConflict(ToolError):
    """The same idempotency key arrived with different arguments: a conflict, not a merge."""


class ProviderError(ToolError):
    """The system of record refused or failed. `retryable` only when nothing happened there."""


class OutcomeUnknown(ToolError):
    """A mutation was sent and its outcome is not known (timeout, lost response)."""


class ToolTimeout(ToolError):
    """A read did not answer within its deadline."""

    retryable = True
