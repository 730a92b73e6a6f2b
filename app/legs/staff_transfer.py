"""Staff transfer a live call from the console (`POST /api/calls/{id}/actions/transfer`).

The replica holding the call acts (app/calls/control.py brings it the request). An OpenAI SIP
interconnect call is referred at once (`refer`); a call whose media we carry (Twilio, our SIP
leg) is put through the way the model's own `transfer_call` is: the agent says one sentence,
the caller hears it to its end, then the leg transfers (Twilio `<Dial>`, SIP REFER), with the
outcome on the call's timeline. The target is a name of TRANSFER_TARGETS, an E.164 number or a
`sip:` URI.
"""

from __future__ import annotations

import logging
import secrets

from app.runtime import Runtime
from telephony.tool_gateway import TransferRequest
from tools.transfers import E164, SIP_URI, TransferTarget, TransferTargetError

log = logging.getLogger(__name__)

DIRECT = "direct"  # the name of a target staff give as a number or URI


def configured_targets(runtime: Runtime) -> dict[str, TransferTarget]:
    """The targets calls of this process may be transferred to (the tools file's, else
    TRANSFER_TARGETS; checked at startup)."""
    from app.tool_wiring import configured_transfers

    catalog = runtime.tools.catalog if runtime.tools is not None else None
    return configured_transfers(runtime.settings, catalog)


def staff_target(runtime: Runtime, target: str) -> tuple[str, str]:
    """(name, destination) of what staff asked for; TransferTargetError when it is neither a
    configured name nor a number or SIP URI."""
    target = target.strip()
    configured = configured_targets(runtime)
    if target in configured:
        return target, configured[target].destination
    bare = target.removeprefix("tel:")
    if E164.match(bare) or SIP_URI.match(target):
        return DIRECT, bare if E164.match(bare) else target
    names = ", ".join(sorted(configured)) or "none configured"
    raise TransferTargetError(
        f"{target[:64]!r} is not a transfer target ({names}), an E.164 number or a sip: URI"
    )


async def transfer_call(runtime: Runtime, call_sid: str, target: str, by: str) -> None:
    """Transfer `call_sid`, live in this process, to `target` (see the module docstring)."""
    entry = runtime.registry.get(call_sid)
    if entry is None:
        return
    if entry.leg == "openai_sip":
        await runtime.openai_sip.transfer(call_sid, target, by)
        return
    name, destination = staff_target(runtime, target)
    request = TransferRequest(
        target=name,
        destination=destination,
        mode="cold",
        reason=f"staff: {by}"[:300],
        function_call_id=f"staff-{secrets.token_hex(8)}",
    )
    transfer = getattr(entry.live, "transfer", None)
    if transfer is None:
        log.warning("call %s: this leg cannot be transferred", entry.call_id)
        return
    await transfer(request, by)
