"""Tool specifications and the registry that holds them.

A `ToolSpec` is everything the rest of the tool layer needs to know about one tool: what
the model sees (name, description, argument schema), how the policy engine treats it, and
how the executor runs it (provider action, idempotency, deadline, retries, reconciliation,
cancellation and compensation).
"""

from __future__ import annotations

import copy
import functools
import json
import random
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, tzinfo
from enum import StrEnum
from typing import Any

import orjson
from pydantic import BaseModel, ValidationError

from tools.errors import InvalidArguments, UnknownTool


class ToolKind(StrEnum):
    """How the pipeline runs a tool."""

    READ = "read"  # answered inline within its deadline, recorded in tool_calls
    MUTATION = "mutation"  # admitted as an operation and executed by a worker
    CONTROL = "control"  # handled by the pipeline itself (confirmation, PIN entry)


class OnUnknown(StrEnum):
    """What resolves an operation whose outcome is `unknown` (sent, the answer lost)."""

    RECONCILE = "reconcile"  # ask the provider (the tool's `reconcile` lookup)
    ASK_STAFF = "ask_staff"  # the provider offers no lookup: a person settles it


class OverflowPolicy(StrEnum):
    """What to do when a resource is at its concurrency limit."""

    REJECT = "reject"  # deny with a speakable reason
    QUEUE = "queue"  # admit behind the others (up to max_queued) and say so
    DEGRADE = "degrade"  # admit, and promise the outcome by text message instead


