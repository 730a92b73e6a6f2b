from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from app.db import make_engine
from tests.e2e_support import wait_until


async def test_migrations_create_call_tables(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        rows = await conn.execute(
            text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")
        )
        tables = {r[0] for r in rows}
    assert {"calls", "call_events", "alembic_version"} <= tables


async def test_a_pooled_connection_that_died_while_idle_is_replaced_at_checkout(
    clean_db: str, engine: AsyncEngine
) -> None:
    pooled = make_engine(clean_db, pool_size=1, max_overflow=0, ping_after_idle_s=0.0)
    try:
        async with pooled.connect() as conn:
            pid = await conn.scalar(text("SELECT pg_backend_pid()"))
        async with engine.connect() as conn:  # the server drops it while it sits in the pool
            await conn.execute(text("SELECT pg_terminate_backend(:p)"), {"p": pid})

        async def gone() -> bool:
            async with engine.connect() as conn:
                query = text("SELECT count(*) FROM pg_stat_activity WHERE pid = :p")
                return await conn.scalar(query, {"p": pid}) == 0

        await wait_until(gone, 10, "the backend to exit")
        async with pooled.connect() as conn:  # pinged, found dead, replaced: no error
            assert await conn.scalar(text("SELECT pg_backend_pid()")) != pid
    finally:
        await pooled.dispose()
