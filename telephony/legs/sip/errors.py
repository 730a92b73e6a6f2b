"""Errors of the SIP user agent."""

from __future__ import annotations

from telephony.errors import TelephonyError


class SipError(TelephonyError):
    """Root of the SIP errors."""


class SipParseError(SipError):
    """A datagram or stream segment that is not a SIP message we can use."""


class SdpError(SipError):
    """An SDP body we cannot answer; `status` is what the request gets (400, 488)."""

    def __init__(self, message: str, status: int = 488) -> None:
        super().__init__(message)
        self.status = status


class RtpPortsExhausted(SipError):
    """Every port of SIP_RTP_PORTS is in use."""

    retryable = True
