"""SDP offer/answer for one audio stream: G.711 (PCMU or PCMA) plus RFC 4733 telephone-event.

aiosipua parses, negotiates and serializes; this module decides what we accept: the first of
PCMU/PCMA in the offer's preference order, telephone-event at 8 kHz with the offer's own
payload type, packets of the offer's `ptime` where we can pace it (10, 20, 30, 40 or 60 ms,
within its `maxptime`; 20 ms otherwise), and the direction answer of RFC 3264 section 6.1 (a
`sendonly` hold is answered `recvonly`, `inactive` with `inactive`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, replace
from typing import Literal

from aiosipua import SdpMessage, negotiate_sdp, parse_sdp, serialize_sdp
from aiosipua.sdp import (
    Codec as SdpCodec,
)
from aiosipua.sdp import (
    ConnectionData,
    MediaDescription,
    Origin,
    TimingField,
)

from telephony.legs.leg import AudioFormat
from telephony.legs.sip.errors import SdpError

Direction = Literal["sendrecv", "sendonly", "recvonly", "inactive"]
DIRECTIONS: tuple[Direction, ...] = ("sendrecv", "sendonly", "recvonly", "inactive")
ANSWER_DIRECTION: dict[Direction, Direction] = {
    "sendrecv": "sendrecv",
    "sendonly": "recvonly",
    "recvonly": "sendonly",
    "inactive": "inactive",
}
PTIME_MS = 20
# Packet times the RTP clock can pace (it ticks every 20 ms, or 10 ms for 10 and 30).
PTIMES = (10, 20, 30, 40, 60)
MAX_SDP_BYTES = 16 * 1024
RTP_PROFILES = frozenset({"RTP/AVP", "RTP/AVPF"})
DEFAULT_DTMF_PT = 101


@dataclass(frozen=True, slots=True)
class Codec:
    """A G.711 codec as RTP and the Realtime session know it."""

    name: str
    payload_type: int
    audio_format: AudioFormat
    silence: int  # the byte of digital silence in this law


PCMU = Codec("PCMU", 0, "audio/pcmu", 0xFF)
PCMA = Codec("PCMA", 8, "audio/pcma", 0xD5)
CODECS = {PCMU.payload_type: PCMU, PCMA.payload_type: PCMA}


@dataclass(frozen=True, slots=True)
class RemoteMedia:
    """What the peer's SDP says: where to send, which codec, and which way media flows."""

    codec: Codec
    dtmf_pt: int | None
    address: tuple[str, int] | None  # None: on hold (c=0.0.0.0 or port 0)
    direction: Direction  # the peer's direction, from its point of view
    # RTCP (RFC 3550): multiplexed on the RTP port (RFC 5761 `a=rtcp-mux`), else at the port
    # of `a=rtcp` (RFC 3605) or the RTP port + 1.
    rtcp_mux: bool = False
    rtcp_port: int | None = None
    # Our packet time toward this peer (`choose_ptime` of its offer), in ms.
    ptime: int = PTIME_MS

    @property
    def rtcp_address(self) -> tuple[str, int] | None:
        """Where the peer takes RTCP (None: on hold)."""
        if self.address is None:
            return None
        if self.rtcp_mux:
            return self.address
        return self.address[0], self.rtcp_port or self.address[1] + 1

    @property
    def we_send(self) -> bool:
        """Whether we may send RTP: the peer receives and told us where."""
        return self.address is not None and self.direction in ("sendrecv", "recvonly")

    @property
    def we_receive(self) -> bool:
        return self.direction in ("sendrecv", "sendonly")


def _direction(sdp: SdpMessage, media: MediaDescription) -> Direction:
    for attrs in (media.attributes, sdp.attributes):
        for d in DIRECTIONS:
            if d in attrs:
                return d
    return "sendrecv"


def _decode(body: bytes) -> SdpMessage:
    if len(body) > MAX_SDP_BYTES:
        raise SdpError("SDP too large", 400)
    try:
        return parse_sdp(body.decode("utf-8"))
    except Exception as exc:  # aiosipua raises ValueError on bad numbers
        raise SdpError(f"unparsable SDP: {type(exc).__name__}", 400) from None


def _audio(sdp: SdpMessage) -> tuple[int, MediaDescription]:
    for index, media in enumerate(sdp.media):
        if media.media == "audio" and media.port > 0 and media.proto.upper() in RTP_PROFILES:
            return index, media
    for media in sdp.media:
        if media.media == "audio" and media.proto.upper() not in RTP_PROFILES:
            raise SdpError(f"unsupported media profile {media.proto[:20]}")
    raise SdpError("no audio stream offered")


def _address(sdp: SdpMessage, media: MediaDescription) -> tuple[str, int] | None:
    conn = media.connection or sdp.connection
    if conn is None:
        raise SdpError("no connection address", 400)
    try:
        ip = ipaddress.ip_address(conn.address.split("/")[0])
    except ValueError:
        raise SdpError("connection address is not an IP address") from None
    if ip.is_unspecified or ip.is_multicast:
        return None  # RFC 2543 hold: c=0.0.0.0
    if not 0 < media.port < 65536:
        raise SdpError("bad media port", 400)
    return str(ip), media.port


def _dtmf_pt(media: MediaDescription) -> int | None:
    for codec in media.codecs:
        if codec.encoding_name.lower() == "telephone-event" and codec.clock_rate in (0, 8000):
            if 96 <= codec.payload_type <= 127:
                return codec.payload_type
    return None


