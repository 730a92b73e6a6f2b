"""Twilio's request signatures: a webhook's form fields, taken only when X-Twilio-Signature
verifies against the public URL (the voice and status webhooks and the SMS webhooks alike)."""

from __future__ import annotations

from urllib.parse import parse_qsl

from fastapi import Request
from twilio.request_validator import RequestValidator

from app.errors import BadSignature, PayloadTooLarge
from app.settings import Settings

# A Twilio webhook is a few hundred bytes of form fields (the default WEBHOOK_MAX_BODY_BYTES,
# which app.http.body_limits enforces while reading; this route's own bound follows the setting).
MAX_WEBHOOK_BYTES = 64 * 1024


async def signed_form(request: Request, settings: Settings) -> dict[str, str]:
    """The webhook's form fields, if the body is small and X-Twilio-Signature verifies."""
    signature = request.headers.get("x-twilio-signature", "")
    if not signature:
        # Refused before a byte of the body is read: an anonymous post costs us no memory.
        raise BadSignature(request.url.path)
    limit = max(MAX_WEBHOOK_BYTES, settings.webhook_max_body_bytes)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise PayloadTooLarge(length)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise PayloadTooLarge(len(body))
    params = dict(parse_qsl(body.decode("utf-8", errors="replace"), keep_blank_values=True))
    # Signatures cover the URL Twilio called, which is the public one (TLS ends at a proxy).
    url = settings.public_base_url.rstrip("/") + request.url.path
    if request.url.query:
        url += "?" + request.url.query
    validator = RequestValidator(settings.twilio_auth_token.get_secret_value())
    if not validator.validate(url, params, signature):
        raise BadSignature(request.url.path)
    return params
