"""The multi-replica layout on real parts (`make cluster-test`): `voice-agent cluster` starts
PostgreSQL's database, two `serve` replicas, a worker, nginx and Kamailio as processes on
loopback, and SIP calls and a Twilio call go through the proxies as a carrier's would.

Skipped where Kamailio or nginx is missing, unless VOICE_AGENT_REQUIRE_CLUSTER=1 (CI installs
both and sets it): then a missing one fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pytest
from aiosipua import SipResponse

from app.cli.cluster import free_port, sip_options
from telephony.sim.fake_caller import FakeTwilioCaller
from tests.e2e_support import wait_until
from tests.sip_support import UdpPeer, sdp_offer

MISSING = [
    name
    for name in ("kamailio", "nginx")
    if shutil.which(name) is None and shutil.which(name, path="/usr/sbin") is None
]
if MISSING and os.environ.get("VOICE_AGENT_REQUIRE_CLUSTER") == "1":
    raise RuntimeError(f"VOICE_AGENT_REQUIRE_CLUSTER=1 but {', '.join(MISSING)} missing")
pytestmark = [
    pytest.mark.cluster,
    pytest.mark.timeout(300),
    pytest.mark.skipif(bool(MISSING), reason=f"{', '.join(MISSING)} missing (apt-get install)"),
]

START_WAIT_S = 150.0


@dataclass
class RunningCluster:
    """A `voice-agent cluster` process and what its endpoints.json says."""

    process: subprocess.Popen[bytes]
    directory: Path
    endpoints: dict[str, Any] = field(default_factory=dict)

    @property
    def edge(self) -> tuple[str, int]:
        host, port = self.endpoints["sip"].rsplit(":", 1)
        return host, int(port)

    def replica(self, sip: str) -> dict[str, Any]:
        """The replica whose SIP listener is `sip` (host:port)."""
        return next(r for r in self.endpoints["replicas"] if r["sip"] == sip)

    def log(self, name: str) -> str:
        path = self.directory / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""


# What each replica's drain may take when the fixture stops the cluster. A Twilio call whose
# caller hung up stays answered until Twilio's status callback, which no test sends: a
# replica holding one drains for all of DRAIN_TIMEOUT_S (30 s by default) before it stops.
# Only the draining test's replica must outlive its live call; the others stop in seconds.
SHORT_DRAIN_S = 2.0
FULL_DRAIN_S = 30.0


@pytest.fixture
def cluster(database_url: str, tmp_path: Path) -> Iterator[RunningCluster]:
    """A fresh cluster (on this session's database) for one test: some tests break it."""
    yield from _run_cluster(database_url, tmp_path, SHORT_DRAIN_S)


@pytest.fixture
def draining_cluster(database_url: str, tmp_path: Path) -> Iterator[RunningCluster]:
    """A fresh cluster whose replicas drain for DRAIN_TIMEOUT_S's default: long enough for a
    draining replica's live call to go on while the test dials others."""
    yield from _run_cluster(database_url, tmp_path, FULL_DRAIN_S)


def _run_cluster(database_url: str, tmp_path: Path, drain_s: float) -> Iterator[RunningCluster]:
    directory = tmp_path / "cluster"
    out = (tmp_path / "cluster.out").open("wb")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "app.cli", "cluster", "--dir", str(directory)),
            *("--http-port", str(free_port("127.0.0.1"))),
            *("--sip-port", str(free_port("127.0.0.1", socket.SOCK_DGRAM))),
            *("--rtp-base", "0", "--simulator", "--database-url", database_url),
            *("--ds-ping-interval", "1"),
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "DRAIN_TIMEOUT_S": f"{drain_s:g}"},  # the replicas inherit it
    )
    running = RunningCluster(process, directory)
    try:
        endpoints = directory / "endpoints.json"
        deadline = time.monotonic() + START_WAIT_S
        while not endpoints.exists():
            if process.poll() is not None or time.monotonic() > deadline:
                out.flush()
                pytest.fail(
                    "the cluster did not start:\n"
                    + (tmp_path / "cluster.out").read_text(errors="replace")[-4000:]
                    + "\nkamailio:\n"
                    + running.log("kamailio")
                )
            time.sleep(0.3)
        running.endpoints = json.loads(endpoints.read_text())
        yield running
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(120)
            except subprocess.TimeoutExpired:
                process.kill()  # its parts die with it (PR_SET_PDEATHSIG)
                process.wait(10)
        out.close()


