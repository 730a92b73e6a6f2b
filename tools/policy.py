"""The policy engine: pure rules deciding whether a tool call may run.

Each rule looks at one `PolicyInput` and returns None (no objection) or a `Decision`.
`evaluate` runs the rules in order; the first refusal wins. Schema-valid arguments are
only the start: a rule may refuse a perfectly well-formed call.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, date, datetime, time, timedelta, tzinfo
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from tools.identity import CallerIdentity
from tools.registry import OverflowPolicy, PreconditionContext, ToolKind, ToolSpec


class Outcome(StrEnum):
    ALLOW = "allow"
    DENY = "deny"
    NEEDS_CONFIRMATION = "needs_confirmation"
    NEEDS_VERIFICATION = "needs_verification"


@dataclass(frozen=True, slots=True)
class Decision:
    """A rule's verdict. `reason` is speakable for refusals; `rule` names who decided."""

    outcome: Outcome
    reason: str = ""
    rule: str = ""
    readback: str | None = None  # NEEDS_CONFIRMATION: exactly what to read back
    prompt: str | None = None  # NEEDS_VERIFICATION: what to ask the caller
    overflow: OverflowPolicy | None = None  # admitted beyond the limit: QUEUE or DEGRADE

    @property
    def allowed(self) -> bool:
        return self.outcome is Outcome.ALLOW


@dataclass(frozen=True, slots=True)
class LedgerFacts:
    """What the ledger says, gathered by the caller of `evaluate` (rules stay pure)."""

    caller_recent_mutations: int = 0  # within the frequency window
    tenant_recent_mutations: int = 0
    in_flight_on_resource: int = 0
    caller_owns_target: bool = False  # e.g. the caller made the booking being cancelled


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    """Per-deployment policy knobs."""

    # tenant -> tools it offers; a tenant not listed offers every tool.
    tenant_tools: Mapping[str, frozenset[str]] = field(default_factory=dict)
    # tool -> caller roles allowed to use it; a tool not listed is open to every caller.
    tool_roles: Mapping[str, frozenset[str]] = field(default_factory=dict)
    blocked_callers: frozenset[str] = frozenset()
    frequency_window: timedelta = timedelta(hours=1)
    max_mutations_per_caller: int = 5
    max_mutations_per_tenant: int = 500
    tz: tzinfo = UTC


@dataclass(frozen=True, slots=True)
class PolicyInput:
    tenant_id: str
    call_id: str | None
    identity: CallerIdentity
    spec: ToolSpec
    args: BaseModel
    facts: LedgerFacts
    now: datetime
    config: PolicyConfig = field(default_factory=PolicyConfig)
    confirmed: bool = False  # the caller confirmed this exact operation
    admit_by: datetime | None = None  # a confirmation's window closes here

    def with_(self, **changes: Any) -> PolicyInput:
        return replace(self, **changes)


Rule = Callable[[PolicyInput], Decision | None]


def _deny(rule: str, reason: str) -> Decision:
    return Decision(Outcome.DENY, reason=reason, rule=rule)


# --- rules -------------------------------------------------------------------------------


def rule_tool_permitted(inp: PolicyInput) -> Decision | None:
    """The tenant offers this tool and the caller's role may use it."""
    offered = inp.config.tenant_tools.get(inp.tenant_id)
    if offered is not None and inp.spec.name not in offered:
        return _deny("tool_permitted", "That isn't something I can do on this line.")
    roles = inp.config.tool_roles.get(inp.spec.name)
    if roles is not None and inp.identity.role not in roles:
        return _deny("tool_permitted", "I'm not able to do that for this caller.")
    return None


def rule_caller_allowed(inp: PolicyInput) -> Decision | None:
    """Blocked numbers may do nothing; tools that need a caller ID refuse withheld ones."""
    if inp.identity.phone is not None and inp.identity.phone in inp.config.blocked_callers:
        return _deny("caller_allowed", "I'm sorry, I can't make changes from this number.")
    if inp.spec.needs_caller_id and inp.identity.withheld:
        return _deny(
            "caller_allowed",
            "I can't do that from a withheld number. Please call back with caller ID on.",
        )
    return None


