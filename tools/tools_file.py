"""Loading a tools file (`TOOLS_FILE`): YAML -> validated declarations -> a `Catalog`.

Every mistake is refused before the service starts, one line per problem, naming the file,
the line and the field: YAML syntax and duplicate keys, the file's schema
(`tools.tools_file_model`), argument schemas outside the supported subset, templates naming
arguments that do not exist, unknown providers, secrets written into the file instead of
`${ENV:NAME}`, unset environment variables, and then the engine's own catalog check
(`tools.catalog.check_catalog`: retries without idempotency, mutations nothing can
reconcile, dangling references...).
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from tools.agents import AgentSet, AgentsFileError, AgentsFileModel, check
from tools.arguments_schema import SchemaProblem, model_from_schema, property_types
from tools.catalog import Catalog, CatalogError, CatalogProblem
from tools.http_provider import HttpBinding, HttpProvider, path_value_problem, shape
from tools.registry import (
    ConcurrencyLimit,
    OnUnknown,
    OverflowPolicy,
    PreconditionContext,
    RetryPolicy,
    ToolKind,
    ToolSpec,
)
from tools.templates import TemplateError, json_names, names, render
from tools.tools_file_model import Call, LimitDecl, ProviderDecl, ToolDecl, ToolsFile
from tools.transfers import TransferTarget, TransferTargetError, declared_target
from tools.yaml_source import Located, YamlProblem, dotted, load

_ENV = re.compile(r"\$\{ENV:([A-Za-z_][A-Za-z0-9_]*)\}")
_SECRET_HEADER = re.compile(r"auth|token|secret|key|password|cookie|signature", re.IGNORECASE)
_HEADER_NAME = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")
_MUTATION_VALUES = ("idempotency_key", "operation_id", "tenant_id", "caller")

# ToolSpec fields (as the catalog check names them) -> the tools file's keys.
_FILE_KEYS = {
    "name": "name",
    "description": "description",
    "kind": "kind",
    "args_model": "arguments",
    "provider_action": "request",
    "provider_idempotent": "idempotent",
    "needs_confirmation": "confirmation",
    "confirm_window_s": "confirm_window_s",
    "needs_verification": "verification",
    "deadline_s": "deadline_s",
    "retry": "retry",
    "reconcile": "lookup",
    "on_unknown": "on_unknown",
    "compensated_by": "compensated_by",
    "reference_arg": "reference_arg",
    "concurrency": "concurrency",
}

_FIXES = {
    "missing": "add it",
    "extra_forbidden": "remove it or correct its spelling (`voice-agent tools schema` lists "
    "every field)",
    "literal_error": "use one of the values listed",
    "string_type": "write it as text (quote it: YAML reads 09:30 as a number)",
}


def load_tools_file(path: str | Path, *, environ: Mapping[str, str]) -> Catalog:
    """The catalog a tools file declares, checked; `CatalogError` naming every mistake."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise CatalogError(
            [CatalogProblem(None, None, f"cannot read it ({reason})", "check TOOLS_FILE", source)],
            source=source,
        ) from None
    return load_tools_text(text, source=source, environ=environ)


def load_tools_text(text: str, *, source: str, environ: Mapping[str, str]) -> Catalog:
    """`load_tools_file` for text already read (`source` names it in messages)."""
    try:
        located = load(text)
    except YamlProblem as exc:
        where = f"{source}:{exc.line}" if exc.line else source
        raise CatalogError(
            [CatalogProblem(None, None, str(exc), "correct the YAML", where)], source=source
        ) from None
    if not isinstance(located.data, Mapping):
        raise CatalogError(
            [
                CatalogProblem(
                    None,
                    None,
                    "a tools file is a mapping with `providers` and `tools`",
                    "start from the example in the README",
                    f"{source}:1",
                )
            ],
            source=source,
        )
    try:
        decl = ToolsFile.model_validate(located.data)
    except ValidationError as exc:
        raise CatalogError(_schema_problems(exc, located, source), source=source) from None
    builder = _Builder(decl, located, source, environ)
    catalog = builder.build()
    problems = catalog.check()
    if problems:
        raise CatalogError(problems, source=source)
    if decl.agents is not None:
        catalog.agents = _agents(decl, located, source, catalog)
    if decl.transfers is not None:
        catalog.transfers = _transfers(decl, located, source)
    return catalog


