"""A deployment's catalog: its tools, the providers they run on, and the check at start.

A catalog is data plus providers. Each `ToolSpec` names the provider it runs on
(`provider_action="<provider>.<action>"`) and, for a mutation, how an `unknown` is resolved
(`reconcile="<provider>.<strategy>"`, a lookup at that provider, or
`on_unknown=OnUnknown.ASK_STAFF`). The engine routes each hook to the provider the tool
names, so one catalog may use several systems of record. `check_catalog` refuses a catalog
that could not run safely (a mutation nobody can reconcile, a retry that could double an
effect, a dangling reference) with one line per problem naming the tool and the fix.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from tools.control import CONTROL_TOOL_NAMES, control_tools
from tools.errors import ToolError
from tools.ledger import OperationRecord
from tools.provider import (
    ActionResult,
    CancellingProvider,
    ClosingProvider,
    Finding,
    Outcome,
    ReadProvider,
)
from tools.registry import OnUnknown, OverflowPolicy, Registry, ToolKind, ToolSpec

if TYPE_CHECKING:
    from tools.agents import AgentSet
    from tools.transfers import TransferTarget

log = logging.getLogger(__name__)

# Realtime function names; also the width of tool_calls.tool / operations.tool.
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
PROVIDER_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

# Locates a declaration: (tool, field) -> ("tools.yaml:12", "tools[1].retry") (where, and
# the field as its source spells it), or None when the catalog does not know.
Locator = Callable[[ToolSpec | None, str | None], tuple[str, str | None] | None]


@dataclass(frozen=True, slots=True)
class CatalogContext:
    """What a catalog factory (`TOOLS=pkg.module:factory`) is given to build its catalog."""

    tenant_id: str = "default"
    # Where this service is reached (e.g. for callback URLs a provider is told about).
    public_base_url: str = "http://127.0.0.1:8000"
    # The process environment: a factory reads its own settings and secrets from here.
    environ: Mapping[str, str] = field(default_factory=dict)
    # SOR_BASE_URL, or the demo system of record `serve` started when it was unset.
    sor_base_url: str | None = None


@dataclass(frozen=True, slots=True)
class CatalogProblem:
    """One reason a catalog cannot run: which tool, which field, what is wrong, the fix."""

    tool: str | None
    field: str | None
    message: str
    fix: str
    where: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.where:
            parts.append(f"{self.where}:")
        if self.tool is not None:
            parts.append(f"tool {self.tool!r}" + (f" ({self.field})" if self.field else "") + ":")
        elif self.field:
            parts.append(f"{self.field}:")
        parts.append(self.message.rstrip("."))
        return " ".join(parts) + f". Fix: {self.fix}"


class CatalogError(ToolError):
    """The catalog cannot be used; `problems` says why, one line each."""

    def __init__(self, problems: Iterable[CatalogProblem], *, source: str = "catalog") -> None:
        self.problems = list(problems)
        self.source = source
        n = len(self.problems)
        lines = [f"{source}: {n} problem{'s' if n != 1 else ''}"]
        lines += [f"  {p}" for p in self.problems]
        super().__init__("\n".join(lines))


def split_binding(binding: str) -> tuple[str, str]:
    """`"<provider>.<action>"` -> (provider, action); no dot -> (binding, "")."""
    provider, _, action = binding.partition(".")
    return provider, action


class Catalog:
    """The tools a deployment offers and the providers (systems of record) they run on.

    `tools` are the domain's own tools; the engine adds its control tools
    (`confirm_operation`, `verify_pin`) to `registry` when a tool needs them.
    `instructions` (optional) is the persona the Realtime session starts with.
    """

    def __init__(
        self,
        tools: Iterable[ToolSpec],
        providers: Mapping[str, object],
        *,
        name: str = "catalog",
        instructions: str | None = None,
        locate: Locator | None = None,
    ) -> None:
        self.tools: tuple[ToolSpec, ...] = tuple(tools)
        self.providers: dict[str, object] = dict(providers)
        self.name = name
        self.instructions = instructions
        self._locate = locate
        # Agents the catalog's file declares (the tools file's `agents`); None: one agent.
        self.agents: AgentSet | None = None
        # Transfer targets the catalog's file declares (`transfers`); None: TRANSFER_TARGETS.
        self.transfers: dict[str, TransferTarget] | None = None

    def __repr__(self) -> str:
        return f"Catalog({self.name!r}, tools={[t.name for t in self.tools]})"

    @cached_property
    def registry(self) -> Registry:
        """Every tool the model is offered: the domain's plus the control tools they need."""
        return Registry([*self.tools, *control_tools(self.tools)])

    @cached_property
    def router(self) -> CatalogRouter:
        """The executor's `Provider`: each call goes to the provider its tool names."""
        return CatalogRouter(self)

    def locate(
        self, spec: ToolSpec | None, field_name: str | None = None
    ) -> tuple[str | None, str | None]:
        """Where a tool (or one of its fields) was declared, and the field as spelled there."""
        if self._locate is not None:
            found = self._locate(spec, field_name)
            if found:
                return found
        return (spec.origin if spec is not None else None), field_name

    def provider(self, binding: str | None) -> object:
        """The provider a binding (`"<provider>.<action>"`) names; `ToolError` if none."""
        if binding is None:
            raise ToolError("no provider binding")
        name, _ = split_binding(binding)
        try:
            return self.providers[name]
        except KeyError:
            raise ToolError(f"no provider named {name!r} in the catalog") from None

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        """The pipeline's read hook: the read tool's provider answers it."""
        provider = self.provider(spec.provider_action)
        if not isinstance(provider, ReadProvider):
            raise ToolError(f"provider of {spec.name} cannot answer reads")
        return await provider.read(spec, args)

    def check(self) -> list[CatalogProblem]:
        """Every reason this catalog cannot run (empty: it can)."""
        return check_catalog(self)

    def unconfirmed_mutations(self) -> list[str]:
        """The tools that change things without the caller's yes (`confirmation: none`)."""
        return [
            t.name
            for t in self.tools
            if t.kind is ToolKind.MUTATION and t.needs_confirmation is False
        ]

    def notices(self) -> list[str]:
        """What the check allows but an operator must hear about, one line each."""
        unconfirmed = self.unconfirmed_mutations()
        if not unconfirmed:
            return []
        return [
            f"catalog {self.name}: these tools change things without the caller's "
            f"confirmation (confirmation: none): {', '.join(unconfirmed)}"
        ]

    def checked(self) -> Catalog:
        """This catalog, or `CatalogError` naming every problem."""
        problems = self.check()
        if problems:
            raise CatalogError(problems, source=f"catalog {self.name}")
        return self

    async def aclose(self) -> None:
        """Close every provider that holds resources (each one, whatever the others do)."""
        for name, provider in self.providers.items():
            if isinstance(provider, ClosingProvider):
                try:
                    await provider.aclose()
                except Exception:
                    log.exception("closing provider %s failed", name)


