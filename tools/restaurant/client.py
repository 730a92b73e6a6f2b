"""The workers' client for the system of record: every call bounded, every outcome named.

A mutation's outcome is one of `committed`, `pending` (accepted, reported later through
the callback), `failed_retryable` (provably not applied: refused before commit or never
sent), `failed_final` (the SOR said no for good) or `unknown` (sent, and the answer was
lost: a timeout, a dropped connection or a garbled reply). `unknown` is never a failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import date as Date
from typing import Any

import httpx
from pydantic import ValidationError

from tools.errors import ProviderError
from tools.provider import Outcome
from tools.restaurant.protocol import (
    CALLBACK_URL_HEADER,
    IDEMPOTENCY_HEADER,
    Availability,
    Booking,
    BookingRequest,
    ErrorBody,
    KeyStatus,
)


@dataclass(frozen=True, slots=True)
class ProviderResult:
    """One provider call's outcome, with what the SOR returned when it returned anything."""

    outcome: Outcome
    booking: Booking | None = None
    status_code: int | None = None
    error: str | None = None

    @property
    def reference(self) -> str | None:
        """The provider's reference (booking id), when known."""
        return self.booking.id if self.booking else None


class SorClientError(ProviderError):
    """A read against the SOR failed; reads have no `unknown`, they just fail."""

    retryable = True


def _error_code(resp: httpx.Response) -> str:
    try:
        return ErrorBody.model_validate(resp.json()).code
    except (ValueError, ValidationError):
        return f"http_{resp.status_code}"


def classify(resp: httpx.Response) -> ProviderResult:
    """Map a SOR answer to a mutation outcome."""
    code = resp.status_code
    if code == 202:
        return ProviderResult(Outcome.pending, status_code=code)
    if 200 <= code < 300:
        try:
            return ProviderResult(
                Outcome.committed, booking=Booking.model_validate(resp.json()), status_code=code
            )
        except (ValueError, ValidationError) as exc:
            # Applied, but we cannot read what: only the SOR can tell us.
            return ProviderResult(Outcome.unknown, status_code=code, error=f"bad body: {exc}")
    err = _error_code(resp)
    if code == 409 and err == "in_progress":
        # The same key is in flight elsewhere; its outcome is not ours to guess.
        return ProviderResult(Outcome.unknown, status_code=code, error=err)
    if code in (408, 425, 429) or (code >= 500 and err == "injected_failure"):
        return ProviderResult(Outcome.failed_retryable, status_code=code, error=err)
    if code >= 500:
        # A gateway or server error after the request reached the SOR proves nothing.
        return ProviderResult(Outcome.unknown, status_code=code, error=err)
    return ProviderResult(Outcome.failed_final, status_code=code, error=err)


class SorClient:
    """Async HTTP client for the SOR. Mutations always carry an Idempotency-Key."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 5.0,
        connect_timeout_s: float = 2.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> SorClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def _mutation(
        self,
        path: str,
        key: str,
        json_body: dict[str, Any] | None,
        callback_url: str | None,
        timeout_s: float | None,
    ) -> ProviderResult:
        headers = {IDEMPOTENCY_HEADER: key}
        if callback_url:
            headers[CALLBACK_URL_HEADER] = callback_url
        timeout = (
            httpx.Timeout(timeout_s, connect=min(timeout_s, 2.0))
            if timeout_s is not None
            else httpx.USE_CLIENT_DEFAULT
        )
        try:
            resp = await self._http.post(path, json=json_body, headers=headers, timeout=timeout)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # No connection, so nothing was sent: safe to try again.
            return ProviderResult(Outcome.failed_retryable, error=f"not sent: {exc!r}")
        except httpx.HTTPError as exc:
            # Sent (or partly sent) and no answer: the SOR may well have applied it.
            return ProviderResult(Outcome.unknown, error=f"no answer: {exc!r}")
        return classify(resp)

    async def book_table(
        self,
        key: str,
        request: BookingRequest,
        *,
        callback_url: str | None = None,
        timeout_s: float | None = None,
    ) -> ProviderResult:
        """POST /bookings with the operation's idempotency key."""
        return await self._mutation(
            "/bookings", key, request.model_dump(mode="json"), callback_url, timeout_s
        )

    async def cancel_booking(
        self,
        key: str,
        booking_id: str,
        *,
        callback_url: str | None = None,
        timeout_s: float | None = None,
    ) -> ProviderResult:
        """POST /bookings/{id}/cancel; only the SOR's answer confirms a cancel."""
        return await self._mutation(
            f"/bookings/{booking_id}/cancel", key, None, callback_url, timeout_s
        )

    async def _get(self, path: str, params: dict[str, Any] | None = None) -> httpx.Response:
        try:
            return await self._http.get(path, params=params)
        except httpx.HTTPError as exc:
            raise SorClientError(f"GET {path} failed: {exc!r}") from exc

    async def get_booking(self, booking_id: str) -> Booking | None:
        """The booking, or None when the SOR does not know it."""
        resp = await self._get(f"/bookings/{booking_id}")
        if resp.status_code == 404:
            return None
        if resp.status_code != 200:
            raise SorClientError(f"GET booking answered {resp.status_code}")
        return Booking.model_validate(resp.json())

    async def check_availability(self, day: Date, time: str, party_size: int) -> Availability:
        resp = await self._get(
            "/availability",
            {"date": day.isoformat(), "time": time, "party_size": party_size},
        )
        if resp.status_code != 200:
            raise SorClientError(f"GET availability answered {resp.status_code}")
        return Availability.model_validate(resp.json())

    async def key_status(self, key: str) -> KeyStatus:
        """Ask the SOR what happened to the request sent with `key`."""
        resp = await self._get(f"/idempotency/{key}")
        if resp.status_code != 200:
            raise SorClientError(f"GET idempotency answered {resp.status_code}")
        return KeyStatus.model_validate(resp.json())
