"""`voice-agent cluster`: the multi-replica layout of infra/ on one machine, as plain processes.

PostgreSQL (DATABASE_URL, else TEST_DATABASE_URL, else the embedded one in the cluster's
directory), N `serve` replicas (each its own HTTP port, SIP port and RTP range; their in-process
worker takes only SIP placings, WORKER_QUEUES=operations-sip), M `voice-agent worker`
processes, nginx in front of the replicas' HTTP (infra/nginx/nginx.conf) and Kamailio in
front of their SIP (infra/kamailio/kamailio.cfg), all on loopback and in the foreground. Once
every part answers, `DIR/endpoints.json` says where each one is and its PID, so a test, sipp
or a person can find and kill any of them. Ctrl+C (or SIGTERM) stops it all: the replicas
first (they drain, as in production), then the workers, the proxies and the database; a
second Ctrl+C kills what is left.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

from app.errors import StartupError

INFRA = Path(__file__).resolve().parents[2] / "infra"
KAMAILIO_CFG = INFRA / "kamailio" / "kamailio.cfg"
NGINX_CONF = INFRA / "nginx" / "nginx.conf"
START_TIMEOUT_S = 120.0
# Replicas get their own drain (DRAIN_TIMEOUT_S, 30 s by default) plus their clean stop.
STOP_TIMEOUT_S = 90.0
RTP_PORTS_PER_REPLICA = 500
PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What `voice-agent cluster` starts, and where."""

    directory: Path = Path(".cluster")
    host: str = "127.0.0.1"
    http_port: int = 8080
    sip_port: int = 5060
    replicas: int = 2
    workers: int = 1
    rtp_base: int = 20000  # 0: every replica takes any free RTP port
    database_url: str | None = None
    simulator: bool = False
    ds_ping_interval_s: int = 2


@dataclass(slots=True)
class Part:
    """One process of the cluster."""

    name: str
    argv: list[str]
    env: dict[str, str]
    http: str | None = None
    sip: str | None = None
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = None
    reported_exit: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None


def free_port(host: str, kind: int = socket.SOCK_STREAM) -> int:
    """A port free right now for `kind` (for a UDP port, its TCP twin is free too)."""
    while True:
        with socket.socket(socket.AF_INET, kind) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if kind == socket.SOCK_STREAM:
            return port
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as twin:
            try:
                twin.bind((host, port))
            except OSError:
                continue
        return port


def sip_options(
    host: str, port: int, *, user: str | None = None, timeout_s: float = 2.0
) -> int | None:
    """Send one OPTIONS over UDP; the final status, or None when nothing answered in time."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.bind(("127.0.0.1" if host.startswith("127.") else "0.0.0.0", 0))
        local_host, local_port = sock.getsockname()
        target = f"sip:{user + '@' if user else ''}{host}:{port}"
        branch = f"z9hG4bK{secrets.token_hex(8)}"
        message = (
            f"OPTIONS {target} SIP/2.0\r\n"
            f"Via: SIP/2.0/UDP {local_host}:{local_port};branch={branch};rport\r\n"
            "Max-Forwards: 70\r\n"
            f"From: <sip:cluster@{local_host}>;tag={secrets.token_hex(4)}\r\n"
            f"To: <{target}>\r\n"
            f"Call-ID: {secrets.token_hex(12)}@cluster\r\n"
            "CSeq: 1 OPTIONS\r\n"
            "Content-Length: 0\r\n\r\n"
        ).encode()
        deadline = time.monotonic() + timeout_s
        sock.sendto(message, (host, port))
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                data = sock.recv(65535)
            except (TimeoutError, OSError):
                return None
            match = re.match(rb"SIP/2\.0 (\d{3}) ", data)
            if match and int(match.group(1)) >= 200:
                return int(match.group(1))
    return None


def http_status(url: str, timeout_s: float = 2.0) -> int | None:
    """GET `url`: its status, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def render_nginx_conf(template: str, host: str, port: int, upstreams: list[str]) -> str:
    """infra/nginx/nginx.conf with the replicas and the listening address of this cluster."""
    out: list[str] = []
    for line in template.splitlines():
        if "# cluster: replicas" in line:
            indent = line[: len(line) - len(line.lstrip())]
            out += [f"{indent}server {u} max_fails=1 fail_timeout=5s;" for u in upstreams]
        elif "# cluster: listen" in line:
            indent = line[: len(line) - len(line.lstrip())]
            out.append(f"{indent}listen {host}:{port};")
        elif re.match(r"\s*server \S+:\d+ max_fails", line):
            continue  # the template's example replicas
        else:
            out.append(line)
    return "\n".join(out) + "\n"