class CatalogRouter:
    """Implements `tools.provider.Provider` (and `cancel`) over a catalog's providers."""

    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        provider: Any = self._catalog.provider(spec.provider_action)
        result: ActionResult = await provider.perform(
            op, spec, timeout_s=timeout_s, callback_url=callback_url
        )
        return result

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        provider: Any = self._catalog.provider(spec.reconcile or spec.provider_action)
        finding: Finding = await provider.lookup(op, spec)
        return finding

    async def cancel(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float
    ) -> ActionResult:
        provider = self._catalog.provider(spec.provider_action)
        if not isinstance(provider, CancellingProvider):
            return ActionResult(Outcome.failed_final, error="the provider cannot cancel requests")
        return await provider.cancel(op, spec, timeout_s=timeout_s)


def merge(catalogs: Iterable[Catalog], *, name: str | None = None) -> Catalog:
    """One catalog from several (a plugin plus a tools file). Name clashes are left for
    `check_catalog` (tools) or refused here (providers)."""
    parts = list(catalogs)
    if len(parts) == 1:
        return parts[0]
    tools: list[ToolSpec] = []
    providers: dict[str, object] = {}
    problems: list[CatalogProblem] = []
    for part in parts:
        tools.extend(part.tools)
        for key, provider in part.providers.items():
            if key in providers and providers[key] is not provider:
                problems.append(
                    CatalogProblem(
                        None,
                        f"provider {key!r}",
                        f"two catalogs ({', '.join(p.name for p in parts)}) declare a provider "
                        f"named {key!r}",
                        "rename one of them",
                    )
                )
            providers[key] = provider
    if problems:
        raise CatalogError(problems, source="catalogs")
    instructions = "\n\n".join(p.instructions for p in parts if p.instructions) or None

    def locate(spec: ToolSpec | None, field_name: str | None) -> tuple[str, str | None] | None:
        for part in parts:
            if spec is None or any(t is spec for t in part.tools):
                where, label = part.locate(spec, field_name)
                if where:
                    return where, label
        return None

    return Catalog(
        tools,
        providers,
        name=name or "+".join(p.name for p in parts),
        instructions=instructions,
        locate=locate,
    )


