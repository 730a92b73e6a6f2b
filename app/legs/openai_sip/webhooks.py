"""OpenAI webhook deliveries we have taken, by `webhook-id`: a retried delivery changes nothing.

OpenAI retries a delivery it did not see answered (and may deliver twice anyway); the SDK
verifies signatures but does not deduplicate. The first delivery of an id inserts its row; any
later one finds it and is answered 200 without effect, on whichever replica it lands.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncEngine

deliveries_table = sa.Table(
    "openai_webhook_deliveries",
    sa.MetaData(),
    sa.Column("webhook_id", sa.String(128), primary_key=True),
    sa.Column("event_type", sa.String(64), nullable=False),
    sa.Column("call_id", sa.String(128)),
    sa.Column("received_at", sa.DateTime(timezone=True), server_default=sa.func.now()),
)


async def record_delivery(
    engine: AsyncEngine, webhook_id: str, event_type: str, call_id: str | None
) -> bool:
    """Note a delivery; False when `webhook_id` was already taken (a retry)."""
    stmt = (
        pg_insert(deliveries_table)
        .values(webhook_id=webhook_id[:128], event_type=event_type[:64], call_id=call_id)
        .on_conflict_do_nothing(index_elements=["webhook_id"])
        .returning(deliveries_table.c.webhook_id)
    )
    async with engine.begin() as conn:
        return (await conn.execute(stmt)).first() is not None


async def forget_delivery(engine: AsyncEngine, webhook_id: str) -> None:
    """The delivery could not be acted on (nothing recorded): let OpenAI's retry try again."""
    async with engine.begin() as conn:
        await conn.execute(
            deliveries_table.delete().where(deliveries_table.c.webhook_id == webhook_id[:128])
        )


async def delivery_count(engine: AsyncEngine, webhook_id: str | None = None) -> int:
    """How many deliveries are recorded (of one id): for tests and the console."""
    stmt = sa.select(sa.func.count()).select_from(deliveries_table)
    if webhook_id is not None:
        stmt = stmt.where(deliveries_table.c.webhook_id == webhook_id)
    async with engine.connect() as conn:
        return int((await conn.execute(stmt)).scalar_one())
