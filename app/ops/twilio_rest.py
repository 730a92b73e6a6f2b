"""The Twilio REST client the service uses: async (never blocks the event loop), with an
optional base URL so tests and the offline demo reach a local stand-in instead of
https://api.twilio.com. Production and tests run the same code path."""

from __future__ import annotations

import base64
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiohttp
from twilio.base.exceptions import TwilioRestException
from twilio.http.async_http_client import AsyncTwilioHttpClient
from twilio.http.response import Response
from twilio.rest import Client

DEFAULT_TIMEOUT_S = 10.0

# Twilio's "Call is not in-progress" error: the call had already ended.
CALL_NOT_IN_PROGRESS = 21220


class TwilioRestError(Exception):
    """A Twilio REST request that failed; `retryable` for 429, 5xx and network errors."""

    def __init__(self, message: str, *, status: int | None, code: int | None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.retryable = status is None or status == 429 or status >= 500


def rewrite_twilio_url(url: str, api_base_url: str | None) -> str:
    """Send a request meant for any *.twilio.com host to `api_base_url` instead."""
    if not api_base_url:
        return url
    parts = urlsplit(url)
    host = (parts.hostname or "").lower()
    if host != "twilio.com" and not host.endswith(".twilio.com"):
        return url
    base = urlsplit(api_base_url.rstrip("/"))
    return urlunsplit((base.scheme, base.netloc, base.path + parts.path, parts.query, ""))


class BaseUrlAsyncHttpClient(AsyncTwilioHttpClient):
    """twilio's aiohttp client, with a default timeout, a session opened lazily inside the
    running loop, and requests for *.twilio.com rewritten to `api_base_url` when set."""

    def __init__(self, api_base_url: str | None = None, timeout: float = DEFAULT_TIMEOUT_S):
        # The session is made on first use: aiohttp wants a running loop for it.
        super().__init__(pool_connections=False, timeout=timeout)
        self.session: aiohttp.ClientSession | None = None
        self.api_base_url = api_base_url

    async def request(
        self,
        method: str,
        url: str,
        params: dict[str, object] | None = None,
        data: dict[str, object] | None = None,
        headers: dict[str, str] | None = None,
        auth: tuple[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (twilio's HttpClient signature)
        allow_redirects: bool = False,
    ) -> Response:
        # Not twilio's own request(): it uses aiohttp.BasicAuth, deprecated in aiohttp 3.14.
        if timeout is not None and timeout <= 0:
            raise ValueError(timeout)
        if self.session is None:
            self.session = aiohttp.ClientSession()
        all_headers = dict(headers or {})
        if auth is not None:
            credentials = base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode("ascii")
            all_headers["Authorization"] = f"Basic {credentials}"
        kwargs: dict[str, Any] = {
            "method": method.upper(),
            "url": rewrite_twilio_url(url, self.api_base_url),
            "params": params,
            "data": data,
            "headers": all_headers,
            # twilio passes None through, which aiohttp reads as "no timeout at all".
            "timeout": aiohttp.ClientTimeout(total=timeout or self.timeout),
            "allow_redirects": allow_redirects,
        }
        self.log_request(kwargs)
        async with self.session.request(**kwargs) as response:
            text = await response.text()
            self.log_response(response.status, response)
            return Response(response.status, text, response.headers)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()
            self.session = None


def make_twilio_client(
    account_sid: str,
    auth_token: str,
    api_base_url: str | None = None,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> Client:
    """A `twilio.rest.Client` for the `*_async` methods; with `api_base_url`, every request
    goes there instead of Twilio. Close it with `close_twilio_client`."""
    client = Client(
        account_sid,
        auth_token,
        http_client=BaseUrlAsyncHttpClient(api_base_url, timeout),
    )
    # twilio imports its REST API's modules on the first use of one (~64 ms here): done now,
    # while the process starts, not on the first SMS, transfer or hang-up it makes.
    client.api.account.messages  # noqa: B018
    return client


async def close_twilio_client(client: Client) -> None:
    """Release the client's HTTP connections."""
    http = client.http_client
    if isinstance(http, BaseUrlAsyncHttpClient):
        await http.close()


def _wrap(exc: Exception, what: str) -> TwilioRestError:
    if isinstance(exc, TwilioRestException):
        return TwilioRestError(
            f"{what}: HTTP {exc.status} code {exc.code}: {exc.msg}",
            status=exc.status,
            code=exc.code,
        )
    return TwilioRestError(f"{what}: {exc!r}", status=None, code=None)


async def _update_call(client: Client, call_sid: str, what: str, **fields: str) -> bool:
    """One update of a live call; False when it had already ended, TwilioRestError else."""
    try:
        await client.calls(call_sid).update_async(**fields)
    except TwilioRestException as exc:
        if exc.code == CALL_NOT_IN_PROGRESS:
            return False
        raise _wrap(exc, f"{what} call {call_sid}") from exc
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _wrap(exc, f"{what} call {call_sid}") from exc
    return True


async def end_call(client: Client, call_sid: str) -> bool:
    """Hang up a live call; False when it had already ended."""
    return await _update_call(client, call_sid, "ending", status="completed")


async def cancel_call(client: Client, call_sid: str) -> bool:
    """Stop a call not yet answered (queued or ringing); an answered one is left alone."""
    return await _update_call(client, call_sid, "cancelling", status="canceled")


async def redirect_call(client: Client, call_sid: str, twiml: str) -> bool:
    """Give a live call new instructions (its stream stops); False when it had ended."""
    return await _update_call(client, call_sid, "redirecting", twiml=twiml)


async def send_sms(
    client: Client,
    to: str,
    body: str,
    status_callback: str | None,
    *,
    from_: str | None = None,
) -> str:
    """Send an SMS; return its MessageSid. Status updates arrive at `status_callback`.
    `from_` defaults to the configured TWILIO_FROM_NUMBER."""
    if from_ is None:
        from app.settings import get_settings

        from_ = get_settings().twilio_from_number
    kwargs: dict[str, Any] = {"to": to, "from_": from_, "body": body}
    if status_callback:
        kwargs["status_callback"] = status_callback
    try:
        message = await client.messages.create_async(**kwargs)
    except (TwilioRestException, aiohttp.ClientError, TimeoutError) as exc:
        raise _wrap(exc, f"sending SMS to {to}") from exc
    if not message.sid:
        raise TwilioRestError("Twilio answered without a MessageSid", status=None, code=None)
    return message.sid