def _transfers(decl: ToolsFile, located: Located, source: str) -> dict[str, TransferTarget]:
    """The transfer targets the tools file declares (their fields were checked by the model)."""
    targets: dict[str, TransferTarget] = {}
    for name, target in (decl.transfers or {}).items():
        try:
            targets[name] = declared_target(
                name, target.to, target.hours, target.timezone, target.who
            )
        except TransferTargetError as exc:
            line = located.line(("transfers", name))
            where = f"{source}:{line}" if line else source
            problem = CatalogProblem(None, f"transfers.{name}", str(exc), "rename it", where)
            raise CatalogError([problem], source=source) from None
    return targets


def _agents(decl: ToolsFile, located: Located, source: str, catalog: Catalog) -> AgentSet:
    """The agents the tools file declares, checked against its own tools."""
    agents_decl = AgentsFileModel(agents=tuple(decl.agents or ()), start=decl.start_agent)
    try:
        return check(
            agents_decl,
            located,
            set(catalog.registry.names()),
            source,
            label="TOOLS_FILE",
            start_key="start_agent",
        )
    except AgentsFileError as exc:
        problem = CatalogProblem(None, exc.field or None, exc.problem, exc.fix, exc.at)
        raise CatalogError([problem], source=source) from None


def _schema_problems(exc: ValidationError, located: Located, source: str) -> list[CatalogProblem]:
    out = []
    for err in exc.errors():
        loc = err.get("loc", ())
        line = located.line(loc)
        where = f"{source}:{line}" if line else source
        known = located.dotted(loc)
        # The field the error is about, as the file spells it (a missing one is not in it).
        tail = [str(p) for p in loc if isinstance(p, str)]
        label = known
        kind = err.get("type", "")
        if kind == "missing" and tail:
            label = f"{known}.{tail[-1]}" if known else tail[-1]
        msg = str(err.get("msg", "invalid")).removeprefix("Value error, ")
        out.append(
            CatalogProblem(
                _tool_name(located, loc),
                label or None,
                msg,
                _FIXES.get(kind, "see `voice-agent tools schema` for what fits here"),
                where,
            )
        )
    return out


def _tool_name(located: Located, loc: tuple[Any, ...] | list[Any]) -> str | None:
    if len(loc) >= 2 and loc[0] == "tools" and isinstance(loc[1], int):
        tools = located.data.get("tools") if isinstance(located.data, Mapping) else None
        if isinstance(tools, list) and loc[1] < len(tools) and isinstance(tools[loc[1]], Mapping):
            name = tools[loc[1]].get("name")
            return str(name) if name is not None else None
    return None


@dataclass
class _Problems:
    source: str
    located: Located
    items: list[CatalogProblem] = field(default_factory=list)

    def add(self, path: tuple[str | int, ...], tool: str | None, message: str, fix: str) -> None:
        line = self.located.line(path)
        where = f"{self.source}:{line}" if line else self.source
        self.items.append(CatalogProblem(tool, dotted(path) or None, message, fix, where))


@dataclass(frozen=True, slots=True)
class _Provider:
    decl: ProviderDecl
    base_url: str
    headers: dict[str, str]