@dataclass(frozen=True, slots=True)
class ConcurrencyLimit:
    """In-flight operations per resource, and what happens beyond that."""

    max_in_flight: int
    overflow: OverflowPolicy = OverflowPolicy.REJECT
    max_queued: int = 0  # with QUEUE: how many may wait beyond max_in_flight


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries for an idempotent provider: exponential backoff with jitter, total deadline."""

    max_attempts: int = 1
    base_backoff_s: float = 0.5
    max_backoff_s: float = 10.0
    jitter: float = 0.5  # fraction of the backoff drawn at random (+/-)
    total_deadline_s: float = 120.0

    def backoff_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """Delay before attempt `attempt + 1` (attempt counts from 1)."""
        base = min(self.max_backoff_s, self.base_backoff_s * (2 ** max(0, attempt - 1)))
        r = (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base * (1.0 + r))


@dataclass(frozen=True, slots=True)
class ConflictRule:
    """When two requests of the same caller contradict each other.

    Operations of the tool whose `key` (computed from the validated arguments) is equal, made
    by the same caller, conflict: a second one waits while the first is in flight (the
    caller decides once it settles: move it, keep both, or leave it), and after the first
    went through, keeping both takes an explicit yes.
    """

    key: Callable[[Any], str]  # e.g. lambda a: f"booking-day:{a.date}"
    what: str = "a request for the same thing"  # speakable: "a booking for the same day"


@dataclass(frozen=True, slots=True)
class PreconditionContext:
    """What a precondition may look at besides the arguments."""

    now: datetime
    limits: Mapping[str, Any]
    tz: tzinfo = UTC


# A precondition returns None when satisfied, else a short speakable reason to refuse.
Precondition = Callable[[BaseModel, PreconditionContext], str | None]


@dataclass(frozen=True)
class ToolSpec:
    """One tool, as declared in a catalog."""

    name: str
    description: str  # what it does, when to call it and when not to
    args_model: type[BaseModel]
    kind: ToolKind
    # The executor hook the execution side binds, e.g. "sor.book_table".
    provider_action: str | None = None
    provider_idempotent: bool = False
    # Read back and wait for the caller's yes (True), or sent at once (False). A mutation
    # must say which: None is refused by the catalog check (and treated as True meanwhile).
    needs_confirmation: bool | None = None
    needs_verification: bool = False  # PIN (or proof of ownership) before it may run
    needs_caller_id: bool = False  # refuse withheld/anonymous numbers
    limits: Mapping[str, Any] = field(default_factory=dict)
    preconditions: tuple[Precondition, ...] = ()
    deadline_s: float = 5.0  # one attempt (reads: the inline answer)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    reconcile: str | None = None  # strategy name, e.g. "sor.lookup_by_key"
    cancellable_at_provider: bool = False
    compensated_by: str | None = None
    concurrency: ConcurrencyLimit | None = None
    # The resource the concurrency limit counts against (e.g. "tables:2026-12-05").
    resource: Callable[[Any], str] | None = None
    # Short phrase naming the intent: "a table for 4 on 2026-12-05 at 21:00 under Ada".
    describe: Callable[[Any], str] | None = None
    # Shapes a provider result into a compact, speakable dict (reads and committed results).
    shape_result: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    confirm_window_s: float = 120.0
    # The provider reference this tool acts on (e.g. the booking id a cancel targets): the
    # policy engine treats the caller who created that reference as its owner.
    target_ref: Callable[[Any], str] | None = None
    # Arguments that must not be stored verbatim (PINs): tool_calls keeps a redacted copy.
    redact_arguments: bool = False
    # How an `unknown` outcome is resolved: by `reconcile` (a lookup at the provider), or,
    # for a provider that offers no lookup, by a person (never by a blind retry).
    on_unknown: OnUnknown = OnUnknown.RECONCILE
    # The argument that carries the provider reference this tool acts on (the booking id a
    # cancel targets): compensation fills it with the compensated operation's reference.
    reference_arg: str | None = None
    # Who confirms the outcome, as the caller would say it ("the restaurant").
    provider_label: str = "the system of record"
    # Where the tool was declared ("tools.yaml:12"), for messages about it.
    origin: str | None = None
    # Which earlier requests of the same caller this one contradicts (see ConflictRule).
    conflicts: ConflictRule | None = None

    def definition(self) -> dict[str, Any]:
        """The Realtime `function` tool definition (what the model sees)."""
        return {
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": _parameters(self.args_model),
        }

    def parse(self, raw: str) -> BaseModel:
        """Raw JSON text from the model -> validated arguments, or `InvalidArguments`."""
        try:
            data = json.loads(raw) if raw.strip() else {}
        except json.JSONDecodeError as exc:
            raise InvalidArguments(f"the arguments were not valid JSON ({exc.msg})") from exc
        except (ValueError, RecursionError) as exc:
            # Model output is untrusted: an integer over Python's digit limit (ValueError) or
            # nesting deeper than json's recursion limit is invalid input, not an internal error.
            raise InvalidArguments("the arguments were not valid JSON (too large or deep)") from exc
        if not isinstance(data, dict):
            raise InvalidArguments("the arguments must be a JSON object")
        if _unstorable(data):
            # The ledger stores arguments as JSONB, which refuses these: without this check a
            # schema-valid call failed at insert and the model heard a retryable internal error.
            raise InvalidArguments("the arguments contain a NUL or a broken unicode character")
        try:
            return self.args_model.model_validate(data)
        except ValidationError as exc:
            raise InvalidArguments(_speakable_errors(exc)) from exc

    def normalize(self, args: BaseModel) -> dict[str, Any]:
        """Canonical JSON-able arguments (what the ledger stores and hashes)."""
        return args.model_dump(mode="json")

    def may_retry(self, attempts: int) -> bool:
        """Automatic retries only where the provider honours idempotency keys."""
        return self.provider_idempotent and attempts < self.retry.max_attempts

    def target(self, args: BaseModel) -> str | None:
        """The provider reference these arguments act on (`target_ref`, else `reference_arg`)."""
        if self.target_ref is not None:
            return self.target_ref(args)
        if self.reference_arg is not None:
            value = getattr(args, self.reference_arg, None)
            return str(value) if value is not None else None
        return None

    def describe_args(self, args: BaseModel) -> str:
        if self.describe is not None:
            return self.describe(args)
        return ", ".join(f"{k} {v}" for k, v in self.normalize(args).items())


def _unstorable(value: Any) -> bool:
    """Whether decoded JSON holds text Postgres JSONB refuses: NUL, or a lone surrogate."""
    if isinstance(value, str):
        return "\x00" in value or any("\ud800" <= c <= "\udfff" for c in value)
    if isinstance(value, dict):
        return any(_unstorable(k) or _unstorable(v) for k, v in value.items())
    if isinstance(value, list):
        return any(_unstorable(v) for v in value)
    return False


def _parameters(args_model: type[BaseModel]) -> dict[str, Any]:
    """The model's JSON schema as the model sees it: made once per class (pydantic builds it
    anew on every call, and every call's session.update lists every tool); a copy each time,
    so no caller can change another's. The copy is parsed from the schema's JSON text, kept
    with it (7 us for the demo's tools where `copy.deepcopy` took 50, every call's set-up)."""
    schema, text = _cached_parameters(args_model)
    if text is None:
        return copy.deepcopy(schema)
    copied: dict[str, Any] = orjson.loads(text)
    return copied


@functools.cache
def _cached_parameters(args_model: type[BaseModel]) -> tuple[dict[str, Any], bytes | None]:
    schema = _clean_schema(args_model.model_json_schema())
    # The text only where parsing it gives the schema back exactly (not, say, a tuple, NaN
    # or an integer past 64 bits); otherwise each copy is a deep copy.
    try:
        text = orjson.dumps(schema)
        exact = orjson.loads(text) == schema
    except (TypeError, ValueError):  # orjson's errors are both
        return schema, None
    return schema, text if exact else None


def _clean_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Drop pydantic's titles (noise for the model) and forbid unknown properties."""
    cleaned: dict[str, Any] = _strip_titles(schema)
    cleaned.setdefault("type", "object")
    cleaned.setdefault("properties", {})
    cleaned["additionalProperties"] = False
    return cleaned