def rule_verification(inp: PolicyInput) -> Decision | None:
    """Tools that demand it need a verified caller: the owner of the target or a PIN."""
    if not inp.spec.needs_verification:
        return None
    ident = inp.identity
    if ident.verified or inp.facts.caller_owns_target:
        return None
    if ident.locked:
        return _deny(
            "verification",
            "Too many wrong PINs on this call, so I can't do that now. Staff can help.",
        )
    if not ident.known:
        return _deny(
            "verification",
            "I can only do that for the number the booking was made from, or for a "
            "registered number with a PIN.",
        )
    return Decision(
        Outcome.NEEDS_VERIFICATION,
        reason="caller not verified",
        rule="verification",
        prompt="Please enter your PIN on the keypad followed by the hash key, or say the digits.",
    )


def rule_preconditions(inp: PolicyInput) -> Decision | None:
    """The tool's own argument preconditions (dates, opening hours, limits, names)."""
    ctx = PreconditionContext(now=inp.now, limits=inp.spec.limits, tz=inp.config.tz)
    for check in inp.spec.preconditions:
        problem = check(inp.args, ctx)
        if problem:
            return _deny("preconditions", problem)
    return None


def rule_frequency(inp: PolicyInput) -> Decision | None:
    """Per-caller and per-tenant limits on mutations within the window."""
    if inp.spec.kind is not ToolKind.MUTATION:
        return None
    if inp.facts.caller_recent_mutations >= inp.config.max_mutations_per_caller:
        return _deny("frequency", "You've made several changes just now; please try again later.")
    if inp.facts.tenant_recent_mutations >= inp.config.max_mutations_per_tenant:
        return _deny("frequency", "We're taking too many requests right now; please try later.")
    return None


def rule_concurrency(inp: PolicyInput) -> Decision | None:
    """In-flight work per resource, with the tool's declared overflow policy."""
    limit = inp.spec.concurrency
    if inp.spec.kind is not ToolKind.MUTATION or limit is None:
        return None
    n = inp.facts.in_flight_on_resource
    if n < limit.max_in_flight:
        return None
    if limit.overflow is OverflowPolicy.QUEUE and n < limit.max_in_flight + limit.max_queued:
        return Decision(
            Outcome.ALLOW,
            reason="queued behind others",
            rule="concurrency",
            overflow=OverflowPolicy.QUEUE,
        )
    if limit.overflow is OverflowPolicy.DEGRADE:
        return Decision(
            Outcome.ALLOW,
            reason="degraded: outcome by text message",
            rule="concurrency",
            overflow=OverflowPolicy.DEGRADE,
        )
    return _deny(
        "concurrency",
        "We're handling a lot of requests for that right now. Please try again in a few minutes.",
    )


def rule_admission_deadline(inp: PolicyInput) -> Decision | None:
    """A confirmation that arrives after its window admits nothing."""
    if inp.admit_by is not None and inp.now > inp.admit_by:
        return _deny(
            "admission_deadline",
            "That confirmation came too late, so the request "
            "was cancelled. I can set it up again if you like.",
        )
    return None


def rule_confirmation(inp: PolicyInput) -> Decision | None:
    """Tools that need it run only after the caller confirmed exactly this request."""
    # Only an explicit `False` sends a mutation at once; undeclared waits for the caller.
    if inp.spec.kind is not ToolKind.MUTATION or inp.spec.needs_confirmation is False:
        return None
    if inp.confirmed:
        return None
    return Decision(
        Outcome.NEEDS_CONFIRMATION,
        reason="awaiting the caller's confirmation",
        rule="confirmation",
        readback=f"Please confirm: {inp.spec.describe_args(inp.args)}. Say yes to confirm.",
    )


