"""Tables of the call side: calls and their events."""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, Column, DateTime, ForeignKey, Index, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlmodel import Field, SQLModel


class LegKind(StrEnum):
    """How a call reached us: the values `calls.leg` holds (and the console filters by)."""

    TWILIO = "twilio"  # a Twilio Media Stream
    SIP = "sip"  # our SIP user agent
    OPENAI_SIP = "openai_sip"  # OpenAI's SIP interconnect (a sideband, no media here)


class Call(SQLModel, table=True):
    """One phone call, whatever leg it arrived on."""

    __tablename__ = "calls"

    id: uuid.UUID = Field(default_factory=uuid.uuid4, primary_key=True)
    # The provider's id: Twilio CallSid, a whole SIP Call-ID (up to 1024), or OpenAI's call_id.
    call_sid: str = Field(unique=True, index=True, max_length=1024)
    tenant_id: str = Field(default="default", max_length=64)
    leg: str = Field(default="twilio", max_length=16)
    direction: str = Field(default="inbound", max_length=16)
    from_number: str | None = Field(default=None, max_length=64)
    to_number: str | None = Field(default=None, max_length=64)
    status: str = Field(default="ringing", max_length=32)
    stream_sid: str | None = Field(default=None, max_length=64)
    end_reason: str | None = Field(default=None, max_length=128)
    # The process holding the media stream, and its last heartbeat for this call.
    holder: str | None = Field(default=None, max_length=128)
    heartbeat_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    # A Twilio call whose stream was lost: when its holder released it for resumption, and
    # the nonce of the one resume token that may take it over (app/legs/twilio/resume.py).
    released_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    resume_nonce: str | None = Field(default=None, max_length=64)
    created_at: datetime = Field(
        sa_column=Column(DateTime(timezone=True), nullable=False, server_default=func.now())
    )
    answered_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    ended_at: datetime | None = Field(
        default=None, sa_column=Column(DateTime(timezone=True), nullable=True)
    )
    # An outbound call (direction outbound): what it is for and where it stands (purpose,
    # the operation it is about, the placing operation, the answering-machine result).
    outbound: dict[str, Any] | None = Field(default=None, sa_column=Column(JSONB, nullable=True))


class CallEventRow(SQLModel, table=True):
    """One thing that happened in a call, in order (seq) with both clocks."""

    __tablename__ = "call_events"
    __table_args__ = (Index("ix_call_events_call_seq", "call_id", "seq", unique=True),)

    id: int | None = Field(default=None, sa_column=Column(BigInteger, primary_key=True))
    call_id: uuid.UUID = Field(
        sa_column=Column(ForeignKey("calls.id", ondelete="CASCADE"), nullable=False)
    )
    seq: int = Field(sa_column=Column(BigInteger, nullable=False))
    kind: str = Field(max_length=64)
    data: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSONB, nullable=False))
    # time.monotonic_ns() on the process that saw it: exact ordering and durations.
    mono_ns: int = Field(sa_column=Column(BigInteger, nullable=False))
    at: datetime = Field(sa_column=Column(DateTime(timezone=True), nullable=False))
