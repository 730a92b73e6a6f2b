"""Integrator webhooks: operation status changes POSTed to subscribers, signed and retried.

Every status change writes one outbox row per active subscription inside the transaction
that made the change (`record_change`, called by `tools.ledger`), with its job, so a change
is never lost and never announced for a change that rolled back. A worker then POSTs it
(`send`), signed the Standard Webhooks way:

    webhook-id:        msg_<outbox id>   (the same on every retry: receivers deduplicate)
    webhook-timestamp: unix seconds of this attempt
    webhook-signature: v1,<base64 HMAC-SHA256 over "id.timestamp.body" with the secret>

and retries a failed attempt with exponential backoff and jitter up to a limit. Each attempt
is logged (`webhook_attempts`). One outbox row has one sender at a time (a conditional claim),
so our side sends each change once per attempt and never two attempts at once.
"""

from __future__ import annotations

import base64
import hmac
import json
import logging
import random
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlsplit

import httpx
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from tools import jobs
from tools.callback import sign_standard
from tools.ledger_models import OperationRecord
from tools.states import OperationStatus
from tools.webhook_models import webhook_attempts_table as att_t
from tools.webhook_models import webhook_deliveries_table as whd_t
from tools.webhook_models import webhook_subscriptions_table as sub_t

log = logging.getLogger(__name__)

EVENT_TYPE = "operation.status_changed"
SECRET_PREFIX = "whsec_"
USER_AGENT = "voice-agent-webhooks/1"


class WebhookError(ValueError):
    """A subscription that cannot be accepted (bad URL or secret)."""


# --- signing (Standard Webhooks) ------------------------------------------------------------


def new_secret() -> str:
    """A fresh signing secret, `whsec_` + base64 of 32 random bytes."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def _key(secret: str) -> bytes:
    raw = secret.removeprefix(SECRET_PREFIX)
    try:
        return base64.b64decode(raw, validate=True)
    except ValueError as exc:
        raise WebhookError("the secret must be whsec_ followed by base64") from exc


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """The `webhook-signature` header value: `v1,<base64 HMAC-SHA256 of id.timestamp.body>`."""
    # The same scheme signs provider callbacks (tools.callback), whose secrets may be plain.
    return sign_standard(_key(secret), msg_id, timestamp, body)


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, tolerance_s: int = 300) -> bool:
    """Whether a request carries a valid, fresh signature (for receivers and tests)."""
    msg_id = headers.get("webhook-id", "")
    stamp = headers.get("webhook-timestamp", "")
    if not msg_id or not stamp.isdigit():
        return False
    if abs(time.time() - int(stamp)) > tolerance_s:
        return False
    expected = sign(secret, msg_id, int(stamp), body).encode()
    return any(
        hmac.compare_digest(expected, part.encode())
        for part in headers.get("webhook-signature", "").split()
    )


def check_url(url: str) -> str:
    """An absolute http(s) URL, or WebhookError."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise WebhookError("the URL must be an absolute http:// or https:// URL")
    if len(url) > 2000:
        raise WebhookError("the URL is too long")
    return url.strip()


# --- subscriptions --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Subscription:
    """One row of `webhook_subscriptions` (the secret stays out of `as_json`)."""

    id: uuid.UUID
    tenant_id: str
    url: str
    secret: str
    source: str
    description: str | None
    active: bool
    created_at: datetime
    disabled_at: datetime | None

    @classmethod
    def from_row(cls, row: Any) -> Subscription:
        m = row._mapping
        return cls(**{f.name: m[f.name] for f in fields(cls)})

    def as_json(self) -> dict[str, Any]:
        return {
            "id": str(self.id),
            "tenant_id": self.tenant_id,
            "url": self.url,
            "source": self.source,
            "description": self.description,
            "active": self.active,
            "created_at": self.created_at.isoformat(),
            "disabled_at": self.disabled_at.isoformat() if self.disabled_at else None,
        }


async def subscribe(
    conn: AsyncConnection,
    *,
    tenant_id: str,
    url: str,
    secret: str | None = None,
    source: str = "api",
    description: str | None = None,
) -> Subscription:
    """Add a subscription (a secret is generated when none is given)."""
    secret = secret or new_secret()
    _key(secret)
    row = (
        await conn.execute(
            sub_t.insert()
            .values(
                id=uuid.uuid4(),
                tenant_id=tenant_id,
                url=check_url(url),
                secret=secret,
                source=source,
                description=description,
                active=True,
            )
            .returning(*sub_t.c)
        )
    ).first()
    assert row is not None
    return Subscription.from_row(row)


