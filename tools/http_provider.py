"""A provider that calls a declared HTTP API (the tools file's `providers` and `request`s).

Every call is bounded by the tool's deadline. A mutation carries the operation's
idempotency key in the declared header, and its answer is read by the declared rules:
committed, pending, failed, retryable, else `unknown`. Transport errors follow the engine's
rule: no connection means nothing was sent (`failed_retryable`); anything after sending
without an answer is `unknown`, reconciled by the declared lookup, never resent blindly.
Headers (which may hold secrets from the environment) are never logged or stored.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote

import httpx
from pydantic import BaseModel

from tools.errors import InvalidArguments, ProviderError
from tools.ledger import OperationRecord
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import ToolSpec
from tools.results import bounded, compact, provider_key
from tools.templates import MISSING, render, render_json, resolve
from tools.tools_file_model import Call, Lookup, Match, Outcomes, Request, ResultDecl

log = logging.getLogger(__name__)

DEFAULT_OUTCOMES = Outcomes()
# A provider's answer larger than this is not read (it would not be speakable anyway).
MAX_BODY_BYTES = 256 * 1024
# Percent-decoding rounds looked through for a dot segment (a server may decode twice).
_DECODE_ROUNDS = 3


def path_value_problem(value: str) -> str | None:
    """Why `value` cannot fill a path segment, else None.

    Quoting keeps a value inside its segment, but `.` and `..` are segments of their own:
    URL normalization (the client's, a proxy's, the provider's) turns `/items/..` into `/`,
    so a value could reach another resource. Encoded forms (`%2e%2e`, also double-encoded)
    and an empty value are refused as well.
    """
    decoded = value
    for _ in range(_DECODE_ROUNDS + 1):
        if decoded.strip() in ("", ".", ".."):
            return "a value is empty" if not value.strip() else f"{value!r} is not a valid value"
        undone = unquote(decoded)
        if undone == decoded:
            return None
        decoded = undone
    return None


def path_segment(value: str) -> str:
    """`value` quoted as one path segment; `InvalidArguments` for a dot or empty segment."""
    problem = path_value_problem(value)
    if problem is not None:
        raise InvalidArguments(problem)
    return quote(value, safe="")


@dataclass(frozen=True, slots=True)
class HttpBinding:
    """How one tool calls its provider."""

    request: Request
    outcomes: Outcomes | None = None
    lookup: Lookup | None = None
    result: ResultDecl | None = None


def _parse(resp: httpx.Response) -> Any:
    if not resp.content or len(resp.content) > MAX_BODY_BYTES:
        return None
    try:
        return json.loads(resp.content)
    except (ValueError, RecursionError):
        return None


def matches(rule: Match | None, status: int, body: Any) -> bool:
    """Whether an answer (status, parsed body) fits a declared rule."""
    if rule is None:
        return False
    if rule.status is not None and status not in rule.status:
        return False
    if rule.field is not None:
        if not isinstance(body, Mapping):
            return False
        value = resolve(body, rule.field)
        return value is not MISSING and rule.equals is not None and value in rule.equals
    return True


def classify(outcomes: Outcomes, status: int, body: Any) -> Outcome:
    """A mutation's answer -> its outcome, by the declared rules in order; else unknown."""
    if matches(outcomes.committed, status, body):
        return Outcome.committed
    if matches(outcomes.pending, status, body):
        return Outcome.pending
    if matches(outcomes.failed, status, body):
        return Outcome.failed_final
    if matches(outcomes.retryable, status, body):
        return Outcome.failed_retryable
    return Outcome.unknown


def _record(body: Any, path: str | None) -> Any:
    if path is None:
        return body
    found = resolve(body, path) if isinstance(body, Mapping) else MISSING
    return None if found is MISSING else found


def _text_field(body: Any, path: str | None) -> str | None:
    if path is None or not isinstance(body, Mapping):
        return None
    found = resolve(body, path)
    if found is MISSING or found is None or isinstance(found, dict | list):
        return None
    return str(found)[:200]


def pick(record: Any, result: ResultDecl | None) -> dict[str, Any] | None:
    """What the ledger keeps of an answer: the declared fields, else a compact copy."""
    if not isinstance(record, Mapping):
        return {"items": record[:20]} if isinstance(record, list) else None
    if result is None or not result.fields:
        return compact(record)
    out: dict[str, Any] = {}
    for name in result.fields:
        value = resolve(record, name)
        if value is not MISSING:
            out[name] = value
    return out


def shape(result: ResultDecl | None, data: Mapping[str, Any]) -> dict[str, Any]:
    """A compact, speakable result: the declared fields, a sentence, every text capped."""
    if data.get("found") is False and len(data) == 1:
        text = (result.not_found_message if result else None) or "Nothing was found for that."
        return {"status": "not_found", "message": text}
    cap = result.max_chars if result else 200
    fields = result.fields if result and result.fields else list(data)
    out: dict[str, Any] = {"status": "ok"}
    for name in fields:
        value = resolve(data, name)
        if value is MISSING:
            continue
        key = name.rsplit(".", 1)[-1]
        key = provider_key(key)  # a provider's `status` is data, not the engine's word
        if isinstance(value, str):
            value = bounded(value, cap)
        elif isinstance(value, list):
            value = [bounded(str(v), cap) if isinstance(v, str) else v for v in value[:5]]
        elif isinstance(value, dict):
            value = bounded(json.dumps(value, default=str), cap)
        out[key] = value
    if result is not None and result.message:
        out["message"] = bounded(render(result.message, data), cap)
    # The length cap holds for the whole answer too: drop trailing fields until it fits.
    budget = 3 * cap
    keys = [k for k in out if k not in ("status", "message")]
    while keys and len(json.dumps(out, default=str)) > budget:
        out.pop(keys.pop())
    return out


class HttpProvider:
    """One declared HTTP API: `perform`, `lookup` and `read` for the tools bound to it."""

    def __init__(
        self,
        name: str,
        *,
        base_url: str,
        headers: Mapping[str, str],
        idempotency_header: str,
        callback_header: str | None = None,
        connect_timeout_s: float = 2.0,
        bindings: Mapping[str, HttpBinding] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.name = name
        self.idempotency_header = idempotency_header
        self.callback_header = callback_header
        self.connect_timeout_s = connect_timeout_s
        self.bindings: dict[str, HttpBinding] = dict(bindings or {})
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/"),
            headers=dict(headers),
            timeout=httpx.Timeout(10.0, connect=connect_timeout_s),
            transport=transport,
            follow_redirects=False,
        )

    def __repr__(self) -> str:  # never the headers: they may hold secrets
        return f"HttpProvider({self.name!r}, tools={sorted(self.bindings)})"

    async def aclose(self) -> None:
        await self._http.aclose()

    def _binding(self, spec: ToolSpec) -> HttpBinding:
        try:
            return self.bindings[spec.name]
        except KeyError:
            raise ProviderError(f"provider {self.name} has no request for {spec.name}") from None

    def _timeout(self, timeout_s: float) -> httpx.Timeout:
        return httpx.Timeout(timeout_s, connect=min(timeout_s, self.connect_timeout_s))

    async def _send(
        self,
        request: Call,
        values: Mapping[str, Any],
        timeout_s: float,
        extra_headers: Mapping[str, str] | None = None,
    ) -> httpx.Response:
        path = render(request.path, values, escape=path_segment)
        params = {k: render(v, values) for k, v in request.query.items()}
        headers = {k: render(v, values) for k, v in request.headers.items()}
        headers.update(extra_headers or {})
        body = render_json(request.body, values) if request.body is not None else None
        return await self._http.request(
            request.method,
            path,
            params=params or None,
            headers=headers,
            json=body,
            timeout=self._timeout(timeout_s),
        )

    @staticmethod
    def _values(op: OperationRecord) -> dict[str, Any]:
        return {
            "args": dict(op.args),
            "idempotency_key": op.idempotency_key,
            "operation_id": str(op.operation_id),
            "tenant_id": op.tenant_id,
            "caller": op.caller or "",
        }

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        binding = self._binding(spec)
        try:
            resp = await self._send(
                binding.request, {"args": args.model_dump(mode="json")}, spec.deadline_s
            )
        except httpx.TimeoutException as exc:
            raise ProviderError(f"{spec.name}: no answer in time", retryable=True) from exc
        except httpx.HTTPError as exc:
            raise ProviderError(f"{spec.name}: {type(exc).__name__}", retryable=True) from exc
        if resp.status_code == 404:
            return {"found": False}
        if not 200 <= resp.status_code < 300:
            retryable = resp.status_code >= 500 or resp.status_code == 429
            raise ProviderError(f"{spec.name} answered {resp.status_code}", retryable=retryable)
        body = _parse(resp)
        if isinstance(body, list):
            return {"items": body}
        if not isinstance(body, Mapping):
            raise ProviderError(f"{spec.name}: the answer is not a JSON object", retryable=True)
        return body

    async def perform(
        self,
        op: OperationRecord,
        spec: ToolSpec,
        *,
        timeout_s: float,
        callback_url: str | None = None,
    ) -> ActionResult:
        binding = self._binding(spec)
        outcomes = binding.outcomes or DEFAULT_OUTCOMES
        headers = {
            binding.request.idempotency_header or self.idempotency_header: op.idempotency_key
        }
        if callback_url and self.callback_header:
            headers[self.callback_header] = callback_url
        try:
            resp = await self._send(binding.request, self._values(op), timeout_s, headers)
        except InvalidArguments as exc:
            # Refused before anything was sent: provably not applied, and never will be.
            return ActionResult(Outcome.failed_final, error=f"invalid_argument: {exc}"[:200])
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            # No connection, so nothing was sent: provably not applied.
            return ActionResult(Outcome.failed_retryable, error=f"not sent: {type(exc).__name__}")
        except httpx.HTTPError as exc:
            # Sent (or partly) and no answer: the provider may well have applied it.
            return ActionResult(Outcome.unknown, error=f"no answer: {type(exc).__name__}")
        body = _parse(resp)
        outcome = classify(outcomes, resp.status_code, body)
        record = _record(body, outcomes.record)
        if outcome is Outcome.committed:
            return ActionResult(
                outcome,
                result=pick(record, binding.result),
                reference=_text_field(record, outcomes.reference),
            )
        error = _text_field(body, outcomes.error) or f"http_{resp.status_code}"
        return ActionResult(outcome, error=error)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        binding = self._binding(spec)
        lookup = binding.lookup
        if lookup is None:
            raise ProviderError(f"{spec.name} declares no lookup", retryable=False)
        try:
            resp = await self._send(lookup, self._values(op), spec.deadline_s)
        except InvalidArguments as exc:
            raise ProviderError(f"lookup for {spec.name}: {exc}", retryable=False) from exc
        except httpx.HTTPError as exc:
            raise ProviderError(
                f"lookup for {spec.name}: {type(exc).__name__}", retryable=True
            ) from exc
        body = _parse(resp)
        status = resp.status_code
        record = _record(body, lookup.record)
        if matches(lookup.applied, status, body):
            return Finding(
                "applied",
                result=pick(record, binding.result),
                reference=_text_field(record, lookup.reference),
            )
        if matches(lookup.rejected, status, body):
            return Finding("rejected", error=_text_field(body, lookup.error) or f"http_{status}")
        if matches(lookup.in_progress, status, body):
            return Finding("in_progress")
        if matches(lookup.not_found, status, body):
            return Finding("not_found")
        # An answer the declaration does not cover proves nothing: ask again later.
        raise ProviderError(f"lookup for {spec.name}: undeclared answer {status}", retryable=True)
