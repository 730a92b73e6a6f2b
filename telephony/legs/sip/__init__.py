"""Our SIP user agent server: a sans-I/O transaction and dialog core (datagrams and a clock
in, messages and timer deadlines out), SDP and digest, the thin asyncio transport around it,
RTP, and the SIP leg the bridge plays through."""
