"""A database URL as libpq takes it (psycopg, Procrastinate's connector)."""

from __future__ import annotations


def plain_url(url: str) -> str:
    """A libpq URL: SQLAlchemy's driver suffix (`postgresql+psycopg://`) and the short scheme
    (`postgres://`) become `postgresql://`; anything else is returned as it is."""
    for prefix in ("postgresql+psycopg://", "postgres://"):
        if url.startswith(prefix):
            return "postgresql://" + url.removeprefix(prefix)
    return url