def _codec(media: MediaDescription, allowed: tuple[Codec, ...]) -> Codec:
    allowed_pts = {c.payload_type for c in allowed}
    for codec in media.codecs:
        if codec.payload_type in allowed_pts:
            if codec.encoding_name and codec.encoding_name.upper() not in ("PCMU", "PCMA"):
                continue  # a static number remapped to something else
            if codec.clock_rate not in (0, 8000):
                continue
            return CODECS[codec.payload_type]
    raise SdpError("no common codec (PCMU or PCMA)")


def _ms_attribute(media: MediaDescription, name: str) -> int | None:
    values = media.attributes.get(name) or []
    text = str(values[0]).strip() if values else ""
    try:
        value = float(text)  # RFC 4566 allows a fraction (`ptime:20.0`)
    except ValueError:
        return None
    return round(value) if 0 < value <= 10_000 else None


def choose_ptime(offered: int | None, maxptime: int | None) -> int:
    """Our packet time for an offer: its `ptime` where we can pace it and its `maxptime`
    allows, else the longest we can pace within `maxptime`, else 20 ms (RFC 4566 6: `ptime`
    is what the offerer would like to receive, `maxptime` the most it can take)."""
    limit = maxptime or max(PTIMES)
    if offered in PTIMES and offered <= limit:
        return offered
    if PTIME_MS <= limit and (offered is None or offered not in PTIMES):
        return PTIME_MS
    fitting = [p for p in PTIMES if p <= limit]
    return max(fitting) if fitting else min(PTIMES)


def read_offer(body: bytes, allowed: tuple[Codec, ...] = (PCMU, PCMA)) -> RemoteMedia:
    """The peer's offer; SdpError (488, or 400 when it is not SDP) if we cannot answer it."""
    sdp = _decode(body)
    _, media = _audio(sdp)
    return RemoteMedia(
        codec=_codec(media, allowed),
        dtmf_pt=_dtmf_pt(media),
        address=_address(sdp, media),
        direction=_direction(sdp, media),
        rtcp_mux="rtcp-mux" in media.attributes,
        rtcp_port=_rtcp_port(media),
        ptime=choose_ptime(_ms_attribute(media, "ptime"), _ms_attribute(media, "maxptime")),
    )


def _rtcp_port(media: MediaDescription) -> int | None:
    """The port of `a=rtcp:PORT [IN IP4 addr]` (RFC 3605), when it is one."""
    for value in media.attributes.get("rtcp", []):
        head = str(value).split()[0] if str(value).split() else ""
        if head.isdigit() and 0 < int(head) < 65536:
            return int(head)
    return None


def read_answer(body: bytes, codec: Codec) -> RemoteMedia:
    """The peer's answer to our offer (delayed offer: it comes in the ACK). Our packets stay
    at the 20 ms we offered (the stream already runs)."""
    return replace(read_offer(body, (codec,)), ptime=PTIME_MS)


@dataclass(frozen=True, slots=True)
class LocalMedia:
    """Our side of the stream: the address in SDP (advertised) and the RTP port."""

    address: str
    port: int
    session_id: int


def _origin(local: LocalMedia, version: int) -> Origin:
    addr_type = "IP6" if ":" in local.address else "IP4"
    return Origin("-", str(local.session_id), str(version), "IN", addr_type, local.address)


def answer(
    offer_body: bytes,
    remote: RemoteMedia,
    local: LocalMedia,
    version: int,
    direction: Direction,
) -> bytes:
    """Our SDP answer to `offer_body` (already accepted by `read_offer` as `remote`)."""
    offer = _decode(offer_body)
    answer_sdp, _ = negotiate_sdp(
        offer,
        local.address,
        local.port,
        supported_codecs=[remote.codec.payload_type],
        # The offer's payload type, not a fixed 101: RFC 3264 6.1 answers with the offer's.
        dtmf_payload_type=remote.dtmf_pt or 0,
        ptime=remote.ptime,
        session_id=str(local.session_id),
    )
    answer_sdp.origin = _origin(local, version)
    index, _ = _audio(offer)
    media = answer_sdp.media[index]
    for d in DIRECTIONS:
        media.attributes.pop(d, None)
    media.attributes["ptime"] = [str(remote.ptime)]
    media.attributes.pop("maxptime", None)
    if remote.dtmf_pt is not None:
        media.attributes["fmtp"] = [f"{remote.dtmf_pt} 0-15"]
    # RTCP: on the RTP port when the offer multiplexes it, else on the odd port above.
    media.attributes.pop("rtcp-mux", None)
    if remote.rtcp_mux:
        media.attributes["rtcp-mux"] = []
        media.attributes["rtcp"] = [str(local.port)]
    else:
        media.attributes["rtcp"] = [str(local.port + 1)]
    media.attributes[direction] = []
    return serialize_sdp(answer_sdp).encode()


def offer(
    codec: Codec, local: LocalMedia, version: int, direction: Direction = "sendrecv"
) -> bytes:
    """Our offer, for an INVITE that came without one (delayed offer)."""
    addr_type = "IP6" if ":" in local.address else "IP4"
    media = MediaDescription(
        media="audio",
        port=local.port,
        proto="RTP/AVP",
        formats=[str(codec.payload_type), str(DEFAULT_DTMF_PT)],
        attributes={
            "rtpmap": [
                f"{codec.payload_type} {codec.name}/8000",
                f"{DEFAULT_DTMF_PT} telephone-event/8000",
            ],
            "fmtp": [f"{DEFAULT_DTMF_PT} 0-15"],
            "ptime": [str(PTIME_MS)],
            "rtcp": [str(local.port + 1)],
            direction: [],
        },
        codecs=[SdpCodec(codec.payload_type, codec.name, 8000)],
    )
    sdp = SdpMessage(
        origin=_origin(local, version),
        session_name="-",
        connection=ConnectionData("IN", addr_type, local.address),
        timing=TimingField(0, 0),
        media=[media],
    )
    return serialize_sdp(sdp).encode()