# --- the check at start -----------------------------------------------------------------


def _fields(model: type[BaseModel]) -> Mapping[str, Any]:
    return model.model_fields


def check_catalog(catalog: Catalog) -> list[CatalogProblem]:
    """Every reason `catalog` cannot run safely, in declaration order."""
    problems: list[CatalogProblem] = []

    def problem(spec: ToolSpec | None, fld: str | None, message: str, fix: str) -> None:
        tool = spec.name if spec is not None else None
        where, label = catalog.locate(spec, fld)
        problems.append(CatalogProblem(tool, label, message, fix, where))

    for key in catalog.providers:
        if not PROVIDER_NAME.match(key):
            problem(
                None,
                f"provider {key!r}",
                "provider names are letters, digits, '_' and '-'",
                "rename the provider",
            )
    if not catalog.tools:
        problem(None, "tools", "the catalog offers no tools", "declare at least one tool")
    by_name: dict[str, ToolSpec] = {}
    for spec in catalog.tools:
        if spec.name in by_name:
            problem(spec, "name", "declared twice", "give each tool its own name")
        by_name.setdefault(spec.name, spec)
    for spec in catalog.tools:
        _check_tool(catalog, spec, by_name, problem)
    return problems


Report = Callable[[ToolSpec | None, str | None, str, str], None]


def _check_tool(
    catalog: Catalog, spec: ToolSpec, by_name: Mapping[str, ToolSpec], problem: Report
) -> None:
    if not TOOL_NAME.match(spec.name):
        problem(
            spec,
            "name",
            "a tool name is 1 to 64 letters, digits, '_' or '-' (the model calls it by name)",
            "rename the tool",
        )
    if spec.name in CONTROL_TOOL_NAMES:
        problem(
            spec,
            "name",
            f"{spec.name} is the engine's own control tool",
            "rename the tool; confirmation and PIN entry are built in "
            "(needs_confirmation / needs_verification)",
        )
    if spec.kind is ToolKind.CONTROL:
        problem(
            spec,
            "kind",
            "control tools belong to the engine, not to a catalog",
            "declare it as a read or a mutation",
        )
        return
    if not spec.description.strip():
        problem(
            spec,
            "description",
            "no description: the model decides when to call a tool from it",
            "say what it does, when to call it and when not to",
        )
    try:
        spec.definition()
    except Exception as exc:
        problem(spec, "args_model", f"its argument schema cannot be built ({exc})", "fix the model")
    if spec.deadline_s <= 0:
        problem(
            spec, "deadline_s", "the deadline must be positive", "give it a deadline in seconds"
        )
    _check_binding(catalog, spec, problem)
    if spec.kind is ToolKind.READ:
        _check_read(spec, problem)
    else:
        _check_mutation(catalog, spec, by_name, problem)
    if spec.reference_arg is not None and spec.reference_arg not in _fields(spec.args_model):
        problem(
            spec,
            "reference_arg",
            f"{spec.reference_arg!r} is not one of its arguments",
            "name the argument that carries the provider's reference",
        )


