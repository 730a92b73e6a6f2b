"""Service settings, read once from the environment."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import logging
from functools import lru_cache
from pathlib import Path
from typing import Literal, Self
from urllib.parse import urlsplit

from pydantic import (
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from telephony.legs.sip.access import parse_networks
from telephony.legs.sip.ports import parse_range


class Settings(BaseSettings):
    """Every knob of the service. Tests build their own instance instead of patching."""

    # An empty variable (`OPENAI_API_KEY=` in a compose file) means unset, not "".
    model_config = SettingsConfigDict(
        env_file=None, extra="ignore", case_sensitive=False, env_ignore_empty=True
    )

    # Storage. No DATABASE_URL means: start an embedded PostgreSQL in `data_dir`.
    database_url: str | None = None
    data_dir: Path = Path(".voice-agent")

    # OpenAI. No OPENAI_API_KEY means: the offline demo against the local simulator, but only
    # where nothing looks like production (see app/realtime_check.py).
    openai_api_key: SecretStr | None = None
    openai_base_url: str | None = None
    openai_realtime_model: str = "gpt-realtime"
    # Which OpenAI voice model calls talk to: the Realtime API (client-driven turns, truncate at
    # heard audio) or GPT-Live (server-driven turns, tools delegated to a Responses model,
    # LIVE_DELEGATION_MODEL, whose function calls come to our engine). See the README.
    model_api: Literal["realtime", "live"] = "realtime"
    live_model: str = Field(default="gpt-live-1", min_length=1)
    live_delegation_model: str = Field(default="gpt-5-mini", min_length=1)
    # Who works out what GPT-Live delegates: `responses` (OpenAI runs LIVE_DELEGATION_MODEL and
    # sends us its function calls) or `client` (our own backend agent calls the Responses API
    # at LIVE_BACKEND_BASE_URL, default OPENAI_BASE_URL, with the same tools; see the README).
    live_delegation: Literal["responses", "client"] = "responses"
    live_backend_base_url: str | None = None
    openai_webhook_secret: SecretStr | None = None
    realtime_voice: str = "marin"
    # Calls talk to a simulator: true always (even with a key), false never (no key: `serve`
    # refuses), unset: when OPENAI_API_KEY is unset and nothing looks like production.
    realtime_simulator: bool | None = None
    # `serve` checks OPENAI_API_KEY with one models request; after this long it starts anyway
    # (with a warning: the API may be briefly unreachable).
    openai_check_timeout_s: float = Field(default=5.0, gt=0)
    # semantic_vad eagerness; "low" suits callers who give long narrative answers.
    vad_eagerness: Literal["auto", "low", "medium", "high"] = "auto"
    # How long the bridge may spend re-opening a dropped Realtime session.
    realtime_reconnect_budget_s: float = Field(default=5.0, ge=0)
    # Function calls one model response may make, and calls of one call running at once;
    # the excess is refused to the model (speakable) and never reaches a provider.
    max_tool_calls_per_response: int = Field(default=8, ge=1, le=128)
    max_tool_calls_in_flight: int = Field(default=4, ge=1, le=64)

    # Twilio.
    twilio_account_sid: str = "AC00000000000000000000000000000000"
    twilio_auth_token: SecretStr = SecretStr("dev-auth-token")
    twilio_from_number: str = "+15550000000"
    twilio_api_base_url: str | None = None

    # Where Twilio reaches us; TLS usually ends at a proxy, so signatures use this, not the
    # Host header.
    public_base_url: str = "http://127.0.0.1:8000"
    host: str = Field(default="127.0.0.1", min_length=1)
    # 0: any free port (tests).
    port: int = Field(default=8000, ge=0, le=65535)

    # Media stream tokens (signed, bound to a CallSid, short-lived, single use).
    stream_token_secret: SecretStr | None = None
    stream_token_ttl_s: float = Field(default=60.0, gt=0)

    # Capacity: calls beyond this per process hear a busy message instead (0 would make every
    # call hear busy, so it is refused).
    max_live_calls: int = Field(default=50, ge=1)
    # Overload: while the event loop has run its timers this late (ms, the median of the last
    # 5 s), new calls hear busy as at capacity: the process cannot carry more without every
    # live call hearing gaps. 0: never (only MAX_LIVE_CALLS refuses).
    busy_loop_lag_ms: float = Field(default=100.0, ge=0)
    # `serve` freezes what survived a collection this often (s), so a full collection walks
    # only what was allocated since, not every live call's state (app/gc_steward.py); the
    # collection walks what survived since the last one, so shorter is shorter (at 100 calls
    # with churn: 5 s took up to 40 ms, 1 s under 20 ms). 0: frozen once at start only.
    gc_freeze_every_s: float = Field(default=1.0, ge=0)
    # On SIGTERM/SIGINT, live calls may go on for this long (new calls hear busy, /readyz
    # fails); the rest are then ended. Keep it under the orchestrator's grace period.
    drain_timeout_s: float = Field(default=30.0, ge=0)
    # Agent audio goes to Twilio as it arrives, in media frames of at most this many ms, and a
    # mark closes every this-many ms of audio (and an item's last audio). 20 ms marks every
    # frame; 100 ms sends a fifth of the marks (each echoed back: a read and a parse for
    # us), and the tracker interpolates between them. bench/bridge.py echo --barge-in
    # measured the truncation error against the audio heard the same at 60 and 100 ms (p99
    # 5-7 ms at 50 calls, within the spread between runs).
    twilio_media_chunk_ms: int = Field(default=100, ge=20, multiple_of=20)
    # Largest WebSocket frame accepted from Twilio; a 20 ms media frame is ~250 bytes, a
    # `start` with its parameters and stream token about 1 KiB.
    max_ws_frame_bytes: int = Field(default=64 * 1024, ge=4096)
    # permessage-deflate on the media socket. Off: compressing every 20 ms base64 frame costs
    # more CPU than the bytes it saves are worth (bench/bridge.py echo, target service-deflate).
    ws_deflate: bool = False
    # The event loop of `serve` and `worker`: "auto" is uvloop where it is installed, else
    # asyncio's own.
    event_loop: Literal["auto", "uvloop", "asyncio"] = "auto"

    # SIP (unset SIP_BIND means no SIP listener): `host:port` for UDP and TCP.
    sip_bind: str | None = None
    # RTP ports for SIP calls (`0`: any free port, for tests).
    sip_rtp_ports: str = "20000-20999"
    # The address in SDP, Via and Contact when we sit behind NAT (default: SIP_BIND's host).
    sip_advertised_address: str | None = None
    # Source CIDRs that may send SIP at all, checked before parsing; unset: loopback only.
    sip_allow_from: str | None = None
    # Strict RTP: media is taken from the SDP's address, or (learned after SIP_RTP_PROBATION
    # packets in sequence, within SIP_RTP_LEARN_S of the answer or of a move) another port of
    # the SDP's or the INVITE's host, or a host of SIP_MEDIA_ALLOW_FROM (CIDRs: a trunk whose
    # media comes from other hosts than its signalling). Anything else is dropped.
    sip_media_allow_from: str | None = None
    sip_rtp_learn_s: float = Field(default=3.0, gt=0)
    sip_rtp_probation: int = Field(default=4, ge=1, le=100)
    # Digest authentication of INVITEs: `user:password,user2:password2`; unset: none.
    sip_digest_users: SecretStr | None = None
    # Wrong digest responses allowed per (user, source address) before each further one
    # refuses that pair for a back-off (1 s, doubling per failure, up to the max below).
    sip_digest_failures_allowed: int = Field(default=3, ge=0)
    sip_digest_backoff_max_s: float = Field(default=300.0, gt=0)
    # SIP over TCP: connections at once from one source address (beyond: refused), and
    # how long a connection may carry nothing, not even a CRLF keep-alive, before it is
    # closed (one carrying a call is kept while the call lives).
    sip_tcp_max_per_source: int = Field(default=16, ge=1)
    sip_tcp_idle_s: float = Field(default=180.0, gt=0)
    # New INVITEs per second per source address (a scanner gets 503 beyond it); 0: no limit.
    sip_rate_per_source: float = Field(default=10.0, ge=0)
    # SIP proxies in front of us (CIDRs, as FORWARDED_ALLOW_IPS is for HTTP; e.g. a Kamailio
    # dispatcher): a request from one counts, in the per-source limits (INVITE rate, digest
    # back-off), against the source in the Via below the proxy's own (its `received`, else its
    # host), and its TCP connections are not one source's share. Unset: none.
    sip_trusted_proxies: str | None = None
    # SIP calls per process (default MAX_LIVE_CALLS); beyond it INVITEs get 503.
    sip_max_calls: int | None = Field(default=None, ge=1)
    # How long the Realtime session may take to open before the INVITE gets 503.
    sip_answer_timeout_s: float = Field(default=5.0, gt=0)
    # RFC 3261 T1 (round-trip estimate): retransmissions start at T1, give up after 64*T1.
    sip_t1_s: float = Field(default=0.5, gt=0)
    # Where a transfer to a number is routed (REFER's Refer-To `sip:+E164@<this>;user=phone`):
    # your trunk's or PBX's domain, `host` or `host:port`. Unset: the host of the caller's From.
    sip_transfer_domain: str | None = None

    # OpenAI's SIP interconnect (POST /openai/webhook): To numbers that are ours, E.164,
    # comma-separated (unset: any To is accepted; another To gets 403).
    openai_sip_numbers: str | None = None
    # A dropped sideband gets this long to re-attach; then the call is ended with hangup. A
    # re-attach OpenAI refuses (404: the call ended on its side) ends it at once.
    openai_sip_reattach_budget_s: float = Field(default=3.0, gt=0)
    # Which SIP header vouches for the caller ID the policy engine sees. SIP headers reach us
    # through OpenAI untrusted: `from` (the From user, as trusted as your trunk makes it),
    # `asserted` (P-Asserted-Identity only, for a trunk that sets it), `none` (never).
    openai_sip_caller_id: Literal["from", "asserted", "none"] = "from"
    # Bound of each call-control request (accept, reject, refer, hangup).
    openai_sip_api_timeout_s: float = Field(default=5.0, gt=0)

    # The tools calls may use: a catalog by import path (TOOLS=package.module:catalog, a
    # Catalog or a factory taking a CatalogContext) and/or HTTP tools declared in a YAML file
    # (TOOLS_FILE). Both unset: the restaurant demo.
    tools: str | None = None
    tools_file: Path | None = None
    # Agents that take turns on a call (YAML: name, instructions, tools, handoffs, disclose),
    # checked against the catalog at start; unset: one agent with every tool.
    agents_file: Path | None = None
    # Where the agent may transfer a caller: `name=destination` pairs (E.164 or sip: URI).
    transfer_targets: str | None = None
    # How long a transfer's destination rings before the caller comes back to the agent.
    transfer_ring_timeout_s: int = Field(default=30, ge=5, le=120)
    # Whether the agent may press keys on the line (send_dtmf), e.g. to get through an IVR.
    dtmf_out: bool = False
    # Mutations admitted per hour (sliding), per caller and per tenant: past either, the
    # policy refuses with a speakable reason.
    max_mutations_per_caller: int = Field(default=5, ge=1, le=10_000)
    max_mutations_per_tenant: int = Field(default=500, ge=1, le=10_000_000)
    # Outbound calls (POST /api/calls): how long Twilio rings the number, and how long one
    # Calls.create may take before its outcome is unknown (then reconciled, never re-sent).
    outbound_ring_timeout_s: int = Field(default=30, ge=5, le=600)
    outbound_create_timeout_s: float = Field(default=10.0, gt=0, le=60)
    # How outbound calls are placed: Twilio's Calls.create, or a SIP INVITE from our own SIP
    # listener (SIP_BIND); a `sip:` URI in `to` always goes over SIP.
    outbound_via: Literal["twilio", "sip"] = "twilio"
    # A SIP placing is taken only by a process with a SIP listener (`serve` with SIP_BIND);
    # one that none took this long after it was due fails, with that reason, not hangs.
    sip_place_wait_s: float = Field(default=30.0, gt=0, le=3600)
    # Where our INVITEs go (host:port, a loose Route); a number is called as
    # sip:+E164@<its host>. Unset: straight to a SIP URI's host (numbers cannot be called).
    sip_outbound_proxy: str | None = None
    # Digest credentials for a 401/407 from the proxy or the callee (answered once).
    sip_outbound_user: str | None = None
    sip_outbound_password: SecretStr | None = None
    # Answering-machine detection on outbound SIP calls (telephony/amd.py), since no carrier
    # tells us there who answered; off: whoever answers is taken for a person.
    sip_amd: bool = True
    # Where outbound RTP is paced: a process of its own (its own GIL, so the bridges' event
    # loop cannot make packets late) or a thread of the serving process.
    sip_pacer: Literal["process", "thread"] = "process"

    tenant_id: str = Field(default="default", min_length=1)
    # Customer accounts (caller IDs, PINs) as JSON; unset means every caller is unknown.
    accounts_file: Path | None = None

    # Staff console. CONSOLE_USER/CONSOLE_PASSWORD name the first admin, created on start when
    # no staff account exists (no password: one is generated and shown once on the terminal).
    console_user: str = "admin"
    console_password: SecretStr | None = None
    # HTTP Basic (staff name and password) on the JSON API, for old scripts; off by default:
    # integrations use API tokens.
    console_http_basic: bool = False
    # A console session ends after this long without use, and after `max` in any case.
    console_session_idle_s: float = Field(default=8 * 3600, gt=0)
    console_session_max_s: float = Field(default=7 * 24 * 3600, gt=0)
    # Session cookies carry `Secure`; unset: when PUBLIC_BASE_URL is https (TLS at a proxy).
    console_cookie_secure: bool | None = None
    # Failed logins tolerated within the window: per (account, source address), so guessing
    # from one place never locks the account out from another; per source over all accounts.
    login_max_failures_per_account_source: int = Field(default=5, ge=1)
    login_max_failures_per_source: int = Field(default=20, ge=1)
    # Past this many failures for one account from all sources together (a distributed
    # guesser), the account is not locked: its password is checked at most once per
    # `login_account_slowdown_s`, whatever the source.
    login_max_failures_per_account: int = Field(default=50, ge=1)
    login_account_slowdown_s: float = Field(default=2.0, gt=0)
    login_failure_window_s: float = Field(default=900, gt=0)
    # Phone searches of the calls list: distinct numbers one staff member or token may search
    # within the window (repeating a search is free: the live page refreshes it).
    call_search_max_numbers: int = Field(default=30, ge=1)
    call_search_window_s: float = Field(default=300, gt=0)
    # An operation in flight with no change for this long is "stuck" in the console.
    operation_stuck_after_s: float = Field(default=600, gt=0)

    # Call recordings (both sides, stereo WAV: caller left, agent right).
    recording_enabled: bool = True
    # Where: "postgres" (large objects in DATABASE_URL) or "file" (RECORDING_DIR).
    recording_store: Literal["postgres", "file"] = "postgres"
    recording_dir: Path | None = None  # unset: DATA_DIR/recordings
    # Longer calls keep their first this-many seconds (and say so).
    recording_max_s: float = Field(default=4 * 3600, gt=0)

    # The offline stand-ins' speech (the Realtime simulator without OPENAI_API_KEY, the demo's
    # caller): `auto` speaks eSpeak NG where installed (Piper with SIM_PIPER_VOICE, a local
    # .onnx voice), else the synthetic tones, saying so; `tones` always the tones. With speech,
    # SIM_RECOGNITION decodes the caller's turns with PocketSphinx against the scenario's
    # phrases; SIM_VAD `auto` detects speech with WebRTC's VAD where installed.
    sim_voice: Literal["auto", "tones", "espeak", "piper"] = "auto"
    sim_piper_voice: Path | None = None
    sim_recognition: bool = True
    sim_vad: Literal["auto", "energy", "webrtc"] = "auto"
    speech_cache_dir: Path | None = None  # unset: DATA_DIR/speech-cache

    log_level: str = "INFO"
    # text: one readable line per record; json: one JSON object per line with call_id,
    # operation_id, trace_id and span_id where a line has them (for a log pipeline).
    log_format: Literal["text", "json"] = "text"
    worker_concurrency: int = Field(default=4, ge=1)

    # The restaurant demo's system of record (`voice-agent sor`), and the shared secret that
    # signs a provider's reports to POST /operations/{id}/callback. Unset SOR_BASE_URL with
    # the restaurant catalog: `serve` and `demo` run the demo one in-process.
    sor_base_url: str | None = None
    sor_callback_secret: SecretStr | None = None
    # The database of `voice-agent sor` (default: DATABASE_URL, else the embedded one).
    sor_database_url: str | None = None
    # How often each worker's sweeper looks for stuck, unknown and expired operations (and
    # for deliveries, SMS and webhooks that need another look).
    sweep_interval_s: float = Field(default=5.0, gt=0)
    # Procrastinate queues this process's workers take jobs from (comma-separated):
    # `operations`, `deliveries`, and `operations-sip` (SIP placings), which only a process
    # with a SIP listener takes (naming `operations` takes it there too).
    worker_queues: str = "operations,deliveries"
    # Worker heartbeat, and after how long without one its jobs count as lost.
    worker_heartbeat_s: float = Field(default=5.0, gt=0)
    worker_stalled_after_s: float = Field(default=30.0, gt=0)

    # Call liveness: each process heartbeats the calls it holds; a call whose holder said
    # nothing for CALL_DEAD_AFTER_S is ended by any other process, with the reason on its
    # timeline. A media stream without a single frame for MEDIA_IDLE_TIMEOUT_S is ended
    # by its holder.
    call_heartbeat_s: float = Field(default=5.0, gt=0)
    call_dead_after_s: float = Field(default=30.0, gt=0)
    media_idle_timeout_s: float = Field(default=15.0, gt=0)
    # A Twilio stream lost without `stop` (its socket dropped) is released for this long, so
    # the `<Connect action>` webhook can resume the call on any replica; after it the call is
    # ended as dead (it is capped at CALL_DEAD_AFTER_S, when the sweep ends it anyway).
    call_resume_window_s: float = Field(default=15.0, gt=0)

    # Late results in the call: an announcement cut by a barge-in is offered again at the
    # next safe moment at most this many times, then it goes by SMS.
    announce_max_reoffers: int = Field(default=2, ge=0)
    # An offer the call never reported heard or cut within this is taken back.
    announce_timeout_s: float = Field(default=120.0, gt=0)

    # SMS follow-ups (Twilio Messaging): from TWILIO_FROM_NUMBER, or a Messaging Service.
    twilio_messaging_service_sid: str | None = None
    # Shown at the start of every SMS ("Luigi's: Confirmed: ...").
    sms_sender_name: str | None = None
    # How long one create request may take before its outcome counts as unknown.
    sms_send_timeout_s: float = Field(default=10.0, gt=0)
    # How long after a send with no status callback its status is fetched from Twilio.
    sms_status_poll_s: float = Field(default=60.0, gt=0)
    # A message still `sent` (no receipt) after this counts as delivered as far as we know.
    sms_settle_s: float = Field(default=6 * 3600.0, gt=0)
    # How a result that lands after the call reaches the caller: sms, call (a callback with
    # answering-machine detection), or auto (SMS; a call when the number cannot take SMS).
    late_result_channel: Literal["sms", "call", "auto"] = "sms"
    # Callbacks of one result before it falls back to SMS, and the wait before the next one
    # (doubled after each unanswered call).
    callback_max_attempts: int = Field(default=3, ge=1, le=10)
    callback_retry_s: float = Field(default=300.0, gt=0)
    # Nobody is called in this daily window (HH:MM-HH:MM, in QUIET_HOURS_TZ): a callback due
    # in it is placed when it ends. Unset: no quiet hours.
    quiet_hours: str | None = None
    quiet_hours_tz: str = "UTC"

    # Integrator webhooks for operation status changes, as JSON:
    # [{"url": "https://...", "secret": "whsec_...", "description": "..."}]. More can be
    # added through POST /api/webhooks.
    webhooks: str | None = None
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_base_backoff_s: float = Field(default=2.0, gt=0)
    webhook_timeout_s: float = Field(default=10.0, gt=0)

    # Hardening (issue 13). HTTP: a request's headers must arrive within HTTP_HEADER_TIMEOUT_S
    # of the connection opening (or of the previous response), its body within
    # HTTP_BODY_TIMEOUT_S of its headers; an idle keep-alive connection closes after
    # HTTP_IDLE_TIMEOUT_S; one source address may hold HTTP_MAX_CONNECTIONS_PER_SOURCE.
    http_header_timeout_s: float = Field(default=10.0, gt=0)
    http_body_timeout_s: float = Field(default=10.0, gt=0)
    http_idle_timeout_s: float = Field(default=5.0, gt=0)
    http_max_connections_per_source: int = Field(default=256, ge=1)
    # Request bodies (issue 22): larger ones are refused with 413 while read, before any
    # authentication. Webhooks (Twilio, OpenAI, provider callbacks) are a few hundred bytes.
    http_max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    webhook_max_body_bytes: int = Field(default=64 * 1024, ge=1024)
    # Media sockets that have not yet shown a valid stream token (`start`): per source
    # address and in all; more are refused at the handshake (403).
    media_max_pending_per_source: int = Field(default=64, ge=1)
    media_max_pending_streams: int = Field(default=256, ge=1)
    # Console live streams (SSE): per staff member or API token and in all (more get 429),
    # and how long one stream lives before it ends (the browser reconnects by itself).
    sse_max_streams_per_principal: int = Field(default=8, ge=1)
    sse_max_streams: int = Field(default=128, ge=1)
    sse_max_lifetime_s: float = Field(default=300.0, gt=0)
    # `/metrics` on its own `host:port` (meant for a private network); unset: on the main port.
    metrics_bind: str | None = None
    # A link from the console to a call's or an operation's trace in your tracing UI, with
    # `{trace_id}` where the id goes (Jaeger: https://jaeger.example/trace/{trace_id}).
    trace_url_template: str | None = None
    # Caller verification: this many wrong PINs within the window, across calls, per account
    # and per caller number, lock verification for PIN_LOCKOUT_S.
    pin_max_failures: int = Field(default=3, ge=1)
    pin_failure_window_s: float = Field(default=900.0, gt=0)
    pin_lockout_s: float = Field(default=900.0, gt=0)
    # Per media stream budgets; a stream that exceeds one is ended as abusive.
    media_max_frames_before_start: int = Field(default=20, ge=1)
    media_max_malformed_frames: int = Field(default=100, ge=1)
    media_max_dtmf: int = Field(default=200, ge=1)
    # Deprecated: provider callbacks signed with the old body-only `X-Signature` are refused
    # unless this is set (Standard Webhooks headers are the scheme now).
    sor_callback_accept_legacy_signature: bool = False
    # Control endpoints (fault modes) of the in-process demo system of record need this
    # bearer token; unset: a random one per start, so nothing else can drive them.
    sor_control_token: SecretStr | None = None

    # ---- validation: a bad value stops the command with one line naming it and the fix, not
    # a traceback from deep inside (or, worse, a service that starts and fails every call).
    # Each message says what is wrong and how to write it; `setting_problems` adds the name.

    @field_validator("public_base_url")
    @classmethod
    def _public_url(cls, value: str) -> str:
        return _http_url(value, "https://voice.example.com (the URL Twilio calls)")

    @field_validator("openai_base_url", "twilio_api_base_url", "sor_base_url")
    @classmethod
    def _base_url(cls, value: str | None, info: ValidationInfo) -> str | None:
        return None if value is None else _http_url(value, _URL_EXAMPLES[info.field_name or ""])

    @field_validator("sip_bind")
    @classmethod
    def _sip_bind(cls, value: str | None) -> str | None:
        if value is not None:
            host, _ = host_port(value, "0.0.0.0:5060")
            _ip_literal(host, "the address to listen on, e.g. 0.0.0.0:5060")
        return value

    @field_validator("sip_outbound_proxy")
    @classmethod
    def _sip_outbound_proxy(cls, value: str | None) -> str | None:
        if value is not None:
            host_port(value, "sip.example.net:5060")
        return value

    @field_validator("trace_url_template")
    @classmethod
    def _trace_url_template(cls, value: str | None) -> str | None:
        if value is not None and "{trace_id}" not in value:
            raise ValueError(
                "TRACE_URL_TEMPLATE must say where the trace id goes, as {trace_id} "
                "(for example https://jaeger.example/trace/{trace_id})"
            )
        return value

    @model_validator(mode="after")
    def _check_quiet_hours(self) -> Self:
        from tools.quiet_hours import QuietHours, zone

        zone(self.quiet_hours_tz)
        if self.quiet_hours:
            QuietHours.parse(self.quiet_hours, self.quiet_hours_tz)
        return self

    @field_validator("transfer_targets")
    @classmethod
    def _transfer_targets(cls, value: str | None) -> str | None:
        from tools.transfers import parse_targets

        parse_targets(value)  # TransferTargetError (a ValueError) names the entry and the fix
        return value

    @field_validator("metrics_bind")
    @classmethod
    def _metrics_bind(cls, value: str | None) -> str | None:
        if value is not None:
            host_port(value, "10.0.0.5:9100")
        return value

    @field_validator("sip_transfer_domain")
    @classmethod
    def _transfer_domain(cls, value: str | None) -> str | None:
        from telephony.legs.sip.refer import HOST

        if value is not None and not HOST.match(value.strip()):
            raise ValueError(
                f"SIP_TRANSFER_DOMAIN: {value[:64]!r} is not a host or host:port "
                "(e.g. trunk.example.com or 192.0.2.10:5060)"
            )
        return value.strip() if value is not None else None

    @field_validator("sip_advertised_address")
    @classmethod
    def _advertised(cls, value: str | None) -> str | None:
        if value is not None:
            _ip_literal(value.strip("[]"), "the public IP address SDP and Contact carry")
        return value

    @field_validator("sip_rtp_ports")
    @classmethod
    def _rtp_ports(cls, value: str) -> str:
        try:
            bounds = parse_range(value)
        except ValueError as exc:
            fix = "set e.g. 20000-20999 (or 0: any free port)"
            raise ValueError(f"{_unprefixed(exc)}: {fix}") from None
        if bounds is not None and bounds[0] == bounds[1] and bounds[0] % 2:
            # RTP takes even ports (RTCP the odd one above): this range has none.
            raise ValueError(f"{value!r} holds no even port: set e.g. 20000-20999")
        return value

    @field_validator("sip_allow_from")
    @classmethod
    def _allow_from(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_networks(value)
            except ValueError as exc:
                fix = "list CIDRs, e.g. 203.0.113.0/24,10.0.0.5"
                raise ValueError(f"{_unprefixed(exc)}: {fix}") from None
        return value

    @field_validator("sip_trusted_proxies")
    @classmethod
    def _trusted_proxies(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_networks(value, "SIP_TRUSTED_PROXIES")
            except ValueError as exc:
                fix = "list your SIP proxies' CIDRs, e.g. 10.0.0.10,10.0.1.0/24"
                raise ValueError(f"{_unprefixed(exc)}: {fix}") from None
        return value

    @field_validator("sip_digest_users")
    @classmethod
    def _digest_users(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            from telephony.legs.sip.digest import parse_users  # aiosipua: only when set

            try:
                parse_users(value.get_secret_value())
            except ValueError:
                raise ValueError("write it as user:password,user2:password2") from None
        return value

    @field_validator("console_user")
    @classmethod
    def _console_user(cls, value: str) -> str:
        from app.access.usernames import StaffError, check_username

        try:
            check_username(value)
        except StaffError as exc:
            raise ValueError(f"{exc}: e.g. admin") from None
        return value

    @field_validator("console_password")
    @classmethod
    def _console_password(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None:
            from app.access.passwords import WeakPassword, check_strength  # argon2: only when set

            try:
                check_strength(value.get_secret_value())
            except WeakPassword as exc:
                fix = "choose another (or unset it: one is generated)"
                raise ValueError(f"{exc}: {fix}") from None
        return value

    @field_validator("log_level")
    @classmethod
    def _log_level(cls, value: str) -> str:
        if value.upper() not in logging.getLevelNamesMapping():
            raise ValueError(f"{value!r} is not a level: use DEBUG, INFO, WARNING or ERROR")
        return value

    @field_validator("webhooks")
    @classmethod
    def _webhooks(cls, value: str | None) -> str | None:
        if value:
            _webhook_list(value)
        return value

    @model_validator(mode="after")
    def _heartbeats(self) -> Self:
        # A liveness limit at or under its heartbeat declares healthy calls (or workers) dead.
        if self.call_dead_after_s <= self.call_heartbeat_s:
            raise ValueError(
                f"CALL_DEAD_AFTER_S ({self.call_dead_after_s:g}) must be above "
                f"CALL_HEARTBEAT_S ({self.call_heartbeat_s:g}), or live calls are ended as dead: "
                "keep it several heartbeats long (default 30 and 5)"
            )
        if self.worker_stalled_after_s <= self.worker_heartbeat_s:
            raise ValueError(
                f"WORKER_STALLED_AFTER_S ({self.worker_stalled_after_s:g}) must be above "
                f"WORKER_HEARTBEAT_S ({self.worker_heartbeat_s:g}), or running jobs count as "
                "lost: keep it several heartbeats long (default 30 and 5)"
            )
        if self.console_session_idle_s > self.console_session_max_s:
            raise ValueError(
                "CONSOLE_SESSION_IDLE_S must not be above CONSOLE_SESSION_MAX_S: lower it or "
                "raise the maximum"
            )
        return self

    def stream_secret(self) -> bytes:
        """Key for stream tokens: explicit, else derived from the Twilio auth token."""
        if self.stream_token_secret is not None:
            return self.stream_token_secret.get_secret_value().encode()
        return hmac.new(
            self.twilio_auth_token.get_secret_value().encode(), b"stream-token", hashlib.sha256
        ).digest()

    def cookie_secure(self) -> bool:
        """Whether console cookies need TLS: explicit, else when the public URL is https."""
        if self.console_cookie_secure is not None:
            return self.console_cookie_secure
        return self.public_base_url.startswith("https://")

    def recordings_path(self) -> Path:
        """The file store's directory."""
        return self.recording_dir or self.data_dir / "recordings"

    def speech_cache_path(self) -> Path:
        """Where synthesised lines are kept between runs."""
        return self.speech_cache_dir or self.data_dir / "speech-cache"

    def queues(self) -> list[str]:
        """The worker queues, in order."""
        return [q.strip() for q in self.worker_queues.split(",") if q.strip()]

    def configured_webhooks(self) -> list[dict[str, str]]:
        """WEBHOOKS as a list of {url, secret, description}; a malformed value is an error."""
        if not self.webhooks:
            return []
        return _webhook_list(self.webhooks)

    def openai_sip_number_set(self) -> frozenset[str] | None:
        """OPENAI_SIP_NUMBERS as a set (None: every To number is ours)."""
        if not self.openai_sip_numbers:
            return None
        return frozenset(n.strip() for n in self.openai_sip_numbers.split(",") if n.strip())

    def public_ws_base(self) -> str:
        """The public base URL with a WebSocket scheme."""
        base = self.public_base_url.rstrip("/")
        if base.startswith("https://"):
            return "wss://" + base.removeprefix("https://")
        if base.startswith("http://"):
            return "ws://" + base.removeprefix("http://")
        return base


