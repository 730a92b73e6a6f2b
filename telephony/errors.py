"""Errors of the telephony area."""

from __future__ import annotations


class TelephonyError(Exception):
    """Root of every telephony error."""

    retryable: bool = False


class MalformedFrame(TelephonyError):
    """A frame from a call leg that could not be parsed; the call survives it."""


class StreamRejected(TelephonyError):
    """A media stream that must be closed (bad token, wrong call)."""


class RealtimeUnavailable(TelephonyError):
    """The Realtime session could not be (re)opened within its budget."""

    retryable = True