class _Builder:
    """Turns validated declarations into ToolSpecs and HttpProviders, collecting problems."""

    def __init__(
        self, decl: ToolsFile, located: Located, source: str, environ: Mapping[str, str]
    ) -> None:
        self.decl = decl
        self.located = located
        self.source = source
        self.environ = environ
        self.problems = _Problems(source, located)
        self.specs: list[ToolSpec] = []
        self.index: dict[int, int] = {}  # id(spec) -> position in the file

    def build(self) -> Catalog:
        providers = {name: self._provider(name, p) for name, p in self.decl.providers.items()}
        bindings: dict[str, dict[str, HttpBinding]] = {name: {} for name in providers}
        self._no_env_outside_providers()
        seen: dict[str, int] = {}
        for i, tool in enumerate(self.decl.tools):
            if tool.name in seen:
                first = self.located.line(("tools", seen[tool.name]))
                self.problems.add(
                    ("tools", i, "name"),
                    tool.name,
                    f"declared twice (first at line {first})",
                    "give each tool its own name",
                )
                continue
            seen[tool.name] = i
            built = self._tool(i, tool, providers)
            if built is None:
                continue
            spec, provider, lookup_provider = built
            binding = HttpBinding(
                request=tool.request,
                outcomes=tool.outcome if tool.kind == "mutation" else None,
                lookup=tool.lookup,
                result=tool.result,
            )
            bindings[provider][tool.name] = binding
            if lookup_provider is not None:
                bindings[lookup_provider][tool.name] = binding
            self.index[id(spec)] = i
            self.specs.append(spec)
        if self.problems.items:
            raise CatalogError(self.problems.items, source=self.source)
        http = {
            name: HttpProvider(
                name,
                base_url=p.base_url,
                headers=p.headers,
                idempotency_header=p.decl.idempotency_header,
                callback_header=p.decl.callback_header,
                connect_timeout_s=p.decl.connect_timeout_s,
                bindings=bindings[name],
            )
            for name, p in providers.items()
            if p is not None
        }
        return Catalog(
            self.specs,
            http,
            name=self.decl.name or Path(self.source).stem,
            instructions=self.decl.instructions,
            locate=self._locate,
        )

    def _locate(self, spec: ToolSpec | None, fld: str | None) -> tuple[str, str | None] | None:
        if spec is None or id(spec) not in self.index:
            return None
        i = self.index[id(spec)]
        key = _FILE_KEYS.get(fld or "")
        if fld == "reconcile" and "lookup" not in self.located.data["tools"][i]:
            key = "on_unknown"
        path: tuple[str | int, ...] = ("tools", i, key) if key else ("tools", i)
        if path not in self.located.lines:
            path = ("tools", i)
        line = self.located.lines.get(path)
        return f"{self.source}:{line}", dotted(path)

    # --- providers -------------------------------------------------------------------

    def _env(self, value: str, path: tuple[str | int, ...]) -> str | None:
        """`value` with ${ENV:NAME} filled from the environment (None: a problem recorded)."""
        missing = [n for n in _ENV.findall(value) if n not in self.environ]
        for name in missing:
            self.problems.add(
                path,
                None,
                f"environment variable {name} is not set",
                f"set {name} in the service's environment",
            )
        rest = _ENV.sub("", value)
        if "${" in rest:
            self.problems.add(
                path, None, "only ${ENV:NAME} may be substituted here", "write ${ENV:NAME}"
            )
            return None
        if missing:
            return None
        return _ENV.sub(lambda m: self.environ[m.group(1)], value)

    def _provider(self, name: str, decl: ProviderDecl) -> _Provider | None:
        here: tuple[str | int, ...] = ("providers", name)
        ok = True
        if not re.match(r"^[A-Za-z0-9_-]{1,64}$", name):
            self.problems.add(
                here, None, f"provider name {name!r}: letters, digits, '_' and '-'", "rename it"
            )
            ok = False
        base = self._env(decl.base_url, (*here, "base_url"))
        if base is not None and not re.match(r"^https?://[^/\s]+", base):
            self.problems.add(
                (*here, "base_url"),
                None,
                "base_url must be an http:// or https:// URL",
                "write the API's base URL",
            )
            ok = False
        headers: dict[str, str] = {}
        for hname, hvalue in decl.headers.items():
            hpath = (*here, "headers", hname)
            if not _HEADER_NAME.match(hname):
                self.problems.add(hpath, None, f"{hname!r} is not a header name", "rename it")
                ok = False
                continue
            if _SECRET_HEADER.search(hname) and not _ENV.search(hvalue):
                self.problems.add(
                    hpath,
                    None,
                    f"header {hname} looks like a secret written into the file",
                    f"put the secret in an environment variable: {hname}: ${{ENV:NAME}}",
                )
                ok = False
                continue
            filled = self._env(hvalue, hpath)
            if filled is None:
                ok = False
                continue
            if "\r" in filled or "\n" in filled:
                self.problems.add(hpath, None, "a header value holds a line break", "remove it")
                ok = False
                continue
            headers[hname] = filled
        for hkey in ("idempotency_header", "callback_header"):
            value = getattr(decl, hkey)
            if value is not None and not _HEADER_NAME.match(value):
                self.problems.add((*here, hkey), None, f"{value!r} is not a header name", "fix it")
                ok = False
        if not ok or base is None:
            return None
        return _Provider(decl, base, headers)

    def _no_env_outside_providers(self) -> None:
        tools = self.located.data.get("tools")
        for path, value in _strings(tools, ("tools",)):
            if "${" in value:
                self.problems.add(
                    path,
                    None,
                    "environment values (${...}) belong on a provider (base_url, headers)",
                    "move the value to the provider's headers, or use a {args.x} placeholder",
                )

    # --- tools -----------------------------------------------------------------------

    def _tool(
        self, i: int, tool: ToolDecl, providers: Mapping[str, _Provider | None]
    ) -> tuple[ToolSpec, str, str | None] | None:
        here: tuple[str | int, ...] = ("tools", i)
        problems_before = len(self.problems.items)
        add = self.problems.add
        name = tool.name
        mutation = tool.kind == "mutation"
        try:
            args_model = model_from_schema(name, tool.arguments)
        except SchemaProblem as exc:
            add((*here, "arguments", *exc.path), name, exc.message, "keep to the supported subset")
            args_model = None
        types = property_types(tool.arguments) if args_model is not None else {}
        provider = self._provider_of(i, tool.request, providers, ("request",))
        lookup_provider = None
        if tool.lookup is not None:
            lookup_provider = self._provider_of(i, tool.lookup, providers, ("lookup",))
        if not mutation:
            for key in ("outcome", "lookup", "on_unknown", "retry"):
                if getattr(tool, key) is not None:
                    add(
                        (*here, key),
                        name,
                        f"a read has no {key}: it is answered inline, once, or fails",
                        f"remove {key}, or make the tool a mutation",
                    )
        allowed = {"args"} | ({*_MUTATION_VALUES} if mutation else set())
        self._call_templates(i, tool.request, "request", types, allowed)
        if tool.lookup is not None:
            self._call_templates(i, tool.lookup, "lookup", types, allowed)
        if tool.describe is not None:
            self._templates((*here, "describe"), name, [tool.describe], types, {"args"})
        if tool.concurrency is not None:
            self._templates(
                (*here, "concurrency", "resource"),
                name,
                [tool.concurrency.resource],
                types,
                {"args"},
            )
        if tool.result is not None and tool.result.message is not None:
            try:
                used = names(tool.result.message)
            except TemplateError as exc:
                add((*here, "result", "message"), name, str(exc), "fix the placeholder")
                used = []
            for placeholder in used:
                if placeholder not in tool.result.fields:
                    add(
                        (*here, "result", "message"),
                        name,
                        f"{{{placeholder}}} is not one of result.fields",
                        "add it to result.fields (only declared fields reach the model)",
                    )
        preconditions = tuple(
            self._limit(i, j, tool, limit, types) for j, limit in enumerate(tool.limits)
        )
        path_args = _path_arguments(tool)
        if path_args:
            preconditions = (*preconditions, _path_check(path_args))
        if len(self.problems.items) > problems_before or args_model is None or provider is None:
            return None
        spec = ToolSpec(
            name=name,
            description=tool.description,
            args_model=args_model,
            kind=ToolKind.MUTATION if mutation else ToolKind.READ,
            provider_action=f"{provider}.{name}",
            provider_idempotent=tool.idempotent,
            needs_confirmation=_confirmation(tool.confirmation),
            needs_verification=tool.verification,
            needs_caller_id=tool.caller_id,
            preconditions=tuple(p for p in preconditions if p is not None),
            deadline_s=tool.deadline_s,
            retry=RetryPolicy(**tool.retry.model_dump()) if tool.retry else RetryPolicy(),
            reconcile=f"{lookup_provider}.lookup" if lookup_provider else None,
            on_unknown=OnUnknown(tool.on_unknown or "reconcile"),
            compensated_by=tool.compensated_by,
            reference_arg=tool.reference_arg,
            concurrency=(
                ConcurrencyLimit(
                    tool.concurrency.max_in_flight,
                    OverflowPolicy(tool.concurrency.overflow),
                    tool.concurrency.max_queued,
                )
                if tool.concurrency
                else None
            ),
            resource=_args_template(tool.concurrency.resource) if tool.concurrency else None,
            describe=_args_template(tool.describe) if tool.describe else None,
            shape_result=_shaper(tool),
            confirm_window_s=tool.confirm_window_s,
            provider_label=(
                tool.label
                or self.decl.label
                or self.decl.providers[provider].label
                or "the system of record"
            ),
            origin=f"{self.source}:{self.located.line(here)}",
        )
        return spec, provider, lookup_provider

    def _provider_of(
        self,
        i: int,
        call: Call,
        providers: Mapping[str, _Provider | None],
        key: tuple[str, ...],
    ) -> str | None:
        here: tuple[str | int, ...] = ("tools", i, *key)
        tool = self.decl.tools[i].name
        if call.provider is None:
            if len(providers) == 1:
                return next(iter(providers))
            self.problems.add(
                here,
                tool,
                "several providers are declared and this request names none",
                f"add provider: one of {', '.join(sorted(providers))}",
            )
            return None
        if call.provider not in providers:
            self.problems.add(
                (*here, "provider"),
                tool,
                f"no provider named {call.provider!r}",
                f"use one of {', '.join(sorted(providers))}, or declare it under providers",
            )
            return None
        return call.provider if providers[call.provider] is not None else None

    def _call_templates(
        self,
        i: int,
        call: Call,
        key: str,
        types: Mapping[str, tuple[str, str | None]],
        allowed: set[str],
    ) -> None:
        here: tuple[str | int, ...] = ("tools", i, key)
        tool = self.decl.tools[i].name
        if not call.path.startswith("/"):
            self.problems.add(
                (*here, "path"), tool, "the path must start with /", "write /the/path"
            )
        self._templates((*here, "path"), tool, [call.path], types, allowed, whole=False)
        for qk, qv in call.query.items():
            self._templates((*here, "query", qk), tool, [qv], types, allowed, whole=False)
        for hk, hv in call.headers.items():
            if not _HEADER_NAME.match(hk):
                self.problems.add(
                    (*here, "headers", hk), tool, f"{hk!r} is not a header name", "fix it"
                )
            self._templates((*here, "headers", hk), tool, [hv], types, allowed, whole=False)
        if call.body is not None:
            try:
                used = json_names(call.body)
            except TemplateError as exc:
                self.problems.add((*here, "body"), tool, str(exc), "fix the placeholder")
                return
            self._check_names((*here, "body"), tool, used, types, allowed, whole=True)

    def _templates(
        self,
        path: tuple[str | int, ...],
        tool: str,
        templates: list[str],
        types: Mapping[str, tuple[str, str | None]],
        allowed: set[str],
        *,
        whole: bool = False,
    ) -> None:
        for template in templates:
            try:
                used = names(template)
            except TemplateError as exc:
                self.problems.add(path, tool, str(exc), "fix the placeholder")
                continue
            self._check_names(path, tool, used, types, allowed, whole=whole)

    def _check_names(
        self,
        path: tuple[str | int, ...],
        tool: str,
        used: list[str],
        types: Mapping[str, tuple[str, str | None]],
        allowed: set[str],
        *,
        whole: bool,
    ) -> None:
        for placeholder in used:
            root, _, rest = placeholder.partition(".")
            if root == "args" and rest:
                if rest not in types:
                    self.problems.add(
                        path,
                        tool,
                        f"{{{placeholder}}} names no argument "
                        f"(arguments: {', '.join(sorted(types)) or 'none'})",
                        "use one of the tool's arguments",
                    )
                continue
            if root == "args" and not whole:
                self.problems.add(
                    path, tool, "{args} (every argument) only fits a body", "name one: {args.x}"
                )
                continue
            if placeholder not in allowed:
                self.problems.add(
                    path,
                    tool,
                    f"unknown placeholder {{{placeholder}}}",
                    "use {args.<name>}"
                    + (
                        ", {idempotency_key}, {operation_id}, {tenant_id} or {caller}"
                        if "idempotency_key" in allowed
                        else " (a read knows only its arguments)"
                    ),
                )

    def _limit(
        self,
        i: int,
        j: int,
        tool: ToolDecl,
        limit: LimitDecl,
        types: Mapping[str, tuple[str, str | None]],
    ) -> Any:
        here: tuple[str | int, ...] = ("tools", i, "limits", j)
        if limit.argument not in types:
            self.problems.add(
                (*here, "argument"),
                tool.name,
                f"{limit.argument!r} is not one of its arguments",
                "name one of the tool's arguments",
            )
            return None
        kind, fmt = types[limit.argument]
        if (limit.max is not None or limit.min is not None) and kind not in ("integer", "number"):
            self.problems.add(
                here,
                tool.name,
                f"max/min limit a number, and {limit.argument} is a {kind}",
                "fix it",
            )
            return None
        if limit.within_days is not None and fmt not in ("date", "date-time"):
            self.problems.add(
                here,
                tool.name,
                f"within_days limits a date, and {limit.argument} is not one",
                "fix it",
            )
            return None
        if limit.between is not None:
            if fmt != "time":
                self.problems.add(
                    here,
                    tool.name,
                    f"between limits a time, and {limit.argument} is not one",
                    "fix it",
                )
                return None
            try:
                start, end = (dt.time.fromisoformat(t) for t in limit.between)
            except ValueError:
                self.problems.add(
                    (*here, "between"),
                    tool.name,
                    "between takes two HH:MM times",
                    'write ["09:00", "17:00"]',
                )
                return None
            if start > end:
                self.problems.add(
                    (*here, "between"), tool.name, "the range ends before it starts", "swap them"
                )
                return None
        return _limit_check(limit)


