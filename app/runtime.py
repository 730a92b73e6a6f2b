"""The services one process wires together, held on `app.state.runtime` for the routes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI
from sqlalchemy.ext.asyncio import AsyncEngine

from app.calls.events import EventWriter
from app.calls.registry import CallRegistry
from app.http.slots import SlotPool
from app.legs.twilio.stream_token import StreamTokens
from app.settings import Settings
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
    twilio: Any  # twilio.rest.Client from app.ops.twilio_rest.make_twilio_client
    tools: Any = None  # app.tool_wiring.ToolWiring when the durable pipeline is wired
    sip: Any = None  # app.legs.sip.SipService when SIP_BIND is set
    openai_sip: Any = None  # app.legs.openai_sip.calls.OpenAISipService: OpenAI's SIP interconnect
    console: Any = None  # app.console.services.Console: recordings, live updates, operation actions
    delivery: Any = None  # app.ops.delivery.ResultDelivery: late results of this process's calls
    sms: Any = None  # app.ops.sms.SmsChannel: SMS follow-ups (and staff resends)
    holder: str = "replica"  # this process, as written into the calls it holds
    # Media streams refused for their token: counted, never written to a call's timeline.
    streams_rejected: int = 0
    # Media sockets not yet admitted (no valid `start`), per source address (create_app sizes
    # it from MEDIA_MAX_PENDING_PER_SOURCE and MEDIA_MAX_PENDING_STREAMS).
    pending_streams: SlotPool = field(default_factory=lambda: SlotPool(per_key=64, total=256))
