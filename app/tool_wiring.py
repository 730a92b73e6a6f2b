"""Which tool layer the bridge talks to: the durable pipeline over the ledger.

Calls get `tools.gateway.ToolPipeline` with the restaurant catalog: policy first, then the
Postgres ledger; mutations are admitted and enqueued (Procrastinate) in one transaction,
reads run inline against the system of record. Finished operations reach the live call
through `app.delivery.ResultDelivery`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from app.settings import Settings
from tools.executor import make_app, make_enqueue
from tools.gateway import ToolPipeline
from tools.identity import Account, StaticIdentityStore
from tools.ledger import Enqueue
from tools.registry import Registry
from tools.restaurant.catalog import RestaurantReads, restaurant_catalog
from tools.restaurant.client import SorClient

log = logging.getLogger(__name__)


@dataclass
class ToolWiring:
    """The pipeline and what it owns (closed at shutdown)."""

    pipeline: ToolPipeline
    registry: Registry
    sor: SorClient
    enqueue: Enqueue

    async def aclose(self) -> None:
        await self.sor.aclose()


def load_accounts(path: Path | None, tenant_id: str) -> StaticIdentityStore:
    """Customer accounts from a JSON file: [{"account_id", "phones": [...], "pin", "name"}]."""
    if path is None:
        return StaticIdentityStore()
    raw = json.loads(path.read_text("utf-8"))
    accounts = [
        Account(
            account_id=str(item["account_id"]),
            tenant_id=str(item.get("tenant_id", tenant_id)),
            phones=frozenset(str(p) for p in item.get("phones", [])),
            pin=str(item["pin"]) if item.get("pin") is not None else None,
            name=item.get("name"),
            role=str(item.get("role", "customer")),
        )
        for item in raw
    ]
    log.info("loaded %d customer accounts", len(accounts))
    return StaticIdentityStore(accounts)


def build_tools(settings: Settings, engine: AsyncEngine, database_url: str) -> ToolWiring:
    """The ToolGateway every call of this process uses, and its resources."""
    registry = restaurant_catalog()
    # Deferral runs on the admitting connection, so this app is never opened here.
    enqueue = make_enqueue(make_app(database_url, max_pool_size=1))
    sor = SorClient(settings.sor_url())
    pipeline = ToolPipeline(
        engine,
        registry,
        enqueue=enqueue,
        read_executor=RestaurantReads(sor),
        identities=load_accounts(settings.accounts_file, settings.tenant_id),
    )
    return ToolWiring(pipeline=pipeline, registry=registry, sor=sor, enqueue=enqueue)