def _strings(node: Any, path: tuple[str | int, ...]) -> Iterator[tuple[tuple[str | int, ...], str]]:
    if isinstance(node, str):
        yield path, node
    elif isinstance(node, Mapping):
        for k, v in node.items():
            yield from _strings(v, (*path, k))
    elif isinstance(node, list):
        for n, v in enumerate(node):
            yield from _strings(v, (*path, n))


def _args_template(template: str) -> Any:
    def fill(args: BaseModel) -> str:
        return render(template, {"args": args.model_dump(mode="json")})

    return fill


def _shaper(tool: ToolDecl) -> Any:
    result = tool.result

    def shaped(data: Mapping[str, Any]) -> dict[str, Any]:
        return shape(result, data)

    return shaped


def _confirmation(declared: str | bool | None) -> bool | None:
    """`confirmation:` as the engine reads it (None: not declared, which a mutation must)."""
    if declared is None or isinstance(declared, bool):
        return declared
    return declared == "required"


def _path_arguments(tool: ToolDecl) -> tuple[str, ...]:
    """The arguments that fill a path segment of the tool's request or lookup."""
    found: list[str] = []
    for call in (tool.request, tool.lookup):
        if call is None:
            continue
        try:
            used = names(call.path)
        except TemplateError:
            continue  # reported where the templates are checked
        found += [n.removeprefix("args.") for n in used if n.startswith("args.")]
    return tuple(dict.fromkeys(found))


