"""Speakable results: compact, bounded, and truthful about state.

Every output the model receives is a small dict with a `status` and a `message` it can
say in its own words. A request that is admitted but not confirmed by the system of
record is never phrased as done.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import ValidationError

from tools.ledger import OperationRecord
from tools.registry import OnUnknown, OverflowPolicy, ToolSpec
from tools.states import OperationStatus

S = OperationStatus

MAX_MESSAGE_CHARS = 300
MAX_VALUE_CHARS = 120
MAX_FIELDS = 8


def bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """Cut at a word boundary with an ellipsis: never a wall of text for the caller."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[: limit - 1].rsplit(" ", 1)[0]
    return cut + "…"


# Result fields the engine itself speaks through (what happened, what to say, which
# operation): a provider's field of the same name is renamed, never allowed to overwrite them.
ENGINE_FIELDS = frozenset(
    {"status", "message", "operation_id", "retryable", "rule", "readback", "error"}
)
PROVIDER_PREFIX = "provider_"


def provider_key(key: str) -> str:
    """A provider's field name as a result carries it (engine field names are prefixed)."""
    return PROVIDER_PREFIX + key if key in ENGINE_FIELDS else key


def compact(data: Mapping[str, Any]) -> dict[str, Any]:
    """A few scalar fields, each short; nested structures become short text or go."""
    out: dict[str, Any] = {}
    for k, v in list(data.items())[:MAX_FIELDS]:
        if v is None or isinstance(v, bool | int | float):
            out[k] = v
        elif isinstance(v, str):
            out[k] = bounded(v, MAX_VALUE_CHARS)
        elif isinstance(v, list | tuple) and all(isinstance(x, str | int) for x in v):
            out[k] = [x for x in v[:5]]
        else:
            out[k] = bounded(str(v), MAX_VALUE_CHARS)
    return out


def error_output(message: str, *, retryable: bool = False) -> dict[str, Any]:
    return {"status": "error", "message": bounded(message), "retryable": retryable}


def denied_output(reason: str, *, rule: str = "") -> dict[str, Any]:
    return {"status": "denied", "message": bounded(reason), "rule": rule}


def verification_output(prompt: str) -> dict[str, Any]:
    return {
        "status": "needs_verification",
        "message": bounded(f"{prompt} After the caller has entered it, call the same tool again."),
    }


def read_output(spec: ToolSpec, result: Mapping[str, Any]) -> dict[str, Any]:
    """A read's answer for the model. A tool's own shaper speaks for the tool; a raw answer
    is the provider's data, so its fields never take the engine's names."""
    if spec.shape_result:
        shaped = spec.shape_result(result)
    else:
        shaped = {provider_key(k): v for k, v in compact(result).items()}
    shaped.setdefault("status", "ok")
    if "message" in shaped:
        shaped["message"] = bounded(str(shaped["message"]))
    return compact(shaped)


def describe_operation(spec: ToolSpec, op: OperationRecord) -> str:
    try:
        return spec.describe_args(spec.args_model.model_validate(op.args))
    except ValidationError:
        return spec.name.replace("_", " ")


def status_message(spec: ToolSpec, op: OperationRecord) -> str:
    """One speakable sentence saying where the operation stands. Only `committed` says done."""
    what = describe_operation(spec, op)
    who = spec.provider_label
    match op.status:
        case S.AWAITING_CONFIRMATION:
            return f"Not done yet: waiting for the caller to confirm {what}."
        case S.ADMITTED:
            if op.overflow == OverflowPolicy.DEGRADE:
                return (
                    f"Requested {what}. It is not confirmed yet; we are busy, so the caller "
                    f"will get a text message once {who} confirms."
                )
            if op.overflow == OverflowPolicy.QUEUE:
                return (
                    f"Requested {what}. It is queued behind other requests and not "
                    "confirmed yet; I will share the outcome when it arrives."
                )
            return (
                f"Requested {what}. It is not confirmed yet: {who} still has to "
                "confirm it, and I will share the outcome when it arrives."
            )
        case S.RUNNING:
            return f"Sending {what} to {who} now; it is not confirmed yet."
        case S.FAILED_RETRYABLE:
            return f"A temporary problem with {what}; it is being retried and is not done yet."
        case S.UNKNOWN:
            if spec.on_unknown is OnUnknown.ASK_STAFF:
                return (
                    f"We could not tell whether {what} went through, so a member of staff "
                    "is checking; it is not confirmed yet, and the caller will be told."
                )
            return (
                f"We are checking with {who} whether {what} went through; it is not confirmed yet."
            )
        case S.COMMITTED:
            ref = f" Reference {op.provider_ref}." if op.provider_ref else ""
            return f"Done and confirmed by {who}: {what}.{ref}"
        case S.FAILED_FINAL:
            why = f" ({op.error})" if op.error else ""
            return f"That could not be done: {what}{why}. Nothing was changed."
        case S.CANCELLED:
            return f"That request was cancelled and nothing was done: {what}."
    return f"Status of {what}: {op.status}."  # pragma: no cover


