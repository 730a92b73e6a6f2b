"""The Twilio leg: `routes` (POST /twilio/voice answers with `twiml`, WS /twilio/media admits
a stream that a `stream_token` signs, POST /twilio/status), `media_session` (one admitted
stream and its bridge, until the call ends) and `media_ws` (the media lane in uvicorn).
"""