def _path_check(arguments: tuple[str, ...]) -> Any:
    """Refuse, before anything is sent, a path value of `.`, `..` (or encoded) or empty:
    normalization would turn `/appointments/..` into another resource."""

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        for arg in arguments:
            value = getattr(args, arg, None)
            if value is not None and path_value_problem(str(value)) is not None:
                return f"That {arg.replace('_', ' ')} isn't valid. Ask the caller for it again."
        return None

    return check


def _limit_check(limit: LimitDecl) -> Any:
    arg = limit.argument
    words = arg.replace("_", " ")

    def check(args: BaseModel, ctx: PreconditionContext) -> str | None:
        value = getattr(args, arg, None)
        if value is None:
            return None
        if limit.max is not None and value > limit.max:
            return limit.message or f"The {words} can be at most {limit.max:g}."
        if limit.min is not None and value < limit.min:
            return limit.message or f"The {words} must be at least {limit.min:g}."
        if limit.within_days is not None:
            day = value.date() if isinstance(value, dt.datetime) else value
            today = ctx.now.astimezone(ctx.tz).date()
            if day < today:
                return limit.message or "That date has already passed. Which day would suit?"
            if day > today + dt.timedelta(days=limit.within_days):
                return limit.message or f"I can only do that up to {limit.within_days} days ahead."
        if limit.between is not None:
            start, end = (dt.time.fromisoformat(t) for t in limit.between)
            if not start <= dt.time.fromisoformat(str(value)) <= end:
                return (
                    limit.message
                    or f"That has to be between {limit.between[0]} and {limit.between[1]}."
                )
        return None

    return check
