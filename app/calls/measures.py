"""What calls measure of their audio path, from the events they emit (the bridge knows no
metrics library): how fast a barge-in silenced the agent, and how long the speech model took
to answer the call. Exported on this process's `/metrics` (prometheus-client's registry)."""

from __future__ import annotations

from prometheus_client import Histogram

from telephony.call_events import CallEvent, CallEventKind

BARGE_IN_CLEAR = Histogram(
    "voice_agent_barge_in_clear_seconds",
    "The caller's speech_started received to the leg's audio cleared (Twilio clear sent, "
    "RTP queue flushed, the server's buffer cleared).",
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5),
)
REALTIME_CONNECT = Histogram(
    "voice_agent_realtime_connect_seconds",
    "A call's first connection to the speech model, attempts included, until configured.",
    buckets=(0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
RTP_JITTER = Histogram(
    "voice_agent_rtp_jitter_seconds",
    "A SIP call's interarrival jitter of the caller's RTP at its end (RFC 3550 estimate).",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32),
)
RTP_LOSS = Histogram(
    "voice_agent_rtp_packet_loss_ratio",
    "A SIP call's share of the caller's RTP packets lost (expected minus received).",
    buckets=(0.0, 0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0),
)


def observe(event: CallEvent) -> None:
    """Take what the audio path's measures need from one call event (cheap: a kind check)."""
    kind = event.kind
    if kind is CallEventKind.BARGE_IN:
        ms = event.data.get("clear_latency_ms")
        if isinstance(ms, int | float):
            BARGE_IN_CLEAR.observe(ms / 1000)
    elif kind is CallEventKind.CALL_ENDED:
        media = event.data.get("media")
        if isinstance(media, dict) and media.get("packets_expected"):
            jitter = media.get("jitter_ms")
            loss = media.get("loss_ratio")
            if isinstance(jitter, int | float):
                RTP_JITTER.observe(jitter / 1000)
            if isinstance(loss, int | float):
                RTP_LOSS.observe(loss)
    elif kind is CallEventKind.REALTIME_CONNECTED:
        ms = event.data.get("connect_ms")
        if isinstance(ms, int | float):
            REALTIME_CONNECT.observe(ms / 1000)
