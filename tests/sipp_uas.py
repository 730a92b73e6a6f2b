"""sipp as the far end of our outgoing calls: a scenario under tests/sipp run in UAS mode."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.sipp_support import SCENARIOS, SIPP, SippRun, free_udp_port

# sipp's -timeout counts from its own start: the person's side is up before the service starts
# and must outlive the caller's sipp (sipp_in_background), whose call comes to the transfer
# only after the greeting, the caller's words and the agent's answer. A loaded machine (four
# test workers on two cores) took 24 s from the person's answer to the REFER.
LIFETIME_S = 90


@dataclass
class SippUas:
    port: int
    messages: Path
    proc: asyncio.subprocess.Process
    errors: Path

    async def finish(self, timeout_s: float = 20.0) -> SippRun:
        """sipp's exit (0: the scenario passed) and what it printed."""
        try:
            async with asyncio.timeout(timeout_s):
                out, err = await self.proc.communicate()
        except TimeoutError:
            self.proc.kill()
            out, err = await self.proc.communicate()
        text = self.errors.read_text(errors="replace") if self.errors.exists() else ""
        code = self.proc.returncode if self.proc.returncode is not None else -1
        return SippRun(code, out.decode(errors="replace"), err.decode(errors="replace"), text)

    def seen(self) -> str:
        """Every message sipp sent and received (its -trace_msg log)."""
        return self.messages.read_text(errors="replace") if self.messages.exists() else ""


def _taken(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


@asynccontextmanager
async def sipp_uas(
    scenario: str, tmp: Path, *, timeout_s: int = LIFETIME_S, **keys: str | int
) -> AsyncIterator[SippUas]:
    """sipp answering one call with tests/sipp/`scenario` on a free port (`-key`s for it),
    giving up after `timeout_s` from its start (before the service's, and the caller's)."""
    assert SIPP is not None, "sipp is not installed (apt-get install sip-tester)"
    port = free_udp_port()
    messages = tmp / f"sipp-{port}-messages.log"
    errors = tmp / f"sipp-{port}-errors.log"
    args = [
        SIPP, "-sf", str(SCENARIOS / scenario), "-i", "127.0.0.1", "-p", str(port),
        "-mp", str(free_udp_port()), "-m", "1", "-nostdin", "-timeout", f"{timeout_s}s",
        "-timeout_error", "-trace_msg", "-message_file", str(messages),
        "-trace_err", "-error_file", str(errors),
    ]  # fmt: skip
    for name, value in keys.items():
        args += ["-key", name, str(value)]
    proc = await asyncio.create_subprocess_exec(
        *args,
        cwd=tmp,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    uas = SippUas(port, messages, proc, errors)
    try:
        async with asyncio.timeout(10):
            while not _taken(port):
                if proc.returncode is not None:
                    break
                await asyncio.sleep(0.02)
        if proc.returncode is not None:  # e.g. its port taken between the pick and its bind
            raise AssertionError(
                f"sipp ({scenario}) exited at start\n{(await uas.finish()).explain()}"
            )
        yield uas
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