_URL_EXAMPLES = {
    "openai_base_url": "http://127.0.0.1:8765/v1",
    "twilio_api_base_url": "http://127.0.0.1:8780",
    "sor_base_url": "http://127.0.0.1:8766",
}


def host_port(value: str, example: str) -> tuple[str, int]:
    """`127.0.0.1:5060`, `[::1]:5060` -> (host, port); ValueError with the fix otherwise."""
    spec = value.strip()
    if spec.startswith("["):
        host, _, rest = spec[1:].partition("]")
        port_text = rest.removeprefix(":")
    else:
        host, _, port_text = spec.rpartition(":")
    if not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ValueError(f"{value!r} is not host:port: write it as {example}")
    return host, int(port_text)


def _ip_literal(host: str, what: str) -> None:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{host!r} is not an IP address: give {what}") from None


def _http_url(value: str, example: str) -> str:
    parts = urlsplit(value.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"{value!r} is not an http(s) URL: write it with its scheme, e.g. {example}"
        )
    try:
        parts.port  # noqa: B018 - raises ValueError for a port that is not a number
    except ValueError:
        raise ValueError(f"{value!r} has a bad port: write it as e.g. {example}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"{value!r} carries a query or fragment: give the base URL alone")
    return value.strip()


def _webhook_list(text: str) -> list[dict[str, str]]:
    fix = 'write a JSON list such as [{"url": "https://...", "secret": "whsec_..."}]'
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"not JSON: {fix}") from None
    if not isinstance(data, list) or not all(
        isinstance(d, dict) and "url" in d and "secret" in d for d in data
    ):
        raise ValueError(f"not a list of {{url, secret}} objects: {fix}")
    return data


def _unprefixed(exc: ValueError) -> str:
    """A parser's message without its own `NAME: ` prefix (the report adds the name)."""
    text = str(exc)
    head, sep, rest = text.partition(": ")
    return rest if sep and head.isupper() else text


def setting_problems(exc: ValidationError) -> list[str]:
    """One line per bad setting: `NAME: what is wrong: the fix` (values of secrets not shown)."""
    out = []
    for error in exc.errors(include_url=False, include_input=False):
        field = str(error["loc"][0]) if error["loc"] else ""
        message = str(error["msg"])
        if message.startswith("Value error, "):
            message = message.removeprefix("Value error, ")  # ours: it names the fix
        elif field in Settings.model_fields:
            # pydantic's own ("Input should be greater than or equal to 1"): the default
            # shows a value that works.
            default = Settings.model_fields[field].default
            message = message.removeprefix("Input ")
            if default is not None and not isinstance(default, SecretStr):
                message += f" (default {default})"
        out.append(f"{field.upper()}: {message}" if field else message)
    return out


@lru_cache
def get_settings() -> Settings:
    """The process-wide settings, read from the environment once."""
    return Settings()