def _check_binding(catalog: Catalog, spec: ToolSpec, problem: Report) -> None:
    if spec.provider_action is None:
        problem(
            spec,
            "provider_action",
            f"a {spec.kind.value} needs a provider to run on",
            'bind it: provider_action="<provider>.<action>" naming a provider of the catalog',
        )
        return
    name, action = split_binding(spec.provider_action)
    if not action:
        problem(
            spec,
            "provider_action",
            f"{spec.provider_action!r} does not name a provider",
            'write it as "<provider>.<action>"',
        )
        return
    provider = catalog.providers.get(name)
    if provider is None:
        problem(
            spec,
            "provider_action",
            f"no provider named {name!r} (the catalog has: {_names(catalog.providers)})",
            "add that provider to the catalog or bind the tool to one it has",
        )
        return
    if spec.kind is ToolKind.READ and not isinstance(provider, ReadProvider):
        problem(
            spec,
            "provider_action",
            f"provider {name!r} has no read hook",
            "implement `async def read(spec, args)` on it, or bind the tool to one that does",
        )
    if spec.kind is ToolKind.MUTATION and not callable(getattr(provider, "perform", None)):
        problem(
            spec,
            "provider_action",
            f"provider {name!r} has no perform hook",
            "implement `async def perform(op, spec, *, timeout_s, callback_url=None)` on it",
        )


def _check_read(spec: ToolSpec, problem: Report) -> None:
    if spec.needs_confirmation:
        problem(
            spec,
            "needs_confirmation",
            "a read changes nothing, so there is nothing to confirm",
            "drop the confirmation, or declare the tool a mutation",
        )
    if spec.reconcile is not None or spec.on_unknown is OnUnknown.ASK_STAFF:
        problem(
            spec,
            "reconcile",
            "a read has no unknown outcome to reconcile (it answers inline or fails)",
            "drop reconcile / on_unknown",
        )


def _check_mutation(
    catalog: Catalog, spec: ToolSpec, by_name: Mapping[str, ToolSpec], problem: Report
) -> None:
    retry = spec.retry
    if retry.max_attempts < 1:
        problem(spec, "retry", "max_attempts must be at least 1", "set retry max_attempts >= 1")
    if retry.max_attempts > 1 and not spec.provider_idempotent:
        problem(
            spec,
            "retry",
            f"it retries automatically (max_attempts {retry.max_attempts}) but the provider is "
            "not idempotent, so a retry could do it twice",
            "mark it idempotent if the provider honours idempotency keys "
            "(provider_idempotent / `idempotent: true`), or set retry max_attempts to 1",
        )
    if retry.total_deadline_s < spec.deadline_s:
        problem(
            spec,
            "retry",
            f"the total deadline ({retry.total_deadline_s:g} s) is shorter than one attempt "
            f"({spec.deadline_s:g} s)",
            "raise retry total_deadline_s or lower deadline_s",
        )
    if retry.base_backoff_s < 0 or retry.max_backoff_s < retry.base_backoff_s:
        problem(
            spec,
            "retry",
            "backoff must be >= 0 and max_backoff_s >= base_backoff_s",
            "fix the backoff",
        )
    if not 0 <= retry.jitter <= 1:
        problem(spec, "retry", "jitter is a fraction between 0 and 1", "fix the jitter")
    if spec.needs_confirmation is None:
        problem(
            spec,
            "needs_confirmation",
            "a mutation must say whether it waits for the caller's yes",
            "declare `confirmation: required` (read back, run only on the caller's own yes) "
            "or `confirmation: none` (sent at once); in Python needs_confirmation=True/False",
        )
    if spec.needs_confirmation and spec.confirm_window_s <= 0:
        problem(
            spec,
            "confirm_window_s",
            "the confirmation window must be positive",
            "give the caller time to confirm",
        )
    _check_unknown(catalog, spec, problem)
    _check_compensation(spec, by_name, problem)
    _check_concurrency(spec, problem)
    if spec.cancellable_at_provider:
        try:
            provider = catalog.provider(spec.provider_action)
        except ToolError:
            provider = None
        if provider is not None and not isinstance(provider, CancellingProvider):
            problem(
                spec,
                "cancellable_at_provider",
                "it claims the provider can withdraw a request, but the provider has no "
                "cancel hook",
                "implement `async def cancel(op, spec, *, timeout_s)` on the provider, or drop "
                "cancellable_at_provider (a committed effect is undone by compensated_by)",
            )


