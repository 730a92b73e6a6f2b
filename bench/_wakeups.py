"""Wake-ups of a process's event loop, by what woke it, from an `strace -f -tt -yy` log.

A process that waits in `epoll_wait` and is woken pays the wake itself (on a virtual machine,
~0.1 ms of CPU each, more than most callbacks it then runs), so a per-call count of wake-ups
says where a call's CPU goes when no function stands out in a profile. Only the thread that
runs the loop counts (the one that calls `epoll_pwait`/`epoll_wait` most); a wait with a zero
timeout is a poll between callbacks, not a wake-up. What woke it is read from the file
descriptors the wait returned, named by the next line of the log that shows each with its
socket (`-yy`): the server's own port (a client: webhook or media socket), the model's port,
the database's, an eventfd (another thread handing back work), or nothing (a timer).
"""

from __future__ import annotations

import collections
import re
import subprocess
from pathlib import Path

_LINE = re.compile(r"^(\d+)\s+(\d\d:\d\d:\d\d\.\d+)\s+(.*)$")
_FD = re.compile(r"(\d+)<((?:TCP|TCPv6|UDP|UNIX):\[[^\]]*\]|[^>]*)>")
# The wait's timeout and result (a line split by another thread's call resumes with the rest).
_WAIT = re.compile(
    r"^(?:epoll_p?wait\(|<\.\.\. epoll_p?wait resumed>).*\], \d+, (-?\d+)(?:, NULL, \d+)?\) = (\d+)"
)
_READY = re.compile(r"u32=(\d+)")
_ADDRS = re.compile(r"\[([\d.:]+):(\d+)->([\d.:]+):(\d+)\]")

KINDS = ("client", "model", "database", "thread", "timer", "other")


def strace_command(pid: int, out: Path) -> list[str]:
    """strace attached to `pid` and its threads, logging only what the count needs."""
    return [
        "strace", "-f", "-tt", "-yy", "-o", str(out), "-p", str(pid),
        "-e", "trace=epoll_wait,epoll_pwait,read,recvfrom,write,sendto,accept4,close",
    ]  # fmt: skip


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def _kind(desc: str | None, server_port: int, model_port: int, db_port: int) -> str:
    if desc is None:
        return "other"
    if "eventfd" in desc:
        return "thread"
    m = _ADDRS.search(desc)
    if m is None:
        return "client" if desc.endswith(f":{server_port}]") else "other"  # the listener
    local, remote = int(m.group(2)), int(m.group(4))
    if local == server_port:
        return "client"
    if remote == model_port:
        return "model"
    if remote == db_port:
        return "database"
    return "other"


def count(log: Path, server_port: int, model_port: int, db_port: int) -> dict[str, int]:
    """Wake-ups of the loop's thread in `log`, by kind (`KINDS`); a wake-up for fds of
    several kinds counts once, for the first of them in `KINDS` order."""
    rows: list[tuple[str, str]] = []
    waits: collections.Counter[str] = collections.Counter()
    for line in log.read_text("utf-8", "replace").splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        rows.append((m.group(1), m.group(3)))
        if m.group(3).startswith(("epoll_", "<... epoll_")):
            waits[m.group(1)] += 1
    if not waits:
        return dict.fromkeys(KINDS, 0)
    loop_tid = waits.most_common(1)[0][0]
    mine = [text for tid, text in rows if tid == loop_tid]
    # Each fd's description as next seen: fds are reused, so the nearest later mention.
    later: list[dict[int, str]] = [{}] * len(mine)
    seen: dict[int, str] = {}
    for i in range(len(mine) - 1, -1, -1):
        later[i] = seen
        found = {int(fd): desc for fd, desc in _FD.findall(mine[i])}
        if found:
            seen = {**seen, **found}
    counts = dict.fromkeys(KINDS, 0)
    for i, text in enumerate(mine):
        m = _WAIT.match(text)
        if m is None or int(m.group(1)) == 0:
            continue  # a poll between callbacks, or an unfinished line
        if int(m.group(2)) == 0:
            counts["timer"] += 1
            continue
        kinds = {
            _kind(later[i].get(int(fd)), server_port, model_port, db_port)
            for fd in _READY.findall(text)
        }
        counts[next(k for k in KINDS if k in kinds)] += 1
    return counts
