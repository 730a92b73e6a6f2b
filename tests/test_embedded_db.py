"""The embedded PostgreSQL of a data directory: what a killed process leaves is recovered."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest

from app import embedded_db
from tests.cli_support import kill_postgres, postgres_processes


@pytest.fixture
def data_dir(tmp_path: Path) -> Any:
    path = tmp_path / "data"
    yield path
    embedded_db.stop(path)
    kill_postgres(embedded_db.pgdata_of(path))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_holders_that_no_longer_run_are_dropped_and_the_last_one_out_stops_the_server(
    data_dir: Path,
) -> None:
    pgdata = embedded_db.pgdata_of(data_dir)
    url = embedded_db.start(data_dir)
    embedded_db.stop(data_dir)
    assert not postgres_processes(pgdata)
    # A process that was killed while holding it, and this process's own PID from a previous
    # life (PID 1 in a container restarted on the same volume).
    handles = pgdata / ".handle_pids.json"
    handles.write_text(json.dumps([_dead_pid(), os.getpid()]))

    url = embedded_db.start(data_dir)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert json.loads(handles.read_text()) == [os.getpid()]
    embedded_db.stop(data_dir)
    assert not postgres_processes(pgdata)
    assert "stale holder PIDs" in (data_dir / embedded_db.LOG_NAME).read_text()


def test_a_postmaster_pid_file_naming_another_process_is_removed(data_dir: Path) -> None:
    pgdata = embedded_db.pgdata_of(data_dir)
    embedded_db.start(data_dir)
    embedded_db.stop(data_dir)
    # The server died with its lock file in place, and its PID went to another process.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lines = ["0"] * 8
        lines[0], lines[1] = str(other.pid), str(pgdata)
        (pgdata / "postmaster.pid").write_text("\n".join(lines) + "\n")
        url = embedded_db.start(data_dir)
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT 1").fetchone() == (1,)
        assert other.poll() is None  # the innocent process was left alone
    finally:
        other.kill()
        other.wait()
    embedded_db.stop(data_dir)
    assert not postgres_processes(pgdata)


def test_its_chatter_goes_to_a_log_file_not_the_terminal(
    data_dir: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    embedded_db.start(data_dir)
    embedded_db.stop(data_dir)
    out, err = capfd.readouterr()
    assert "initdb" not in out + err and "pg_ctl" not in out + err
    log = (data_dir / embedded_db.LOG_NAME).read_text()
    assert "initdb" in log and "pg_ctl" in log