def operation_output(spec: ToolSpec, op: OperationRecord) -> dict[str, Any]:
    """What the model hears about an operation right now."""
    out: dict[str, Any] = {
        "status": op.status.value,
        "operation_id": str(op.operation_id),
        "message": bounded(status_message(spec, op)),
    }
    if op.status is S.COMMITTED:
        if op.provider_ref:
            out["reference"] = op.provider_ref
        if op.result and spec.shape_result:
            out["details"] = compact(spec.shape_result(op.result))
    if op.status is S.ADMITTED and op.overflow:
        out["overflow"] = op.overflow
    return out


def confirmation_output(op: OperationRecord, window_s: float) -> dict[str, Any]:
    """Tell the model exactly what to read back and how to report the answer."""
    readback = op.readback or "Please confirm the request. Say yes to confirm."
    return {
        "status": "awaiting_confirmation",
        "operation_id": str(op.operation_id),
        "readback": bounded(readback),
        "confirm_within_s": int(window_s),
        "message": bounded(
            "Not done yet. Read the readback to the caller word for word, then call "
            "confirm_operation with this operation_id and confirmed true or false."
        ),
    }


def awaiting_caller_output(op: OperationRecord, window_s: float, why: str) -> dict[str, Any]:
    """A confirmation the call did not observe from the caller: still waiting, and why."""
    out = confirmation_output(op, window_s)
    out["message"] = bounded(
        f"Not done yet: the caller's own answer was not heard ({why}). Read the readback "
        "to the caller, wait until they answer, and call confirm_operation only after they "
        "have said yes."
    )
    return out


def cancelled_output(op: OperationRecord, reason: str) -> dict[str, Any]:
    return {
        "status": "cancelled",
        "operation_id": str(op.operation_id),
        "message": bounded(f"{reason} Nothing was done."),
    }


# --- late results: in-call announcements and SMS ---------------------------------------------

MAX_SMS_CHARS = 320  # two segments at most


def conflict_sentence(op: OperationRecord, newer: list[str]) -> str:
    """What the caller asked for since, truthfully: nothing of it has been done yet."""
    asked = " and ".join(newer)
    if op.status is S.COMMITTED:
        return (
            f"Meanwhile the caller asked for {asked} instead; that has not been done. Tell "
            "them the earlier request did go through, then ask whether to move it (cancel "
            "the earlier one and make the new one), keep both, or leave it as it is."
        )
    return (
        f"Meanwhile the caller asked for {asked}; that has not been done yet. Ask whether "
        "to go ahead with it now."
    )


def announcement_text(
    spec: ToolSpec,
    op: OperationRecord,
    *,
    newer: list[str] | None = None,
    repeat: bool = False,
    turns_since: int | None = None,
    undone: list[str] | None = None,
) -> str:
    """What the model is asked to tell the caller about a finished operation."""
    text = status_message(spec, op)
    if undone:
        text += f" It has since been undone: {' and '.join(undone)} went through."
    if newer:
        text = f"About the earlier request: {text} {conflict_sentence(op, newer)}"
    elif turns_since:
        text = f"About the caller's earlier request: {text}"
    if repeat:
        text = f"The caller interrupted the last update, so say it again briefly. {text}"
    return bounded(text, 2 * MAX_MESSAGE_CHARS)


def sms_text(
    spec: ToolSpec,
    op: OperationRecord,
    *,
    sender: str | None = None,
    newer: list[str] | None = None,
    undone: list[str] | None = None,
) -> str:
    """A short, plain SMS about an outcome: what, how it ended, and the provider's reference.

    No internal ids, no error internals, no PIN (arguments a tool redacts never appear).
    """
    what = "your request" if spec.redact_arguments else describe_operation(spec, op)
    match op.status:
        case S.COMMITTED:
            ref = f" Ref {op.provider_ref}." if op.provider_ref else ""
            text = f"Confirmed: {what}.{ref}"
        case S.CANCELLED:
            text = f"Cancelled, nothing was done: {what}."
        case _:
            text = f"Sorry, we could not complete {what}. Nothing was changed."
    if undone and op.status is S.COMMITTED:
        text += f" It has since been undone: {' and '.join(undone)} went through."
    if newer:
        asked = " and ".join(newer)
        text += f" You also asked for {asked}; that was not done. Call us to change it."
    if sender:
        text = f"{sender}: {text}"
    return bounded(text, MAX_SMS_CHARS)