def _strip_titles(node: Any) -> Any:
    # A module function: a nested one calling itself is a reference cycle (function -> cell
    # -> function), garbage for the collector each time it is made.
    if isinstance(node, dict):
        out = {k: _strip_titles(v) for k, v in node.items() if k != "title"}
        if "properties" in node:
            out["properties"] = {k: _strip_titles(v) for k, v in node["properties"].items()}
        return out
    if isinstance(node, list):
        return [_strip_titles(v) for v in node]
    return node


def _speakable_errors(exc: ValidationError, limit: int = 3) -> str:
    parts = []
    for err in exc.errors()[:limit]:
        where = ".".join(str(p) for p in err.get("loc", ())) or "arguments"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    more = exc.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


class Registry:
    """The tools one deployment offers, by name."""

    def __init__(self, specs: Iterator[ToolSpec] | list[ToolSpec] | tuple[ToolSpec, ...] = ()):
        self._specs: dict[str, ToolSpec] = {}
        for spec in specs:
            self.register(spec)

    def register(self, spec: ToolSpec) -> None:
        if spec.name in self._specs:
            raise ValueError(f"tool {spec.name!r} registered twice")
        self._specs[spec.name] = spec

    def get(self, name: str) -> ToolSpec:
        try:
            return self._specs[name]
        except KeyError:
            raise UnknownTool(f"no tool named {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._specs

    def __iter__(self) -> Iterator[ToolSpec]:
        return iter(self._specs.values())

    def names(self) -> list[str]:
        return list(self._specs)

    def definitions(self) -> list[dict[str, Any]]:
        """Realtime function definitions of every tool, for session.update."""
        return [spec.definition() for spec in self._specs.values()]

    def check(self) -> None:
        """Refuse a catalog whose cross references do not resolve."""
        for spec in self._specs.values():
            if spec.compensated_by is not None and spec.compensated_by not in self._specs:
                raise ValueError(f"{spec.name}: compensating tool {spec.compensated_by!r} missing")
            if spec.kind is ToolKind.MUTATION and spec.provider_action is None:
                raise ValueError(f"{spec.name}: a mutation needs a provider_action")
