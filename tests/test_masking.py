"""What each role sees: numbers masked for viewers, PINs and secrets for everyone."""

from __future__ import annotations

from app.console.masking import FULL, VIEWER, mask_phone, mask_text


def test_phone_numbers_keep_their_shape_and_last_two_digits() -> None:
    assert mask_phone("+15551230000") == "+•••••••••00"
    assert mask_phone("+44 20 7123 4567") == "+•• •• •••• ••67"
    assert mask_phone("anonymous") == "anonymous" and mask_phone("611") == "611"


def test_text_loses_numbers_and_pins_but_keeps_dates_times_and_references() -> None:
    text = "Call me on +1 555 123 0000, my PIN is 4 3 2 1 (or 4321)."
    assert mask_text(text) == "Call me on +• ••• ••• ••00, my PIN is • • • • (or ••••)."
    kept = "Booked BK7QX2MHN4 for 2026-12-05 at 21:00, party of 4, ref 12-3456."
    assert mask_text(kept) == kept


def test_viewers_get_numbers_masked_everyone_loses_pins_keypad_digits_and_secrets() -> None:
    value = {
        "call": {"from": "+15551230000", "to": "+15550000000", "id": "5551230000"},
        "events": [
            {"kind": "dtmf", "data": {"digit": "7"}},
            {"kind": "function_call", "data": {"pin": "4321", "api_token": "x", "ok": True}},
            {"kind": "caller_transcript", "data": {"text": "it is 5551230000"}},
        ],
    }
    viewer, full = VIEWER.scrub(value), FULL.scrub(value)
    assert viewer["call"]["from"] == "+•••••••••00" and viewer["call"]["id"] == "5551230000"
    assert viewer["events"][2]["data"]["text"] == "it is ••••••••00"
    assert full["call"]["from"] == "+15551230000"
    assert full["events"][2]["data"]["text"] == "it is 5551230000"
    for seen in (viewer, full):
        assert seen["events"][0]["data"]["digit"] == "•"
        assert seen["events"][1]["data"] == {
            "pin": "[redacted]", "api_token": "[redacted]", "ok": True
        }  # fmt: skip
    assert value["events"][0]["data"]["digit"] == "7"  # the input is left as it was


def test_a_spoken_pin_is_masked_in_a_stored_transcript_and_phone_numbers_are_kept() -> None:
    from telephony.redaction import mask_spoken_pins

    assert mask_spoken_pins("my PIN is 4 3 2 1") == "my PIN is • • • •"
    assert mask_spoken_pins("it's 4321, thanks") == "it's ••••, thanks"
    assert mask_spoken_pins("It is 2 4 6 8.") == "It is • • • •."
    assert mask_spoken_pins("version 1234.5") == "version 1234.5"
    # A phone number stays (operators may see it; viewers get it masked on display).
    assert mask_spoken_pins("call me on +1 555 123 0000") == "call me on +1 555 123 0000"
    assert mask_spoken_pins("5551230000 and 9876") == "5551230000 and ••••"
    # Times, dates, party sizes and references are not PINs.
    for text in ("at 20:30 on 2026-12-01", "a table for 4", "booking BK4U99LHJP", "no digits"):
        assert mask_spoken_pins(text) == text
