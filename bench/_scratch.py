"""A scratch database for a benchmark: made on DATABASE_URL / TEST_DATABASE_URL's server
(else an embedded one), migrated, and dropped afterwards."""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from app.db import create_database, drop_database, resolve_database_url, upgrade


@contextmanager
def scratch_database(prefix: str) -> Iterator[str]:
    """The URL of a new, migrated database named `prefix_<random>`, dropped on exit."""
    server_url = os.environ.get("DATABASE_URL") or os.environ.get("TEST_DATABASE_URL")
    with tempfile.TemporaryDirectory() as tmp:
        base = resolve_database_url(server_url, Path(tmp))
        name = f"{prefix}_{uuid.uuid4().hex[:8]}"
        url = create_database(base, name)
        try:
            upgrade(url)
            yield url
        finally:
            drop_database(base, name)
