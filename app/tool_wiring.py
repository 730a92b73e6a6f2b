"""Which tools calls get, and the pipeline they go through.

The catalog comes from the settings (`TOOLS` import path and/or `TOOLS_FILE`; both unset:
the restaurant demo) through `tools.loading`, checked before anything serves. Calls get
`tools.gateway.ToolPipeline` over it: policy first, then the Postgres ledger; mutations are
admitted and enqueued (Procrastinate) in one transaction, reads run inline against the
provider each read tool names. Finished operations reach the live call through
`app.ops.delivery.ResultDelivery`.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.ext.asyncio import AsyncEngine

from app.errors import StartupError
from app.ops.outbound import callback_scheduler
from app.settings import Settings
from tools.agents import AgentSet, AgentsFileError, load_agents_file
from tools.catalog import Catalog, CatalogContext
from tools.executor import QUEUE, make_app, make_enqueue
from tools.gateway import ToolPipeline
from tools.identity import Account, StaticIdentityStore
from tools.ledger import Enqueue
from tools.loading import load_catalog, split_import_path
from tools.policy import PolicyConfig
from tools.registry import Registry
from tools.transfers import TransferTarget, parse_targets
from tools.verification import LockoutPolicy

log = logging.getLogger(__name__)

# The catalog when neither TOOLS nor TOOLS_FILE is set (an import path, not an import: the
# wiring knows no domain).
DEMO_TOOLS = "tools.restaurant.plugin:catalog"
DEMO_PACKAGE = "tools.restaurant"


@dataclass
class ToolWiring:
    """The pipeline and the catalog it runs (the catalog's owner closes it)."""

    pipeline: ToolPipeline
    registry: Registry
    catalog: Catalog
    enqueue: Enqueue
    agents: AgentSet | None = None


def plugin_of(settings: Settings) -> str | None:
    """The import path of the configured plugin catalog (the demo when nothing is set)."""
    if settings.tools:
        return settings.tools
    return None if settings.tools_file is not None else DEMO_TOOLS


def runs_demo_sor(settings: Settings) -> bool:
    """Whether `serve` starts the demo system of record: the restaurant demo is the
    selected catalog and SOR_BASE_URL is unset."""
    plugin = plugin_of(settings)
    if plugin is None or settings.sor_base_url is not None:
        return False
    module, _ = split_import_path(plugin)
    return module == DEMO_PACKAGE or module.startswith(DEMO_PACKAGE + ".")


def catalog_context(settings: Settings, environ: Mapping[str, str] | None = None) -> CatalogContext:
    """What a catalog factory and a tools file are given."""
    return CatalogContext(
        tenant_id=settings.tenant_id,
        public_base_url=settings.public_base_url,
        environ=dict(os.environ if environ is None else environ),
        sor_base_url=settings.sor_base_url,
    )


def load_configured_catalog(
    settings: Settings, environ: Mapping[str, str] | None = None
) -> Catalog:
    """The checked catalog of this deployment, or `tools.catalog.CatalogError`."""
    return load_catalog(
        catalog_context(settings, environ),
        plugin=plugin_of(settings),
        tools_file=settings.tools_file,
    )


def configured_transfers(settings: Settings, catalog: Catalog | None) -> dict[str, TransferTarget]:
    """Where callers may be transferred: the tools file's `transfers` (with hours and who),
    else TRANSFER_TARGETS; StartupError when both name targets."""
    declared = catalog.transfers if catalog is not None else None
    if declared is None:
        return parse_targets(settings.transfer_targets)
    if parse_targets(settings.transfer_targets):
        raise StartupError(
            "TRANSFER_TARGETS is set and the tools file declares `transfers` too. Fix: name the "
            "targets in one place (unset TRANSFER_TARGETS, or remove `transfers` from the tools "
            "file)"
        )
    return dict(declared)


def load_configured_agents(settings: Settings, catalog: Catalog) -> AgentSet | None:
    """The agents of AGENTS_FILE checked against `catalog`, else those its tools file declares
    (None: neither, one agent); StartupError (one line: the file, the problem, the fix) for a
    file that cannot run, or agents declared in both places."""
    if settings.agents_file is None:
        if catalog.agents is not None:
            log.info(
                "agents (tools file): %s (starting with %s)",
                ", ".join(catalog.agents.agents),
                catalog.agents.start,
            )
        return catalog.agents
    if catalog.agents is not None:
        raise StartupError(
            f"AGENTS_FILE {settings.agents_file}: the tools file {catalog.agents.source} "
            "declares agents too. Fix: declare them in one place (unset AGENTS_FILE, or remove "
            "`agents` from the tools file)"
        )
    try:
        agents = load_agents_file(settings.agents_file, catalog.registry.names())
    except AgentsFileError as exc:
        raise StartupError(str(exc)) from None
    log.info("agents: %s (starting with %s)", ", ".join(agents.agents), agents.start)
    return agents


def read_accounts(path: Path, tenant_id: str) -> list[Account]:
    """The accounts of an ACCOUNTS_FILE; StartupError (one line, with the fix) when it cannot
    be read, is not JSON, or an entry lacks what an account needs."""
    where = f"ACCOUNTS_FILE {path}"
    try:
        raw = json.loads(path.read_text("utf-8"))
    except OSError as exc:
        raise StartupError(f"{where}: cannot read it ({exc.strerror}): check the path") from None
    except ValueError as exc:
        raise StartupError(f"{where}: not JSON ({exc}): correct it") from None
    try:
        if not isinstance(raw, list):
            raise TypeError("not a list")
        return [
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
    except (KeyError, TypeError, AttributeError):
        raise StartupError(
            f'{where}: write a JSON list of accounts, each with "account_id" (and "phones", '
            '"pin", "name", "role")'
        ) from None


def load_accounts(path: Path | None, tenant_id: str) -> StaticIdentityStore:
    """Customer accounts from a JSON file: [{"account_id", "phones": [...], "pin", "name"}]."""
    if path is None:
        return StaticIdentityStore()
    accounts = read_accounts(path, tenant_id)
    log.info("loaded %d customer accounts", len(accounts))
    return StaticIdentityStore(accounts)


def build_tools(
    settings: Settings, engine: AsyncEngine, database_url: str, catalog: Catalog
) -> ToolWiring:
    """The ToolGateway every call of this process uses, over `catalog`."""
    # Deferral runs on the admitting connection, so this app is never opened here.
    agents = load_configured_agents(settings, catalog)
    jobs = make_app(database_url, max_pool_size=1)
    # Outbound calls (console, API) go on the queue their row names (SIP needs a SIP listener).
    enqueue = make_enqueue(jobs)
    pipeline = ToolPipeline(
        engine,
        catalog.registry,
        # The model's tool calls admit only the catalog's tools (never place_call): no read.
        enqueue=make_enqueue(jobs, QUEUE),
        read_executor=catalog.read,
        identities=load_accounts(settings.accounts_file, settings.tenant_id),
        lockout=LockoutPolicy(
            max_failures=settings.pin_max_failures,
            window_s=settings.pin_failure_window_s,
            lockout_s=settings.pin_lockout_s,
        ),
        agents=agents,
        transfers=configured_transfers(settings, catalog),
        callbacks=callback_scheduler(settings, jobs),
        dtmf_out=settings.dtmf_out,
        policy=PolicyConfig(
            max_mutations_per_caller=settings.max_mutations_per_caller,
            max_mutations_per_tenant=settings.max_mutations_per_tenant,
        ),
    )
    return ToolWiring(
        pipeline=pipeline,
        registry=catalog.registry,
        catalog=catalog,
        enqueue=enqueue,
        agents=agents,
    )
