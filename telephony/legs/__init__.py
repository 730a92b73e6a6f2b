"""Every leg of a call and its wire format, in one place.

A leg is how a call's audio and control reach us; the bridge sees each through the `CallLeg`
seam (`leg.py`) and never learns which one it has:

- `twilio/`: Twilio Media Streams (a WebSocket of 8 kHz mu-law): the typed wire events
  (`events.py`), the leg (`leg.py`: media and marks out, playout confirmed by mark echoes,
  `clear` on barge-in) and per-stream budgets against abusive clients (`budget.py`).
- `sip/`: our SIP user agent server: sans-I/O transactions and dialogs, SDP, digest, the
  UDP/TCP transport, RTP and the SIP leg (`sip/leg.py`: playout confirmed as RTP is sent).
- `sideband.py`: OpenAI's SIP interconnect, where OpenAI carries the audio and we hold a
  control socket: playout comes from the server's own events.

Where a call on each leg begins and ends (webhooks, dialogs, the session) is `app/legs/`.
"""
