"""The engine's measures: distributions and rates of the action contract, per tool class.

Each process that runs engine code (`serve` with its in-process worker, `voice-agent worker`)
counts what it did and exports it on its own `/metrics` (prometheus-client's process
registry); Prometheus sums the processes. Names and meanings are the observability issue's:

- `voice_agent_tool_admission_seconds{tool_class}`: a completed function call to the tool
  layer's answer (a mutation's: its operation persisted and its job enqueued; a read's: its
  answer);
- `voice_agent_operation_commit_seconds{tool_class}`: an operation admitted to committed
  (by the worker, the reconciler or the provider's callback);
- `voice_agent_commit_to_heard_seconds`: committed to its outcome heard in full in the call;
- `voice_agent_operations_unknown`: operations whose outcome is unknown, as of the last sweep;
- counters of duplicates suppressed, timeouts, retries, late results after a turn change,
  cancellations requested and confirmed, compensations, handoffs with operations open,
  reconciliations that failed, transfers that ended (`voice_agent_transfers_total{outcome}`)
  and call backs arranged.

Operations are mutations by construction (reads answer inline and are recorded as tool
calls), so the operation measures carry `tool_class="mutation"`. A measure taken inside a
transaction that is later rolled back (rare: a later step of the same transaction failed)
still counts: these are rates for an operator, the ledger is the record.
"""

from __future__ import annotations

from datetime import datetime

from prometheus_client import Counter, Gauge, Histogram

MUTATION = "mutation"
# Admission is milliseconds; a commit waits for a provider (seconds to minutes).
FAST_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
SLOW_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

TOOL_ADMISSION = Histogram(
    "voice_agent_tool_admission_seconds",
    "Completed function call to the tool layer's answer (a mutation: persisted and enqueued).",
    ["tool_class"],
    buckets=FAST_BUCKETS,
)
OPERATION_COMMIT = Histogram(
    "voice_agent_operation_commit_seconds",
    "Operation admitted to committed.",
    ["tool_class"],
    buckets=SLOW_BUCKETS,
)
COMMIT_TO_HEARD = Histogram(
    "voice_agent_commit_to_heard_seconds",
    "Operation committed to its outcome heard in full by the caller in the call.",
    buckets=SLOW_BUCKETS,
)
OPERATIONS_UNKNOWN = Gauge(
    "voice_agent_operations_unknown",
    "Operations whose outcome is unknown (waiting for reconciliation), as of the last sweep.",
)
DUPLICATES_SUPPRESSED = Counter(
    "voice_agent_duplicates_suppressed",
    "Function calls mapped to an existing operation (the same intent again).",
    ["tool_class"],
)
TOOL_TIMEOUTS = Counter(
    "voice_agent_tool_timeouts",
    "Attempts with no answer from the provider within the tool's deadline (-> unknown).",
    ["tool_class"],
)
TOOL_RETRIES = Counter(
    "voice_agent_tool_retries",
    "Attempts scheduled again after a failure that provably applied nothing.",
    ["tool_class"],
)
LATE_RESULTS_AFTER_TURN_CHANGE = Counter(
    "voice_agent_late_results_after_turn_change",
    "Outcomes that arrived after the caller changed the request they answer.",
)
CANCELLATIONS_REQUESTED = Counter(
    "voice_agent_cancellations_requested",
    "Cancellations asked for (by the caller, staff or the engine).",
)
CANCELLATIONS_CONFIRMED = Counter(
    "voice_agent_cancellations_confirmed",
    "Operations that ended cancelled after a cancellation was asked for.",
)
COMPENSATIONS = Counter(
    "voice_agent_compensations",
    "Compensating operations admitted (undoing a committed one).",
)
HANDOFFS_WITH_PENDING = Counter(
    "voice_agent_handoffs_with_pending_operations",
    "Agent handoffs made while the call had operations still open.",
)
DELIVERIES_WAITING = Gauge(
    "voice_agent_deliveries_waiting",
    "Outcomes not yet told, texted or given up (deliveries not at an end), as of the last sweep.",
)
DELIVERY_OLDEST_WAITING = Gauge(
    "voice_agent_delivery_oldest_waiting_seconds",
    "How long the oldest delivery not at an end has waited, as of the last sweep.",
)
RECONCILIATION_FAILURES = Counter(
    "voice_agent_reconciliation_failures",
    "Reconciliations that could not ask the provider (it errored or has no lookup).",
)
TRANSFERS = Counter(
    "voice_agent_transfers",
    "Transfers to a person that ended: put through (`transferred`) or not (`failed`).",
    ["outcome"],
)
CALLBACKS_ARRANGED = Counter(
    "voice_agent_callbacks_arranged",
    "Call backs the agent arranged in a call (schedule_callback admitted an outbound call).",
)


def committed(admitted_at: datetime | None, committed_at: datetime | None) -> None:
    """An operation committed; `admitted_at` is when it was admitted (None: unknown)."""
    if admitted_at is None or committed_at is None:
        return
    OPERATION_COMMIT.labels(MUTATION).observe(
        max(0.0, (committed_at - admitted_at).total_seconds())
    )


# Every tool class starts at zero, so a rate over a class that has not happened yet is 0, not
# absent (and the names are listed from the first scrape).
for _metric in (
    TOOL_ADMISSION,
    OPERATION_COMMIT,
    DUPLICATES_SUPPRESSED,
    TOOL_TIMEOUTS,
    TOOL_RETRIES,
):
    for _kind in ("read", "mutation", "control"):
        _metric.labels(_kind)
for _outcome in ("transferred", "failed"):
    TRANSFERS.labels(_outcome)
