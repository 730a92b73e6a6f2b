"""The delivery and SMS state machines: states and the one table of legal moves of each.

A delivery is how one finished operation's outcome reaches the caller:

    pending  -> offered          handed to the bridge holding the live call
             -> texting          an SMS carries it (the message row exists before any send)
             -> not_deliverable  no channel: the call is over and no SMS-capable number, or
                                 the caller opted out
             -> not_needed       nothing to tell (never reached the provider, told already)
             -> calling          a callback call carries it (LATE_RESULT_CHANNEL=call|auto):
                                 the call's row and its place_call operation exist
    calling  -> called           a person answered and heard it to its end
             -> voicemail        a machine answered: a message was left (no details)
             -> pending          the call was not answered, or ended before it was heard:
                                 tried again after a backoff, then SMS, else not_deliverable
    offered  -> heard            the audio of the response that carried it was played out
             -> pending          cut by a barge-in, never spoken, or the call went away
    texting  -> texted           Twilio reported the SMS delivered (or sent, for good)
             -> failed           undelivered / failed: visible to staff, who may resend
             -> not_deliverable  the number cannot take SMS or has opted out (21610)
    not_deliverable -> calling   LATE_RESULT_CHANNEL=auto: the number cannot take SMS, so
                                 it is called instead
    heard, texted, failed, not_deliverable, called, voicemail -> texting   only when staff
                                 resend it

Only `tools.deliveries.move` changes a delivery's state, with a conditional update.

An SMS message, for its part, only moves forward in rank, so a late or duplicate status
callback never undoes a later one (a `sent` arriving after `delivered` changes nothing):

    pending(0) -> requesting(1) -> queued(2) -> sent(3) -> delivered | undelivered | failed (4)
                               '-> unknown(1): the answer to the send was lost; reconciled
                                   by asking Twilio, never by sending again blindly
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum

from tools.errors import IllegalTransition


class DeliveryState(StrEnum):
    """Where the delivery of one outcome stands."""

    PENDING = "pending"
    OFFERED = "offered"
    HEARD = "heard"
    TEXTING = "texting"
    TEXTED = "texted"
    FAILED = "failed"
    NOT_DELIVERABLE = "not_deliverable"
    NOT_NEEDED = "not_needed"
    CALLING = "calling"
    CALLED = "called"
    VOICEMAIL = "voicemail"


D = DeliveryState

# No more work is due on these (staff may still resend an SMS).
SETTLED: frozenset[DeliveryState] = frozenset(
    {D.HEARD, D.TEXTED, D.FAILED, D.NOT_DELIVERABLE, D.NOT_NEEDED, D.CALLED, D.VOICEMAIL}
)
# The caller learnt the outcome.
COMMUNICATED: frozenset[DeliveryState] = frozenset({D.HEARD, D.TEXTED, D.CALLED, D.VOICEMAIL})

DELIVERY_TRANSITIONS: dict[DeliveryState, frozenset[DeliveryState]] = {
    D.PENDING: frozenset({D.OFFERED, D.TEXTING, D.NOT_DELIVERABLE, D.NOT_NEEDED, D.CALLING}),
    D.OFFERED: frozenset({D.HEARD, D.PENDING}),
    D.TEXTING: frozenset({D.TEXTED, D.FAILED, D.NOT_DELIVERABLE, D.TEXTING}),
    # Staff resend (a copy by text): a new message on the same delivery.
    D.HEARD: frozenset({D.TEXTING}),
    D.TEXTED: frozenset({D.TEXTING}),
    D.FAILED: frozenset({D.TEXTING}),
    D.NOT_DELIVERABLE: frozenset({D.TEXTING, D.CALLING}),
    D.NOT_NEEDED: frozenset(),
    D.CALLING: frozenset({D.CALLED, D.VOICEMAIL, D.PENDING}),
    D.CALLED: frozenset({D.TEXTING}),
    D.VOICEMAIL: frozenset({D.TEXTING}),
}


def check_delivery_move(
    from_states: DeliveryState | Iterable[DeliveryState], to_state: DeliveryState
) -> tuple[DeliveryState, ...]:
    """Normalize the expected source states and refuse any illegal edge among them."""
    froms = (
        (DeliveryState(from_states),)
        if isinstance(from_states, str)
        else tuple(DeliveryState(s) for s in from_states)
    )
    if not froms:
        raise IllegalTransition(f"no source state given for -> {to_state}")
    to = DeliveryState(to_state)
    for f in froms:
        if to not in DELIVERY_TRANSITIONS[f]:
            raise IllegalTransition(f"illegal delivery move {f} -> {to}")
    return froms


class SmsStatus(StrEnum):
    """Where one SMS stands, as far as we know."""

    PENDING = "pending"  # persisted, not sent yet
    REQUESTING = "requesting"  # the create request is (or may be) on its way to Twilio
    UNKNOWN = "unknown"  # the answer to the create was lost: ask Twilio before anything
    QUEUED = "queued"  # Twilio accepted it (has a MessageSid)
    SENT = "sent"
    DELIVERED = "delivered"
    UNDELIVERED = "undelivered"
    FAILED = "failed"


M = SmsStatus

RANK: dict[SmsStatus, int] = {
    M.PENDING: 0,
    M.REQUESTING: 1,
    M.UNKNOWN: 1,
    M.QUEUED: 2,
    M.SENT: 3,
    M.DELIVERED: 4,
    M.UNDELIVERED: 4,
    M.FAILED: 4,
}

SMS_FINAL: frozenset[SmsStatus] = frozenset({M.DELIVERED, M.UNDELIVERED, M.FAILED})
SMS_FAILURES: frozenset[SmsStatus] = frozenset({M.UNDELIVERED, M.FAILED})

# Twilio's MessageStatus values (outbound), as our statuses.
TWILIO_STATUS: dict[str, SmsStatus] = {
    "accepted": M.QUEUED,
    "scheduled": M.QUEUED,
    "queued": M.QUEUED,
    "sending": M.QUEUED,
    "sent": M.SENT,
    "delivered": M.DELIVERED,
    "read": M.DELIVERED,
    "undelivered": M.UNDELIVERED,
    "failed": M.FAILED,
    "canceled": M.FAILED,
}


def sms_advances(current: SmsStatus, new: SmsStatus) -> bool:
    """Whether a report of `new` moves a message in `current` forward (never back)."""
    if current in SMS_FINAL:
        return False
    if current is M.UNKNOWN and new is M.PENDING:
        return True  # reconciliation proved it never reached Twilio
    if current is M.REQUESTING and new is M.UNKNOWN:
        return True  # the answer to the send was lost
    return RANK[new] > RANK[current]
