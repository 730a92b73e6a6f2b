"""The services one process wires together, held on `app.state.runtime` for the routes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls import CallRegistry
from app.event_writer import EventWriter
from app.settings import Settings
from app.slots import SlotPool
from app.stream_token import StreamTokens
from telephony.session_config import BridgeConfig
from telephony.tool_gateway import ToolGateway


@dataclass
class Runtime:
    """Settings plus the live services of this process."""

    settings: Settings
    engine: AsyncEngine
    events: EventWriter
    registry: CallRegistry
    tokens: StreamTokens
    gateway: ToolGateway
    openai: AsyncOpenAI
    bridge_config: BridgeConfig
    twilio: Any  # twilio.rest.Client from app.twilio_rest.make_twilio_client
    tools: Any = None  # app.tool_wiring.ToolWiring when the durable pipeline is wired
    sip: Any = None  # app.sip_calls.SipService when SIP_BIND is set
    openai_sip: Any = None  # app.openai_sip.OpenAISipService: OpenAI's SIP interconnect
    console: Any = None  # app.console.Console: recordings, live updates, operation actions
    delivery: Any = None  # app.delivery.ResultDelivery: late results of this process's calls
    sms: Any = None  # app.sms.SmsChannel: SMS follow-ups (and staff resends)
    holder: str = "replica"  # this process, as written into the calls it holds
    # Media streams refused for their token: counted, never written to a call's timeline.
    streams_rejected: int = 0
    # Media sockets not yet admitted (no valid `start`), per source address (create_app sizes
    # it from MEDIA_MAX_PENDING_PER_SOURCE and MEDIA_MAX_PENDING_STREAMS).
    pending_streams: SlotPool = field(default_factory=lambda: SlotPool(per_key=64, total=256))