@dataclass
class EdgeCall:
    """One SIP caller dialling through the edge: INVITE, then ACK and BYE by the route set."""

    edge: tuple[str, int]
    peer: UdpPeer
    call_id: str = field(default_factory=lambda: secrets.token_hex(10) + "@cluster-test")
    from_tag: str = field(default_factory=lambda: secrets.token_hex(4))
    to_tag: str = ""
    target: str = ""
    route: list[str] = field(default_factory=list)
    cseq: int = 1
    status: int = 0
    replica_sip: str = ""  # host:port of the replica that answered
    answer_s: float = 0.0
    opened: ClassVar[list[EdgeCall]] = []  # closed by `close_callers` when the test ends

    @classmethod
    async def dial(cls, edge: tuple[str, int], within: float = 20.0) -> EdgeCall:
        call = cls(edge, await UdpPeer.open())
        cls.opened.append(call)
        started = time.monotonic()
        edge_uri = f"sip:agent@{edge[0]}:{edge[1]}"
        call.peer.send(call._request("INVITE", edge_uri, body=sdp_offer(port=40000)), edge)
        final = await call.peer.message(
            lambda m: isinstance(m, SipResponse) and m.status_code >= 200, within=within
        )
        assert isinstance(final, SipResponse)
        call.answer_s = time.monotonic() - started
        call.status = final.status_code
        if call.status == 200:
            to = final.to_addr
            call.to_tag = to.tag if to is not None and to.tag else ""
            call.route = list(reversed(final.headers.get("record-route")))
            contact = final.headers.get_first("contact") or ""
            call.target = contact.split("<", 1)[-1].split(">", 1)[0]
            call.replica_sip = call.target.split("@", 1)[-1].split(";", 1)[0]
            call.peer.send(call._request("ACK", call.target, cseq=1), edge)
        return call

    def _request(
        self, method: str, uri: str, *, body: bytes = b"", cseq: int | None = None
    ) -> bytes:
        branch = "z9hG4bK" + secrets.token_hex(8)
        port = self.peer.port
        to = f"<sip:agent@{self.edge[0]}:{self.edge[1]}>" + (
            f";tag={self.to_tag}" if self.to_tag else ""
        )
        lines = [
            f"{method} {uri} SIP/2.0",
            f"Via: SIP/2.0/UDP 127.0.0.1:{port};branch={branch};rport",
            "Max-Forwards: 70",
            f"From: <sip:+15551230000@127.0.0.1>;tag={self.from_tag}",
            f"To: {to}",
            f"Call-ID: {self.call_id}",
            f"CSeq: {cseq if cseq is not None else self.cseq} {method}",
            f"Contact: <sip:caller@127.0.0.1:{port}>",
            *(f"Route: {hop}" for hop in self.route),
        ]
        if body:
            lines.append("Content-Type: application/sdp")
        lines.append(f"Content-Length: {len(body)}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode() + body

    async def hang_up(self) -> int:
        """BYE through the edge (the route set leads to the replica holding the call)."""
        self.cseq += 1
        start = len(self.peer.got)
        self.peer.send(self._request("BYE", self.target), self.edge)
        done = await self.peer.message(
            lambda m: (
                isinstance(m, SipResponse)
                and m.status_code >= 200
                and "BYE" in (m.headers.get_first("cseq") or "")
            ),
            start=start,
        )
        self.peer.close()
        assert isinstance(done, SipResponse)
        return done.status_code


@pytest.fixture(autouse=True)
async def close_callers() -> AsyncIterator[None]:
    """Every caller's socket is closed when its test ends, also when it failed half-way."""
    yield
    while EdgeCall.opened:
        EdgeCall.opened.pop().peer.close()


async def dial_all(cluster: RunningCluster, n: int) -> list[EdgeCall]:
    """`n` calls one after another through the edge, each answered before the next."""
    calls = []
    for _ in range(n):
        call = await EdgeCall.dial(cluster.edge)
        assert call.status == 200, f"a call through Kamailio got {call.status}\n" + "".join(
            f"{name}:\n{cluster.log(name)}\n"
            for name in ("kamailio", *(r["name"] for r in cluster.endpoints["replicas"]))
        )
        calls.append(call)
    return calls


async def hang_up_all(calls: list[EdgeCall]) -> None:
    for call in calls:
        assert await call.hang_up() == 200


def landed(cluster: RunningCluster, calls: list[EdgeCall]) -> Counter[str]:
    return Counter(cluster.replica(c.replica_sip)["name"] for c in calls)


async def options_status(sip: str, user: str | None = None) -> int | None:
    host, port = sip.rsplit(":", 1)
    return await asyncio.to_thread(sip_options, host, int(port), user=user)


def process_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # A zombie (the cluster process has not reaped it yet) counts as gone.
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split(")", 1)[-1].split()[0] == "Z"


async def test_sip_calls_through_kamailio_spread_over_both_replicas(
    cluster: RunningCluster,
) -> None:
    calls = await dial_all(cluster, 4)
    spread = landed(cluster, calls)
    print(f"4 calls through Kamailio: {dict(spread)}; answer times "
          f"{[round(c.answer_s, 2) for c in calls]} s")  # fmt: skip
    assert set(spread) == {"replica-1", "replica-2"}
    # Record-Route: every BYE, sent to Kamailio, reached the replica holding its call.
    await hang_up_all(calls)


async def test_a_draining_replica_gets_no_new_calls_while_its_live_call_finishes(
    draining_cluster: RunningCluster,
) -> None:
    cluster = draining_cluster
    live = await EdgeCall.dial(cluster.edge)
    assert live.status == 200
    draining = cluster.replica(live.replica_sip)
    os.kill(draining["pid"], signal.SIGTERM)
    # What Kamailio's probe hears from it now.

    async def probed_503() -> bool:
        return await options_status(draining["sip"]) == 503

    await wait_until(probed_503, 20, "the draining replica answers OPTIONS 503")
    calls = await dial_all(cluster, 4)
    spread = landed(cluster, calls)
    print(f"4 calls while {draining['name']} drains: {dict(spread)}; answer times "
          f"{[round(c.answer_s, 2) for c in calls]} s")  # fmt: skip
    assert draining["name"] not in spread
    assert not process_gone(draining["pid"]), "it stopped with a call still live"
    # Its live call goes on and ends normally, through the edge; then the replica stops.
    assert await live.hang_up() == 200
    await wait_until(lambda: process_gone(draining["pid"]), 40, "the drained replica stops")
    await hang_up_all(calls)


async def test_a_killed_replica_gets_no_new_calls_and_the_other_takes_them(
    cluster: RunningCluster,
) -> None:
    victim = cluster.endpoints["replicas"][0]
    os.kill(victim["pid"], signal.SIGKILL)
    await wait_until(lambda: process_gone(victim["pid"]), 10, "the replica is dead")
    started = time.monotonic()
    calls = await dial_all(cluster, 4)
    spread = landed(cluster, calls)
    print(f"4 calls after kill -9 of {victim['name']}: {dict(spread)}; answer times "
          f"{[round(c.answer_s, 2) for c in calls]} s, "
          f"{time.monotonic() - started:.1f} s in all")  # fmt: skip
    assert set(spread) == {"replica-2"}
    await hang_up_all(calls)


async def test_a_twilio_call_through_nginx_lands_and_its_media_socket_upgrades(
    cluster: RunningCluster,
) -> None:
    async with FakeTwilioCaller(cluster.endpoints["http"]) as caller:
        outcome = await caller.dial()
        assert outcome.kind == "stream", outcome
        # The stream URL names the proxy (PUBLIC_BASE_URL), so the upgrade went through it.
        assert outcome.stream_url is not None
        assert outcome.stream_url.startswith(cluster.endpoints["http"].replace("http", "ws", 1))
        assert caller.handshake_status is None
        await wait_until(lambda: caller.heard_ms > 200, 30, "the agent is heard through nginx")
        await caller.hangup()
