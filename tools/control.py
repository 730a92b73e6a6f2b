"""Control tools: handled by the pipeline itself, offered to the model beside any catalog.

`confirm_operation` carries the caller's answer to a readback; `verify_pin` carries a PIN the
caller spoke aloud; `resolve_conflict` carries the caller's choice about a request that
contradicts an earlier one. They are the engine's, not a domain's: every catalog whose tools
need confirmation, verification or declare conflicts gets them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from tools.registry import ToolKind, ToolSpec

CONFIRM_OPERATION = "confirm_operation"
VERIFY_PIN = "verify_pin"
RESOLVE_CONFLICT = "resolve_conflict"
HANDOFF_TO_AGENT = "handoff_to_agent"
CONTROL_TOOL_NAMES = frozenset({CONFIRM_OPERATION, VERIFY_PIN, RESOLVE_CONFLICT, HANDOFF_TO_AGENT})


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)


class ConfirmOperationArgs(_Args):
    operation_id: uuid.UUID = Field(description="The operation_id from the pending request.")
    confirmed: bool = Field(description="true if the caller said yes, false if they said no.")


class VerifyPinArgs(_Args):
    digits: str = Field(
        min_length=1, max_length=40, description="The PIN digits exactly as the caller said."
    )


CONFIRM_OPERATION_SPEC = ToolSpec(
    name=CONFIRM_OPERATION,
    description=(
        "Report the caller's answer to a readback. Call right after reading a "
        "readback and hearing yes (confirmed true) or no (confirmed false). "
        "Never call it without the caller's explicit answer."
    ),
    args_model=ConfirmOperationArgs,
    kind=ToolKind.CONTROL,
)

VERIFY_PIN_SPEC = ToolSpec(
    name=VERIFY_PIN,
    description=(
        "Check the PIN the caller spoke aloud. Call only after a tool asked for "
        "verification and the caller said their digits; keypad entry needs no call."
    ),
    args_model=VerifyPinArgs,
    kind=ToolKind.CONTROL,
    redact_arguments=True,
)


class ResolveConflictArgs(_Args):
    operation_id: uuid.UUID = Field(
        description="The operation_id of the newer request that is waiting on the earlier one."
    )
    choice: Literal["move", "keep_both", "drop"] = Field(
        description=(
            "move: undo the earlier one and make the newer one; keep_both: make the newer "
            "one too; drop: keep only the earlier one."
        )
    )


RESOLVE_CONFLICT_SPEC = ToolSpec(
    name=RESOLVE_CONFLICT,
    description=(
        "Carry out the caller's choice about a request that contradicts an earlier one, once "
        "you were told the earlier one's outcome and asked them. Call only with their "
        "explicit answer: move it, keep both, or leave it as it is (drop the newer one)."
    ),
    args_model=ResolveConflictArgs,
    kind=ToolKind.CONTROL,
)


class HandoffArgs(_Args):
    agent: str = Field(
        min_length=1, max_length=40, description="The agent to hand the caller to (by name)."
    )
    reason: str = Field(
        min_length=1, max_length=300, description="Why, in a few words (the new agent reads it)."
    )


HANDOFF_SPEC = ToolSpec(
    name=HANDOFF_TO_AGENT,
    description=(
        "Hand the caller to another agent of this business when what they want is that "
        "agent's job (its name is in the list below). Tell the caller in one short sentence "
        "first; requests already under way go on and their results reach the new agent."
    ),
    args_model=HandoffArgs,
    kind=ToolKind.CONTROL,
)


def control_tools(specs: Iterable[ToolSpec]) -> list[ToolSpec]:
    """The control tools a set of domain tools needs (none when nothing asks for them)."""
    specs = list(specs)
    out: list[ToolSpec] = []
    if any(s.needs_confirmation for s in specs):
        out.append(CONFIRM_OPERATION_SPEC)
    if any(s.needs_verification for s in specs):
        out.append(VERIFY_PIN_SPEC)
    if any(s.conflicts is not None for s in specs):
        out.append(RESOLVE_CONFLICT_SPEC)
    return out
