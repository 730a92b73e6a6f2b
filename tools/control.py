"""Control tools: handled by the pipeline itself, offered to the model beside any catalog.

`confirm_operation` carries the caller's answer to a readback; `verify_pin` carries a PIN the
caller spoke aloud. They are the engine's, not a domain's: every catalog whose tools need
confirmation or verification gets them.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from tools.registry import ToolKind, ToolSpec

CONFIRM_OPERATION = "confirm_operation"
VERIFY_PIN = "verify_pin"
CONTROL_TOOL_NAMES = frozenset({CONFIRM_OPERATION, VERIFY_PIN})


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


def control_tools(specs: Iterable[ToolSpec]) -> list[ToolSpec]:
    """The control tools a set of domain tools needs (none when nothing asks for them)."""
    specs = list(specs)
    out: list[ToolSpec] = []
    if any(s.needs_confirmation for s in specs):
        out.append(CONFIRM_OPERATION_SPEC)
    if any(s.needs_verification for s in specs):
        out.append(VERIFY_PIN_SPEC)
    return out
