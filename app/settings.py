"""Service settings, read once from the environment."""

from __future__ import annotations

import hashlib
import hmac
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    """Every knob of the service. Tests build their own instance instead of patching."""

    model_config = SettingsConfigDict(env_file=None, extra="ignore", case_sensitive=False)

    # Storage. No DATABASE_URL means: start an embedded PostgreSQL in `data_dir`.
    database_url: str | None = None
    data_dir: Path = Path(".voice-agent")

    # OpenAI. No OPENAI_API_KEY means: the offline demo against the local simulator.
    openai_api_key: SecretStr | None = None
    openai_base_url: str | None = None
    openai_realtime_model: str = "gpt-realtime"
    openai_webhook_secret: SecretStr | None = None
    realtime_voice: str = "marin"
    # semantic_vad eagerness; "low" suits callers who give long narrative answers.
    vad_eagerness: Literal["auto", "low", "medium", "high"] = "auto"
    # How long the bridge may spend re-opening a dropped Realtime session.
    realtime_reconnect_budget_s: float = 5.0

    # Twilio.
    twilio_account_sid: str = "AC00000000000000000000000000000000"
    twilio_auth_token: SecretStr = SecretStr("dev-auth-token")
    twilio_from_number: str = "+15550000000"
    twilio_api_base_url: str | None = None

    # Where Twilio reaches us; TLS usually ends at a proxy, so signatures use this, not the
    # Host header.
    public_base_url: str = "http://127.0.0.1:8000"
    host: str = "127.0.0.1"
    port: int = 8000

    # Media stream tokens (signed, bound to a CallSid, short-lived, single use).
    stream_token_secret: SecretStr | None = None
    stream_token_ttl_s: float = 60.0

    # Capacity: calls beyond this per process hear a busy message instead.
    max_live_calls: int = 50
    # Agent audio goes to Twilio as it arrives, in media frames of at most this many ms, and a
    # mark closes every this-many ms of audio (and an item's last audio). 20 ms marks every
    # frame; 60 ms sends a third of the marks, and the tracker interpolates between them
    # (bench/bridge.py echo --barge-in measures truncation error against the audio heard).
    twilio_media_chunk_ms: int = Field(default=60, ge=20, multiple_of=20)
    # Largest WebSocket frame accepted from Twilio; a 20 ms media frame is ~250 bytes.
    max_ws_frame_bytes: int = 64 * 1024
    # permessage-deflate on the media socket. Off: compressing every 20 ms base64 frame costs
    # more CPU than the bytes it saves are worth (bench/bridge.py echo, target service-deflate).
    ws_deflate: bool = False
    # The server's event loop: "auto" is uvloop where it is installed, else asyncio's own.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    # SIP (unset SIP_BIND means no SIP listener).
    sip_bind: str | None = None
    sip_rtp_ports: str = "20000-20999"

    tenant_id: str = "default"
    # Customer accounts (caller IDs, PINs) as JSON; unset means every caller is unknown.
    accounts_file: Path | None = None

    # Staff console login.
    console_user: str = "admin"
    console_password: SecretStr | None = None

    log_level: str = "INFO"
    worker_concurrency: int = Field(default=4, ge=1)

    # The system of record workers act on (`voice-agent sor`), and the shared secret that
    # signs its reports to POST /operations/{id}/callback.
    # The system of record. Unset: `serve` and `demo` run the demo one in-process.
    sor_base_url: str | None = None
    sor_callback_secret: SecretStr | None = None
    # How often each worker's sweeper looks for stuck, unknown and expired operations.
    sweep_interval_s: float = Field(default=5.0, gt=0)

    def stream_secret(self) -> bytes:
        """Key for stream tokens: explicit, else derived from the Twilio auth token."""
        if self.stream_token_secret is not None:
            return self.stream_token_secret.get_secret_value().encode()
        return hmac.new(
            self.twilio_auth_token.get_secret_value().encode(), b"stream-token", hashlib.sha256
        ).digest()

    def sor_url(self) -> str:
        """The system of record's base URL (the standalone `voice-agent sor` default)."""
        return self.sor_base_url or "http://127.0.0.1:8766"

    def public_ws_base(self) -> str:
        """The public base URL with a WebSocket scheme."""
        base = self.public_base_url.rstrip("/")
        if base.startswith("https://"):
            return "wss://" + base.removeprefix("https://")
        if base.startswith("http://"):
            return "ws://" + base.removeprefix("http://")
        return base


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