DEFAULT_RULES: tuple[Rule, ...] = (
    rule_tool_permitted,
    rule_caller_allowed,
    rule_verification,
    rule_preconditions,
    rule_admission_deadline,
    rule_frequency,
    rule_concurrency,
    rule_confirmation,
)


def evaluate(inp: PolicyInput, rules: Sequence[Rule] = DEFAULT_RULES) -> Decision:
    """Run the rules in order: the first refusal wins; overflow admissions are carried."""
    overflow: Decision | None = None
    for rule in rules:
        decision = rule(inp)
        if decision is None:
            continue
        if decision.allowed:
            overflow = overflow or decision
            continue
        if decision.outcome is Outcome.NEEDS_CONFIRMATION and overflow is not None:
            return replace(decision, overflow=overflow.overflow)
        return decision
    return overflow or Decision(Outcome.ALLOW, reason="all rules passed", rule="policy")


# --- precondition builders (used by catalogs) --------------------------------------------


def _field(args: BaseModel, name: str) -> Any:
    return getattr(args, name)


def _as_date(v: Any) -> date:
    return v if isinstance(v, date) else date.fromisoformat(str(v))


def _as_time(v: Any) -> time:
    return v if isinstance(v, time) else time.fromisoformat(str(v))


def date_within(
    field_name: str, max_days_key: str = "max_days_ahead"
) -> Callable[[BaseModel, PreconditionContext], str | None]:
    """The date is today or later, and at most `limits[max_days_key]` days ahead."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        d = _as_date(_field(args, field_name))
        today = ctx.now.astimezone(ctx.tz).date()
        if d < today:
            return "That date has already passed. Which day would you like?"
        max_days = ctx.limits.get(max_days_key)
        if max_days is not None and d > today + timedelta(days=int(max_days)):
            return f"We only take bookings up to {int(max_days)} days ahead."
        return None

    return check


def slot_in_future(
    date_field: str, time_field: str, lead_key: str = "min_lead_minutes"
) -> Callable[[BaseModel, PreconditionContext], str | None]:
    """The date and time together are at least `limits[lead_key]` minutes from now."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        d = _as_date(_field(args, date_field))
        t = _as_time(_field(args, time_field))
        when = datetime.combine(d, t, tzinfo=ctx.tz)
        lead = timedelta(minutes=int(ctx.limits.get(lead_key, 0)))
        if when < ctx.now.astimezone(ctx.tz) + lead:
            return "That time is too soon or already past. Could we pick a later time?"
        return None

    return check


def time_between(
    field_name: str, hours_key: str = "opening_hours"
) -> Callable[[BaseModel, PreconditionContext], str | None]:
    """The time lies within `limits[hours_key]` = ("HH:MM", "HH:MM") (last seating)."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        hours = ctx.limits.get(hours_key)
        if hours is None:
            return None
        start, end = (_as_time(h) for h in hours)
        t = _as_time(_field(args, field_name))
        if not start <= t <= end:
            return (
                f"We seat guests between {start:%H:%M} and {end:%H:%M}. "
                "Which time in that range suits you?"
            )
        return None

    return check


def int_at_most(
    field_name: str,
    limit_key: str,
    what: str,
    *,
    verb: str = "do this",
    beyond: str | None = None,
) -> Callable[[BaseModel, PreconditionContext], str | None]:
    """An amount (party size, quantity) within `limits[limit_key]`: "By phone I can {verb}
    for at most N {what}." and then `beyond` ("For more, please contact us directly.")."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        limit = ctx.limits.get(limit_key)
        value = int(_field(args, field_name))
        if value < 1:
            return f"The {what} must be at least 1."
        if limit is not None and value > int(limit):
            tail = f" {beyond}" if beyond else ""
            return f"By phone I can {verb} for at most {int(limit)} {what}.{tail}"
        return None

    return check


def not_blank(field_name: str, what: str) -> Callable[[BaseModel, PreconditionContext], str | None]:
    """A text argument that is not empty after trimming."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        value = _field(args, field_name)
        if value is None or not str(value).strip():
            return f"I need a {what} for that."
        return None

    return check
