"""The call legs: how a call reaches us and how it leaves. One package or module per leg:
`twilio/` (Media Streams: the voice webhook, the media socket, TwiML, stream tokens),
`sip` (our SIP user agent server), `openai_sip/` (OpenAI's SIP interconnect: the webhook,
accept and the sideband socket).

Wing order: `legs` may import `calls`, `ops`, `access` and `http`, never `console` or `cli`.
"""