def _die_with_parent() -> None:
    # If the cluster process itself is killed, its parts go with it rather than linger.
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class Cluster:
    """The processes of one local cluster: started in order, checked, stopped in order."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.directory = config.directory.resolve()
        self.replicas: list[Part] = []
        self.workers: list[Part] = []
        self.proxy: Part | None = None
        self.edge: Part | None = None
        self.database_url = ""
        self._embedded_dir: Path | None = None
        self.stop_requests = 0
        self.stop_requested = threading.Event()

    # ---- start --------------------------------------------------------------------------

    def _binary(self, name: str) -> str:
        # Debian puts daemons in /usr/sbin, which a user's PATH may not have.
        path = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
        if path is None:
            package = "kamailio" if name == "kamailio" else name
            raise StartupError(f"{name} is not installed (apt-get install {package})")
        return path

    def _database(self) -> str:
        from app.db import resolve_database_url, upgrade_to
        from app.embedded_db import start

        url = (
            self.config.database_url
            or os.environ.get("DATABASE_URL")
            or os.environ.get("TEST_DATABASE_URL")
        )
        if url:
            url = resolve_database_url(url, self.directory / "data")
        else:
            self._embedded_dir = self.directory / "data"
            url = start(self._embedded_dir)
        upgrade_to(url, "head")
        return url

    def _base_env(self) -> dict[str, str]:
        c = self.config
        env = dict(os.environ)
        env.update(
            DATABASE_URL=self.database_url,
            PUBLIC_BASE_URL=f"http://{c.host}:{c.http_port}",
            FORWARDED_ALLOW_IPS=c.host,
            SIP_ALLOW_FROM=f"{c.host}/32",
            SIP_TRUSTED_PROXIES=f"{c.host}/32",
        )
        env.pop("TEST_DATABASE_URL", None)
        if c.simulator:
            env["REALTIME_SIMULATOR"] = "true"
        return env

    def plan(self) -> None:
        """Choose ports and command lines for every part (nothing runs yet)."""
        c = self.config
        python = [sys.executable, "-m", "app.cli"]
        base = self._base_env()
        for n in range(1, c.replicas + 1):
            http_port = free_port(c.host)
            sip_port = free_port(c.host, socket.SOCK_DGRAM)
            if c.rtp_base:
                first = c.rtp_base + (n - 1) * RTP_PORTS_PER_REPLICA
                rtp = f"{first}-{first + RTP_PORTS_PER_REPLICA - 1}"
            else:
                rtp = "0"
            env = dict(
                base,
                SIP_BIND=f"{c.host}:{sip_port}",
                SIP_RTP_PORTS=rtp,
                DATA_DIR=str(self.directory / f"replica-{n}"),
                # Only a replica's SIP listener can place a SIP call: its worker takes those,
                # the workers everything else.
                WORKER_QUEUES="operations-sip",
            )
            self.replicas.append(
                Part(
                    f"replica-{n}",
                    [*python, "serve", "--host", c.host, "--port", str(http_port)]
                    + (["--simulator"] if c.simulator else []),
                    env,
                    http=f"http://{c.host}:{http_port}",
                    sip=f"{c.host}:{sip_port}",
                )
            )
        for n in range(1, c.workers + 1):
            env = dict(base, DATA_DIR=str(self.directory / f"worker-{n}"))
            self.workers.append(Part(f"worker-{n}", [*python, "worker"], env))

        nginx_dir = self.directory / "nginx"
        nginx_dir.mkdir(parents=True, exist_ok=True)
        upstreams = [p.http.removeprefix("http://") for p in self.replicas if p.http]
        conf = nginx_dir / "nginx.conf"
        conf.write_text(render_nginx_conf(NGINX_CONF.read_text(), c.host, c.http_port, upstreams))
        self.proxy = Part(
            "proxy",
            [self._binary("nginx"), "-p", str(nginx_dir), "-c", str(conf), "-g", "daemon off;"],
            dict(os.environ),
            http=f"http://{c.host}:{c.http_port}",
        )

        kamailio_dir = self.directory / "kamailio"
        kamailio_dir.mkdir(parents=True, exist_ok=True)
        dispatcher = kamailio_dir / "dispatcher.list"
        dispatcher.write_text(
            "# voice-agent cluster: set 1, the replicas' SIP listeners\n"
            + "".join(f"1 sip:{p.sip}\n" for p in self.replicas)
        )
        edge = f"{c.host}:{c.sip_port}"
        defines = {
            "LISTEN_UDP": f"udp:{edge}",
            "LISTEN_TCP": f"tcp:{edge}",
            "DISPATCHER_LIST": f'"{dispatcher}"',
            "DS_PING_INTERVAL": str(c.ds_ping_interval_s),
        }
        self.edge = Part(
            "kamailio",
            [
                self._binary("kamailio"),
                *("-f", str(KAMAILIO_CFG), "-DD", "-E"),  # foreground, log to stderr
                *("-Y", str(kamailio_dir), "-P", str(kamailio_dir / "kamailio.pid")),
                *(arg for name, value in defines.items() for arg in ("-A", f"{name}={value}")),
            ],
            dict(os.environ),
            sip=edge,
        )

    def _spawn(self, part: Part) -> None:
        logs = self.directory / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        part.log = (logs / f"{part.name}.log").open("ab")
        part.process = subprocess.Popen(
            part.argv,
            env=part.env,
            stdin=subprocess.DEVNULL,
            stdout=part.log,
            stderr=subprocess.STDOUT,
            # Its own session: Ctrl+C reaches this process only, which stops the parts in order.
            start_new_session=True,
            preexec_fn=_die_with_parent,  # this process runs no other threads
        )
        print(f"cluster: {part.name} started (pid {part.pid}), log {logs / part.name}.log")

    def _healthy(self, part: Part) -> bool:
        if not part.running():
            assert part.process is not None
            raise StartupError(
                f"{part.name} exited with status {part.process.returncode} while starting; "
                f"see {self.directory / 'logs' / part.name}.log"
            )
        if part is self.edge:
            assert part.sip is not None
            host, port = part.sip.rsplit(":", 1)
            # Kamailio itself, then a request it dispatches to a replica.
            return (
                sip_options(host, int(port)) == 200
                and sip_options(host, int(port), user="health") == 200
            )
        ok = True
        if part.http is not None:
            ok = http_status(f"{part.http}/readyz") == 200
        if ok and part.sip is not None:
            host, port = part.sip.rsplit(":", 1)
            ok = sip_options(host, int(port)) == 200
        return ok

    def _wait_healthy(self, parts: list[Part]) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        waiting = list(parts)
        while waiting:
            if self.stop_requested.is_set():
                raise KeyboardInterrupt
            waiting = [p for p in waiting if not self._healthy(p)]
            if waiting and time.monotonic() > deadline:
                names = ", ".join(p.name for p in waiting)
                raise StartupError(f"{names} not healthy after {START_TIMEOUT_S:.0f} s")
            if waiting:
                self.stop_requested.wait(0.3)

    def start(self) -> None:
        """Start every part in order and write endpoints.json once all of them answer."""
        self.directory.mkdir(parents=True, exist_ok=True)
        endpoints = self.directory / "endpoints.json"
        endpoints.unlink(missing_ok=True)
        self.database_url = self._database()
        self.plan()
        for part in self.replicas:
            self._spawn(part)
        self._wait_healthy(self.replicas)
        for part in self.workers:
            self._spawn(part)
        assert self.proxy is not None and self.edge is not None
        self._spawn(self.proxy)
        self._spawn(self.edge)
        self._wait_healthy([self.proxy, self.edge])
        for part in self.workers:
            self._healthy(part)  # still running
        temporary = endpoints.with_suffix(".tmp")
        temporary.write_text(json.dumps(self.endpoints(), indent=2) + "\n")
        temporary.replace(endpoints)

    def endpoints(self) -> dict[str, Any]:
        """What endpoints.json holds."""
        assert self.proxy is not None and self.edge is not None
        return {
            "sip": self.edge.sip,
            "http": self.proxy.http,
            "replicas": [
                {"name": p.name, "pid": p.pid, "http": p.http, "sip": p.sip} for p in self.replicas
            ],
            "workers": [{"name": p.name, "pid": p.pid} for p in self.workers],
            "proxy": {"pid": self.proxy.pid},
            "kamailio": {"pid": self.edge.pid},
            "database_url": self.database_url,
            "pid": os.getpid(),
        }

    # ---- run and stop -------------------------------------------------------------------

    def request_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stop_requests += 1
        self.stop_requested.set()
        if self.stop_requests > 1:
            print("cluster: second signal, killing what is left", flush=True)
            for part in self._all():
                self._signal(part, signal.SIGKILL)

    def _all(self) -> list[Part]:
        edge = [p for p in (self.proxy, self.edge) if p is not None]
        return [*self.replicas, *self.workers, *edge]

    def watch(self) -> None:
        """Until asked to stop: say once when a part exits (a test may kill one on purpose)."""
        while not self.stop_requested.wait(0.5):
            for part in self._all():
                if part.process is not None and not part.running() and not part.reported_exit:
                    part.reported_exit = True
                    print(
                        f"cluster: {part.name} (pid {part.pid}) exited with status "
                        f"{part.process.returncode}; the others go on",
                        flush=True,
                    )

    @staticmethod
    def _signal(part: Part, signum: int) -> None:
        if part.running():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(part.pid, signum)

    def _stop(self, parts: list[Part], signum: int, timeout_s: float) -> None:
        for part in parts:
            self._signal(part, signum)
        deadline = time.monotonic() + timeout_s
        for part in parts:
            if part.process is None:
                continue
            try:
                part.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self._signal(part, signal.SIGKILL)
                part.process.wait(5)

    def stop(self) -> None:
        """Replicas drain first (the edge still carries their calls' BYEs), then the rest."""
        self._stop(self.replicas, signal.SIGTERM, STOP_TIMEOUT_S)
        self._stop(self.workers, signal.SIGTERM, 30.0)
        self._stop([p for p in (self.proxy, self.edge) if p is not None], signal.SIGTERM, 10.0)
        for part in self._all():
            if part.log is not None:
                part.log.close()
        (self.directory / "endpoints.json").unlink(missing_ok=True)
        if self._embedded_dir is not None:
            from app.embedded_db import stop

            stop(self._embedded_dir)


def run_cluster(config: ClusterConfig) -> int:
    """Start the cluster, keep it in the foreground, stop it on Ctrl+C or SIGTERM."""
    cluster = Cluster(config)
    previous = {
        sig: signal.signal(sig, cluster.request_stop) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        cluster.start()
        ends = cluster.endpoints()
        print(
            f"cluster: ready; SIP {ends['sip']} (Kamailio), HTTP {ends['http']} (nginx), "
            f"{len(cluster.replicas)} replicas, {len(cluster.workers)} worker(s); "
            f"{cluster.directory / 'endpoints.json'}; Ctrl+C stops it all",
            flush=True,
        )
        cluster.watch()
        print("cluster: stopping (replicas drain first)", flush=True)
        return 0
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