def _check_unknown(catalog: Catalog, spec: ToolSpec, problem: Report) -> None:
    ask_staff = spec.on_unknown is OnUnknown.ASK_STAFF
    if spec.reconcile is None and not ask_staff:
        problem(
            spec,
            "reconcile",
            "nothing can resolve an unknown outcome (sent, answer lost): no lookup at the "
            "provider and no person to ask",
            'declare how to ask the provider (reconcile="<provider>.<strategy>" / a `lookup:` '
            "request by idempotency key or id), or on_unknown: ask_staff if it has no lookup",
        )
        return
    if spec.reconcile is not None and ask_staff:
        problem(
            spec,
            "on_unknown",
            "it declares both a lookup and on_unknown: ask_staff",
            "keep the lookup (a person is asked only when the provider cannot be)",
        )
        return
    if spec.reconcile is None:
        return
    name, strategy = split_binding(spec.reconcile)
    if not strategy:
        problem(
            spec,
            "reconcile",
            f"{spec.reconcile!r} does not name a provider",
            'write it as "<provider>.<strategy>"',
        )
        return
    provider = catalog.providers.get(name)
    if provider is None:
        problem(
            spec,
            "reconcile",
            f"no provider named {name!r} (the catalog has: {_names(catalog.providers)})",
            "name a provider of the catalog",
        )
    elif not callable(getattr(provider, "lookup", None)):
        problem(
            spec,
            "reconcile",
            f"provider {name!r} has no lookup hook",
            "implement `async def lookup(op, spec)` on it, or on_unknown: ask_staff",
        )


def _check_compensation(spec: ToolSpec, by_name: Mapping[str, ToolSpec], problem: Report) -> None:
    if spec.compensated_by is None:
        return
    comp = by_name.get(spec.compensated_by)
    if comp is None:
        problem(
            spec,
            "compensated_by",
            f"no tool named {spec.compensated_by!r}",
            "name a mutation of this catalog that undoes it, or drop compensated_by",
        )
        return
    if comp is spec or comp.name == spec.name:
        problem(spec, "compensated_by", "a tool cannot compensate itself", "name the undoing tool")
        return
    if comp.kind is not ToolKind.MUTATION:
        problem(
            spec,
            "compensated_by",
            f"{comp.name} is a {comp.kind.value}, and only a mutation can undo an effect",
            "name a mutation",
        )
        return
    if comp.reference_arg is None:
        problem(
            spec,
            "compensated_by",
            f"{comp.name} does not say which argument takes the reference it undoes",
            f"set reference_arg on {comp.name} (e.g. the booking id argument)",
        )
        return
    fields = _fields(comp.args_model)
    others = [n for n, f in fields.items() if n != comp.reference_arg and f.is_required()]
    if others:
        problem(
            spec,
            "compensated_by",
            f"{comp.name} needs more than the reference ({', '.join(others)})",
            f"make {comp.name} take only {comp.reference_arg}, or give the others defaults",
        )


def _check_concurrency(spec: ToolSpec, problem: Report) -> None:
    limit = spec.concurrency
    if limit is None:
        return
    if spec.resource is None:
        problem(
            spec,
            "concurrency",
            "a concurrency limit counts operations per resource, and none is declared",
            "declare the resource it counts against (e.g. one per day)",
        )
    if limit.max_in_flight < 1:
        problem(spec, "concurrency", "max_in_flight must be at least 1", "raise it")
    if limit.overflow is OverflowPolicy.QUEUE and limit.max_queued < 1:
        problem(
            spec,
            "concurrency",
            "overflow queue with max_queued 0 queues nothing",
            "set max_queued, or overflow reject",
        )


def _names(providers: Mapping[str, object]) -> str:
    return ", ".join(sorted(providers)) or "none"
