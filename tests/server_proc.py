"""The real `voice-agent serve` in its own process group, for crash and multi-process tests.

Started with environment variables only (as a deployment would), stopped gracefully with
SIGTERM or killed with SIGKILL (the whole process group, like a container runtime).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
PORT_ATTEMPTS = 3  # starts on a fresh port when the picked one was taken meanwhile


# Ports for the tests' servers are picked below the kernel's ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default), where every outgoing connection takes
# its local port: a port picked there (bind to 0) and bound by a server a moment later may be
# some connection's meanwhile. Here only another test's pick can take it.
PICK_PORTS = (20000, 32000)


def free_port(*, udp: bool = False, even: bool = False) -> int:
    """A TCP port on 127.0.0.1 free right now, for a server a test starts; with `udp`, free for
    UDP as well (sipp binds both); `even` for an RTP port (RTCP takes the odd one above)."""
    kinds = (socket.SOCK_STREAM, socket.SOCK_DGRAM) if udp else (socket.SOCK_STREAM,)
    while True:
        port = random.randint(*PICK_PORTS)
        if even:
            port -= port % 2
        if all(_bindable(kind, port) for kind in kinds):
            return port


def _bindable(kind: int, port: int) -> bool:
    with socket.socket(socket.AF_INET, kind) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _append(path: Path) -> Any:
    return path.open("ab")


def _written_since(path: Path, offset: int) -> str:
    with path.open("rb") as log:
        log.seek(offset)
        return log.read().decode(errors="replace")


@dataclass
class ServerProcess:
    """One `voice-agent serve` process."""

    env: dict[str, str]
    port: int = field(default_factory=free_port)
    proc: asyncio.subprocess.Process | None = None
    # Where the process's stderr (its log stream) goes; unset: discarded.
    stderr_path: Path | None = None
    args: tuple[str, ...] = ()  # after `serve` (e.g. --no-worker)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, timeout_s: float = 60.0) -> ServerProcess:
        """Start it and wait until it is ready. The port was free when it was picked; another
        process (a parallel test's server, any outgoing connection) may have taken it since:
        then the server says so and exits, and it starts again on another port."""
        deadline = time.monotonic() + timeout_s
        for attempt in range(1, PORT_ATTEMPTS + 1):
            env = {
                **os.environ,
                "PYTHONPATH": str(ROOT),
                "HOST": "127.0.0.1",
                "PORT": str(self.port),
                "PUBLIC_BASE_URL": self.url,
                **self.env,
            }
            # Its log goes to stderr_path, else to a file of its own, unlinked once it is up.
            path = self.stderr_path
            if path is None:
                fd, name = tempfile.mkstemp(prefix="serve-", suffix=".log")
                os.close(fd)
                path = Path(name)
            start = path.stat().st_size if path.exists() else 0
            try:
                log_file = _append(path)
                try:
                    self.proc = await self._spawn(env, log_file)
                finally:
                    log_file.close()  # the child holds its own descriptor
                try:
                    return await self._wait_ready(deadline)
                except RuntimeError:
                    taken = "already in use" in _written_since(path, start)
                    if not taken or attempt == PORT_ATTEMPTS:
                        raise
                    self.port = free_port()
            finally:
                if self.stderr_path is None:
                    path.unlink(missing_ok=True)
        raise AssertionError("not reached")

    async def _spawn(self, env: dict[str, str], log_file: Any) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "app.cli",
            "serve",
            *self.args,
            cwd=ROOT,
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=log_file if log_file is not None else asyncio.subprocess.DEVNULL,
            start_new_session=True,  # its own process group: killpg takes all of it
        )

    async def _wait_ready(self, deadline: float) -> ServerProcess:
        assert self.proc is not None
        async with httpx.AsyncClient(timeout=2.0) as http:
            while True:
                if self.proc.returncode is not None:
                    raise RuntimeError(f"voice-agent serve exited with {self.proc.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await http.get(self.url + "/readyz")).status_code == 200:
                        return self
                if time.monotonic() > deadline:
                    raise TimeoutError("voice-agent serve did not become ready")
                await asyncio.sleep(0.1)

    def _signal(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def terminate(self) -> None:
        """SIGTERM, without waiting: the process drains (DRAIN_TIMEOUT_S), then stops."""
        self._signal(signal.SIGTERM)

    async def kill(self) -> None:
        """SIGKILL the whole process group: no shutdown code runs."""
        self._signal(signal.SIGKILL)
        assert self.proc is not None
        await self.proc.wait()

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM (graceful), then SIGKILL if it does not end in time."""
        if self.proc is None or self.proc.returncode is not None:
            return
        self._signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await self.proc.wait()
        except TimeoutError:
            await self.kill()
