"""The delivery and SMS state machines: legal moves only, and SMS statuses only forward."""

from __future__ import annotations

import pytest

from tools.delivery_states import (
    DELIVERY_TRANSITIONS,
    DeliveryState,
    SmsStatus,
    check_delivery_move,
    sms_advances,
)
from tools.errors import IllegalTransition

D = DeliveryState
M = SmsStatus


def test_heard_is_only_reached_from_an_offer_and_nothing_leaves_not_needed() -> None:
    assert [s for s, targets in DELIVERY_TRANSITIONS.items() if D.HEARD in targets] == [D.OFFERED]
    assert DELIVERY_TRANSITIONS[D.NOT_NEEDED] == frozenset()
    with pytest.raises(IllegalTransition):
        check_delivery_move(D.PENDING, D.HEARD)
    with pytest.raises(IllegalTransition):
        check_delivery_move(D.NOT_NEEDED, D.TEXTING)
    assert check_delivery_move([D.FAILED, D.TEXTED], D.TEXTING) == (D.FAILED, D.TEXTED)


@pytest.mark.parametrize(
    ("current", "new", "moves"),
    [
        (M.PENDING, M.REQUESTING, True),
        (M.REQUESTING, M.UNKNOWN, True),
        (M.UNKNOWN, M.PENDING, True),  # proved never made: may be sent again
        (M.REQUESTING, M.QUEUED, True),
        (M.UNKNOWN, M.SENT, True),
        (M.QUEUED, M.SENT, True),
        (M.SENT, M.DELIVERED, True),
        (M.QUEUED, M.UNDELIVERED, True),
        (M.DELIVERED, M.SENT, False),  # a late `sent` never overwrites `delivered`
        (M.DELIVERED, M.FAILED, False),
        (M.SENT, M.QUEUED, False),
        (M.SENT, M.SENT, False),  # a duplicate changes nothing
        (M.QUEUED, M.PENDING, False),
        (M.FAILED, M.DELIVERED, False),
    ],
)
def test_sms_statuses_only_move_forward(current: M, new: M, moves: bool) -> None:
    assert sms_advances(current, new) is moves