async def unsubscribe(conn: AsyncConnection, subscription_id: uuid.UUID) -> bool:
    """Stop sending to a subscription (its log is kept)."""
    result = await conn.execute(
        sub_t.update()
        .where(sub_t.c.id == subscription_id, sub_t.c.active.is_(True))
        .values(active=False, disabled_at=sa.func.now())
    )
    return bool(result.rowcount)


async def list_subscriptions(conn: AsyncConnection, tenant_id: str) -> list[Subscription]:
    rows = await conn.execute(
        sa.select(sub_t).where(sub_t.c.tenant_id == tenant_id).order_by(sub_t.c.created_at)
    )
    return [Subscription.from_row(r) for r in rows]


async def get_subscription(
    conn: AsyncConnection, subscription_id: uuid.UUID
) -> Subscription | None:
    row = (await conn.execute(sa.select(sub_t).where(sub_t.c.id == subscription_id))).first()
    return Subscription.from_row(row) if row is not None else None


async def sync_configured(
    conn: AsyncConnection, tenant_id: str, configured: Sequence[Mapping[str, Any]]
) -> list[Subscription]:
    """Make the `source='config'` subscriptions match the configuration: add or update
    each configured URL, deactivate configured ones no longer listed."""
    await conn.execute(
        sa.select(sa.func.pg_advisory_xact_lock(sa.func.hashtextextended("webhooks-config", 0)))
    )
    existing = {s.url: s for s in await list_subscriptions(conn, tenant_id) if s.source == "config"}
    kept: list[Subscription] = []
    for item in configured:
        url = check_url(str(item["url"]))
        secret = str(item["secret"])
        _key(secret)
        found = existing.pop(url, None)
        if found is None:
            kept.append(
                await subscribe(
                    conn,
                    tenant_id=tenant_id,
                    url=url,
                    secret=secret,
                    source="config",
                    description=item.get("description"),
                )
            )
            continue
        row = (
            await conn.execute(
                sub_t.update()
                .where(sub_t.c.id == found.id)
                .values(
                    secret=secret,
                    active=True,
                    disabled_at=None,
                    description=item.get("description"),
                )
                .returning(*sub_t.c)
            )
        ).first()
        assert row is not None
        kept.append(Subscription.from_row(row))
    for gone in existing.values():
        await unsubscribe(conn, gone.id)
    return kept


# --- the outbox -----------------------------------------------------------------------------


def payload(
    op: OperationRecord,
    from_status: OperationStatus | None,
    event_id: int,
    at: datetime,
) -> dict[str, Any]:
    """The JSON body of one status change."""
    return {
        "type": EVENT_TYPE,
        "timestamp": at.isoformat(),
        "data": {
            "operation_id": str(op.operation_id),
            "sequence": event_id,  # increases per change: order-safe receivers compare it
            "tenant_id": op.tenant_id,
            "tool": op.tool,
            "status": op.status.value,
            "previous_status": from_status.value if from_status else None,
            "arguments": op.args,
            "reference": op.provider_ref,
            "attempts": op.attempts,
            "call_id": op.call_id,
            "compensates_operation_id": (
                str(op.compensates_operation_id) if op.compensates_operation_id else None
            ),
        },
    }


async def record_change(
    conn: AsyncConnection,
    op: OperationRecord,
    from_status: OperationStatus | None,
    event_id: int,
    at: datetime,
    *,
    notify: tuple[str, str] | None = None,
) -> list[uuid.UUID]:
    """One outbox row (and its job) per active subscription, in the change's transaction.

    `notify` (channel, payload) sends the change's `pg_notify` in the same statement: one
    round trip for both, the notification exactly once whatever the number of rows.
    """
    body = payload(op, from_status, event_id, at)
    params: dict[str, Any] = {
        "op": op.operation_id,
        "ev": event_id,
        "type": EVENT_TYPE,
        "payload": json.dumps(body, default=str),
        "tenant": op.tenant_id,
    }
    if notify is None:
        rows = await conn.execute(_RECORD_CHANGE, params)
        ids = [r.id for r in rows.all()]
    else:
        params["channel"], params["notice"] = notify
        row = (await conn.execute(_RECORD_CHANGE_AND_NOTIFY, params)).one()
        ids = list(row.ids or [])
    for delivery_id in ids:
        await jobs.defer(conn, jobs.WEBHOOK_TASK, webhook_delivery_id=str(delivery_id))
    return ids


