"""Twilio Media Streams: the wire events, the leg, and what one stream may cost us."""
