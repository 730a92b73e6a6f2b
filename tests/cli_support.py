"""`voice-agent` as a user runs it: a subprocess with its own environment and data directory."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
READY_LINE = "voice-agent is ready on "
START_TIMEOUT_S = 90.0  # a first start runs initdb and every migration


def clean_env(**values: str) -> dict[str, str]:
    """The test's environment minus every setting of ours (each test says what it needs)."""
    ours = ("OPENAI_", "TWILIO_", "DATABASE_URL", "TEST_DATABASE_URL", "PUBLIC_BASE_URL")
    env = {k: v for k, v in os.environ.items() if not k.startswith(ours)}
    for name in ("DATA_DIR", "PORT", "HOST", "CONSOLE_PASSWORD", "DRAIN_TIMEOUT_S", "SOR_BASE_URL"):
        env.pop(name, None)
    env["PYTHONPATH"] = str(ROOT)
    env["TWILIO_API_BASE_URL"] = "http://127.0.0.1:9"  # nothing listens: never api.twilio.com
    return {**env, **values}


async def run_cli(
    *args: str,
    env: dict[str, str],
    cwd: Path,
    timeout: float = 60.0,  # noqa: ASYNC109
) -> tuple[int, str, str]:
    """Run `voice-agent ARGS` to its end: (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", *args,
        env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def error_lines(stderr: str) -> list[str]:
    """What a command said on stderr, minus timestamped log lines."""
    return [line for line in stderr.splitlines() if line.strip() and not line[:4].isdigit()]


@dataclass
class ServeProcess:
    """A running `voice-agent serve`."""

    proc: asyncio.subprocess.Process
    url: str
    banner: list[str]
    stderr_chunks: list[bytes] = field(default_factory=list)
    _stderr_task: asyncio.Task[None] | None = None

    @property
    def stderr(self) -> str:
        return b"".join(self.stderr_chunks).decode(errors="replace")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    async def wait(self, timeout: float = 60.0) -> int:  # noqa: ASYNC109
        async with asyncio.timeout(timeout):
            code = await self.proc.wait()
            if self._stderr_task is not None:
                await self._stderr_task
        return code


async def _drain(stream: asyncio.StreamReader, into: list[bytes]) -> None:
    while chunk := await stream.read(65536):
        into.append(chunk)


@contextlib.asynccontextmanager
async def serve_process(env: dict[str, str], cwd: Path, *args: str) -> AsyncIterator[ServeProcess]:
    """`voice-agent serve ARGS` until its start block is printed; killed on exit if alive."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "app.cli", "serve", *args,
        env=env, cwd=cwd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    chunks: list[bytes] = []
    stderr_task = asyncio.create_task(_drain(proc.stderr, chunks))
    banner: list[str] = []
    try:
        async with asyncio.timeout(START_TIMEOUT_S):
            while True:
                line = (await proc.stdout.readline()).decode()
                if not line:
                    await stderr_task
                    raise RuntimeError(
                        f"serve exited before it was ready: {b''.join(chunks).decode()[-3000:]}"
                    )
                if banner or line.startswith(READY_LINE):
                    banner.append(line.rstrip("\n"))
                if line.lstrip().startswith("stop "):
                    break
        url = banner[0].removeprefix(READY_LINE).strip()
        # The rest of stdout is not read; nothing more is printed there.
        yield ServeProcess(proc, url, banner, chunks, stderr_task)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if not stderr_task.done():
            stderr_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stderr_task


def postgres_processes(pgdata: Path) -> list[Any]:
    """postgres server processes of `pgdata` still running."""
    import psutil

    found = []
    for proc in psutil.process_iter(attrs=["name", "cmdline"]):
        cmdline = proc.info.get("cmdline") or []
        if proc.info.get("name") == "postgres" and str(pgdata) in cmdline:
            found.append(proc)
    return found


def kill_postgres(pgdata: Path) -> None:
    """A failed test must not leave its embedded server running."""
    for proc in postgres_processes(pgdata):
        with contextlib.suppress(Exception):
            proc.kill()