_INSERT_CHANGE = (
    "INSERT INTO webhook_deliveries (id, subscription_id, operation_id, "
    "operation_event_id, event_type, payload, state, next_attempt_at) "
    "SELECT gen_random_uuid(), s.id, :op, :ev, :type, CAST(:payload AS jsonb), "
    "'pending', now() FROM webhook_subscriptions s "
    "WHERE s.active AND s.tenant_id = :tenant "
    "ON CONFLICT (subscription_id, operation_event_id) DO NOTHING RETURNING id"
)
_RECORD_CHANGE = sa.text(_INSERT_CHANGE)
# One row always: the notification once, the outbox rows' ids as an array.
_RECORD_CHANGE_AND_NOTIFY = sa.text(
    f"WITH ins AS ({_INSERT_CHANGE}) "
    "SELECT pg_notify(CAST(:channel AS text), CAST(:notice AS text)) AS notified, "
    "ARRAY(SELECT id FROM ins) AS ids"
)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How failed POSTs are retried."""

    max_attempts: int = 8
    base_s: float = 2.0
    max_backoff_s: float = 3600.0
    jitter: float = 0.2
    timeout_s: float = 10.0

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.max_backoff_s, self.base_s * (2 ** max(0, attempt - 1)))
        return max(0.0, base * (1.0 + (rng or random).uniform(-self.jitter, self.jitter)))


@dataclass(frozen=True, slots=True)
class SendResult:
    """What one `send` did."""

    state: str
    attempt: int
    status_code: int | None
    retry_at: datetime | None = None


async def send(
    engine: AsyncEngine,
    webhook_delivery_id: uuid.UUID,
    http: httpx.AsyncClient,
    policy: RetryPolicy | None = None,
    rng: random.Random | None = None,
) -> SendResult | None:
    """One attempt at one outbox row: claim, POST, log, then done / retry later / give up.

    None when there is nothing to do (delivered, given up, or another worker holds it).
    """
    policy = policy or RetryPolicy()
    async with engine.begin() as conn:
        row = (await conn.execute(_SEND_CLAIM, {"b_id": webhook_delivery_id})).first()
        if row is None or row.state != "pending":
            return None
        if not row.active:
            await conn.execute(_SEND_DISABLED, {"b_id": webhook_delivery_id})
            return SendResult("failed", row.attempts, None)
        attempt = row.attempts + 1
        await conn.execute(_SEND_SENDING, {"b_id": webhook_delivery_id, "b_attempts": attempt})
    body = json.dumps(row.payload, separators=(",", ":"), sort_keys=True).encode()
    msg_id = f"msg_{webhook_delivery_id.hex}"
    stamp = int(time.time())
    headers = {
        "content-type": "application/json",
        "user-agent": USER_AGENT,
        "webhook-id": msg_id,
        "webhook-timestamp": str(stamp),
        "webhook-signature": sign(row.secret, msg_id, stamp, body),
    }
    status_code: int | None = None
    error: str | None = None
    started = time.perf_counter()
    try:
        response = await http.post(row.url, content=body, headers=headers, timeout=policy.timeout_s)
        status_code = response.status_code
    except httpx.HTTPError as exc:
        error = f"{type(exc).__name__}: {exc}"[:300]
    duration_ms = (time.perf_counter() - started) * 1000
    ok = status_code is not None and 200 <= status_code < 300
    gone = status_code == 410  # the receiver asks us to stop
    retry_at: datetime | None = None
    if ok:
        state = "delivered"
    elif gone or attempt >= policy.max_attempts:
        state = "failed"
    else:
        state = "pending"
        retry_at = datetime.now(UTC) + timedelta(seconds=policy.backoff_s(attempt, rng))
    if error is None and not ok:
        error = f"HTTP {status_code}"
    async with engine.begin() as conn:
        await conn.execute(
            _SEND_ATTEMPT,
            {
                "webhook_delivery_id": webhook_delivery_id,
                "attempt": attempt,
                "status_code": status_code,
                "error": error,
                "duration_ms": round(duration_ms, 2),
            },
        )
        await conn.execute(
            _SEND_DONE if ok else _SEND_NOT_DONE,
            {
                "b_id": webhook_delivery_id,
                "b_state": state,
                "b_last_status_code": status_code,
                "b_last_error": None if ok else error,
                "b_next_attempt_at": retry_at,
            },
        )
        if gone:
            await unsubscribe(conn, row.subscription_id)
        if retry_at is not None:
            await jobs.defer(
                conn,
                jobs.WEBHOOK_TASK,
                schedule_at=retry_at,
                webhook_delivery_id=str(webhook_delivery_id),
            )
    if not ok:
        log.info("webhook %s attempt %d failed: %s", msg_id, attempt, error)
    return SendResult(state, attempt, status_code, retry_at)


# `send`'s statements, built once (values as parameters; same SQL and rows as built per call).
def _b(name: str, column: Any) -> Any:
    return sa.bindparam(name, type_=column.type)


_SEND_CLAIM = (
    sa.select(whd_t, sub_t.c.url, sub_t.c.secret, sub_t.c.active)
    .join(sub_t, sub_t.c.id == whd_t.c.subscription_id)
    .where(whd_t.c.id == _b("b_id", whd_t.c.id))
    .with_for_update(of=whd_t, skip_locked=True)
)
_SEND_DISABLED = (
    whd_t.update()
    .where(whd_t.c.id == _b("b_id", whd_t.c.id))
    .values(state="failed", last_error="subscription disabled", updated_at=sa.func.now())
)
_SEND_SENDING = (
    whd_t.update()
    .where(whd_t.c.id == _b("b_id", whd_t.c.id))
    .values(state="sending", attempts=_b("b_attempts", whd_t.c.attempts), updated_at=sa.func.now())
)
_SEND_ATTEMPT = att_t.insert()


def _send_done(delivered: bool) -> Any:
    return (
        whd_t.update()
        .where(whd_t.c.id == _b("b_id", whd_t.c.id), whd_t.c.state == "sending")
        .values(
            state=_b("b_state", whd_t.c.state),
            last_status_code=_b("b_last_status_code", whd_t.c.last_status_code),
            last_error=_b("b_last_error", whd_t.c.last_error),
            next_attempt_at=_b("b_next_attempt_at", whd_t.c.next_attempt_at),
            delivered_at=sa.func.now() if delivered else None,
            updated_at=sa.func.now(),
        )
    )


_SEND_DONE = _send_done(True)
_SEND_NOT_DONE = _send_done(False)


async def recover(engine: AsyncEngine, *, stuck_after_s: float, limit: int = 100) -> int:
    """Outbox rows a dead worker left `sending`, or `pending` with no job: send again."""
    async with engine.begin() as conn:
        rows = await conn.execute(
            sa.text(
                "SELECT w.id FROM webhook_deliveries w WHERE "
                "((w.state = 'sending' AND w.updated_at < now() - make_interval(secs => :stuck)) "
                "OR (w.state = 'pending' AND coalesce(w.next_attempt_at, w.created_at) "
                "< now() - make_interval(secs => :stuck))) "
                "AND NOT EXISTS (SELECT 1 FROM procrastinate_jobs j WHERE j.status IN "
                "('todo', 'doing') AND j.task_name = :task "
                "AND j.args->>'webhook_delivery_id' = w.id::text) "
                "ORDER BY w.updated_at LIMIT :n FOR UPDATE OF w SKIP LOCKED"
            ),
            {"stuck": stuck_after_s, "task": jobs.WEBHOOK_TASK, "n": limit},
        )
        ids = [r.id for r in rows.all()]
        for webhook_delivery_id in ids:
            await conn.execute(
                whd_t.update()
                .where(whd_t.c.id == webhook_delivery_id)
                .values(state="pending", updated_at=sa.func.now())
            )
            await jobs.defer(conn, jobs.WEBHOOK_TASK, webhook_delivery_id=str(webhook_delivery_id))
    return len(ids)


async def delivery_log(
    conn: AsyncConnection, subscription_id: uuid.UUID, limit: int = 100
) -> list[dict[str, Any]]:
    """The subscription's recent outbox rows, each with its attempts."""
    rows = (
        await conn.execute(
            sa.select(whd_t)
            .where(whd_t.c.subscription_id == subscription_id)
            .order_by(whd_t.c.created_at.desc())
            .limit(limit)
        )
    ).all()
    ids = [r.id for r in rows]
    attempts: dict[uuid.UUID, list[dict[str, Any]]] = {i: [] for i in ids}
    if ids:
        for a in await conn.execute(
            sa.select(att_t).where(att_t.c.webhook_delivery_id.in_(ids)).order_by(att_t.c.id)
        ):
            attempts[a.webhook_delivery_id].append(
                {
                    "attempt": a.attempt,
                    "at": a.at.isoformat(),
                    "status_code": a.status_code,
                    "error": a.error,
                    "duration_ms": a.duration_ms,
                }
            )
    return [
        {
            "id": str(r.id),
            "webhook_id": f"msg_{r.id.hex}",
            "operation_id": str(r.operation_id),
            "event_type": r.event_type,
            "sequence": r.operation_event_id,
            "status": r.payload.get("data", {}).get("status"),
            "state": r.state,
            "attempts": attempts[r.id],
            "last_status_code": r.last_status_code,
            "last_error": r.last_error,
            "created_at": r.created_at.isoformat(),
            "delivered_at": r.delivered_at.isoformat() if r.delivered_at else None,
            "next_attempt_at": r.next_attempt_at.isoformat() if r.next_attempt_at else None,
        }
        for r in rows
    ]


# --- the change's outbox rows inside the transition's own statement -----------------------

# `payload`'s body built by Postgres from the updated row (CTE `upd`, with `prev_status`) and its
# event (CTE `ev`): the same JSON, the timestamp in `datetime.isoformat`'s form (microseconds
# only when there are some; the offset of the session's time zone, as the driver reads it).
_PAYLOAD_SQL = (
    "jsonb_build_object('type', '" + EVENT_TYPE + "', 'timestamp', "
    "to_char(ev.at, 'YYYY-MM-DD\"T\"HH24:MI:SS') || CASE WHEN to_char(ev.at, 'US') = '000000' "
    "THEN '' ELSE to_char(ev.at, '.US') END || to_char(ev.at, 'TZH:TZM'), "
    "'data', jsonb_build_object('operation_id', upd.operation_id::text, 'sequence', ev.id, "
    "'tenant_id', upd.tenant_id, 'tool', upd.tool, 'status', upd.status, "
    "'previous_status', upd.prev_status, 'arguments', upd.args, 'reference', upd.provider_ref, "
    "'attempts', upd.attempts, 'call_id', upd.call_id, "
    "'compensates_operation_id', upd.compensates_operation_id::text))"
)


def outbox_cte(upd: Any, ev: Any) -> Any:
    """`record_change`'s outbox rows as CTE `wh` (their `id`s) of the transition statement
    whose CTEs `upd` (the updated operation, `prev_status`) and `ev` (its event) it reads: one
    row per active subscription of the tenant. Their jobs go with the statement's own
    (`jobs.defer_in_statement`)."""
    rows = sa.select(
        sa.func.gen_random_uuid(),
        sub_t.c.id,
        upd.c.operation_id,
        ev.c.id,
        sa.literal_column(f"'{EVENT_TYPE}'"),
        sa.literal_column(_PAYLOAD_SQL),
        sa.literal_column("'pending'"),
        sa.func.now(),
    ).select_from(
        upd.join(ev, sa.true()).join(
            sub_t, sa.and_(sub_t.c.active, sub_t.c.tenant_id == upd.c.tenant_id)
        )
    )
    cols = [
        "id",
        "subscription_id",
        "operation_id",
        "operation_event_id",
        "event_type",
        "payload",
        "state",
        "next_attempt_at",
    ]
    return (
        pg_insert(whd_t)
        .from_select(cols, rows, include_defaults=False)
        .on_conflict_do_nothing(index_elements=["subscription_id", "operation_event_id"])
        .returning(whd_t.c.id)
        .cte("wh")
    )


# The outbox rows' jobs, as `jobs.defer_in_statement` rows (job args as jsonb), from CTE `wh`.
OUTBOX_JOBS_SQL = (
    "SELECT jsonb_build_object('webhook_delivery_id', wh.id::text) AS args, "
    f"'{jobs.WEBHOOK_TASK}' AS task FROM wh"
)
