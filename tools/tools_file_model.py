"""The tools file (`TOOLS_FILE`): HTTP tools declared without Python, as pydantic models.

This is the file's schema: `tools_file_schema()` is the JSON schema editors validate against
(`voice-agent tools schema`; a copy is checked in as `tools/tools-file.schema.json`).
`tools.tools_file` reads a YAML file into these models and builds the catalog from them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from tools.agents import AgentDecl

Scalar = str | int | float | bool

SCHEMA_ID = "https://voice-agent.invalid/tools-file.schema.json"


class _Decl(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Match(_Decl):
    """When an answer counts as this outcome: its HTTP status, and/or a field of its body."""

    status: list[int] | None = Field(
        default=None, description="HTTP status codes that match, e.g. [200, 201]."
    )
    field: str | None = Field(
        default=None,
        description="Dotted path of a JSON body field whose value decides, e.g. `state`.",
    )
    equals: list[Scalar] | None = Field(
        default=None, description="Values of `field` that match, e.g. [booked, confirmed]."
    )

    @model_validator(mode="after")
    def _coherent(self) -> Match:
        if self.status is None and self.field is None:
            raise ValueError("say which answers match: `status`, or `field` with `equals`")
        if (self.field is None) != (self.equals is None):
            raise ValueError("`field` and `equals` go together")
        for code in self.status or []:
            if not 100 <= code <= 599:
                raise ValueError(f"{code} is not an HTTP status code")
        return self


class Outcomes(_Decl):
    """How a mutation's answer is read. Checked in this order; anything else is `unknown`
    (sent, and we cannot tell: reconciled by the lookup, never blindly resent)."""

    committed: Match = Field(
        default=Match(status=[200, 201]), description="It was done. Default: 200, 201."
    )
    pending: Match | None = Field(
        default=Match(status=[202]),
        description="Accepted; the provider reports the outcome later to the callback URL.",
    )
    failed: Match | None = Field(
        default=Match(status=[400, 404, 409, 422]),
        description="Refused for good; nothing was done. Default: 400, 404, 409, 422.",
    )
    retryable: Match | None = Field(
        default=Match(status=[429]),
        description="Provably not applied; may be sent again (only if idempotent). Default: 429.",
    )
    record: str | None = Field(
        default=None,
        description="Dotted path of the record inside the answer (default: the whole body).",
    )
    reference: str | None = Field(
        default=None,
        description="Field of the record holding the provider's reference, e.g. `id`.",
    )
    error: str | None = Field(
        default=None, description="Field of the body holding the provider's error code."
    )


class Call(_Decl):
    """One HTTP request: the provider's base URL plus a path template."""

    provider: str | None = Field(
        default=None, description="Provider to call (may be left out when there is one)."
    )
    method: Literal["GET", "POST", "PUT", "PATCH", "DELETE"] = "GET"
    path: str = Field(
        description="Path template after the provider's base_url, e.g. /appointments/{args.id}."
    )
    query: dict[str, str] = Field(default_factory=dict, description="Query parameter templates.")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Extra header templates (no secrets here: put those on the provider).",
    )
    body: Any = Field(
        default=None,
        description=(
            "JSON body template. A string that is one placeholder keeps its type "
            '("{args.party_size}" -> 4); "{args}" is every argument.'
        ),
    )


class Request(Call):
    """How the tool calls its provider."""

    idempotency_header: str | None = Field(
        default=None,
        description="Header carrying the idempotency key (default: the provider's).",
    )


class Lookup(Call):
    """How to ask the provider what became of a request whose answer was lost: by the
    idempotency key (`{idempotency_key}`) or by a domain id (`{args.x}`, `{operation_id}`)."""

    applied: Match = Field(description="It happened.")
    not_found: Match = Field(description="It never happened and is not in flight.")
    rejected: Match | None = Field(default=None, description="It was refused for good.")
    in_progress: Match | None = Field(default=None, description="It may still happen.")
    record: str | None = Field(default=None, description="Dotted path of the record.")
    reference: str | None = Field(default=None, description="Field of the record: reference.")
    error: str | None = Field(default=None, description="Field of the body: error code.")


class ProviderDecl(_Decl):
    """A system of record reached over HTTP."""

    base_url: str = Field(description="e.g. https://api.example.com/v1 or ${ENV:CLINIC_API_URL}.")
    headers: dict[str, str] = Field(
        default_factory=dict,
        description="Headers on every request; secrets only as ${ENV:NAME}.",
    )
    idempotency_header: str = Field(
        default="Idempotency-Key", description="Header carrying a mutation's idempotency key."
    )
    callback_header: str | None = Field(
        default=None,
        description="Header telling the provider where to POST its outcome report, if it does.",
    )
    connect_timeout_s: float = Field(default=2.0, gt=0, le=30)
    label: str | None = Field(
        default=None,
        description='Who confirms outcomes, as the caller hears it ("the clinic").',
    )


class RetryDecl(_Decl):
    """Automatic retries of a provably-not-applied attempt (idempotent providers only)."""

    max_attempts: int = Field(default=1, ge=1, le=20)
    base_backoff_s: float = Field(default=0.5, ge=0)
    max_backoff_s: float = Field(default=10.0, ge=0)
    jitter: float = Field(default=0.5, ge=0, le=1)
    total_deadline_s: float = Field(default=120.0, gt=0)


class LimitDecl(_Decl):
    """A policy limit on one argument (schema-valid is not allowed: policy decides)."""

    argument: str
    max: float | None = Field(default=None, description="At most this (a number argument).")
    min: float | None = Field(default=None, description="At least this (a number argument).")
    within_days: int | None = Field(
        default=None, ge=0, description="A date argument: today up to this many days ahead."
    )
    between: tuple[str, str] | None = Field(
        default=None, description='A time argument: within ["HH:MM", "HH:MM"] (quote them).'
    )
    message: str | None = Field(default=None, description="What the caller hears when refused.")

    @model_validator(mode="after")
    def _one_kind(self) -> LimitDecl:
        kinds = [
            k for k in ("max", "min", "within_days", "between") if getattr(self, k) is not None
        ]
        if not kinds:
            raise ValueError("say what the limit is: max, min, within_days or between")
        if len(kinds) > 1 and set(kinds) != {"max", "min"}:
            raise ValueError(f"one kind of limit per entry ({', '.join(kinds)} given)")
        return self


class ConcurrencyDecl(_Decl):
    """Operations in flight per resource, and what happens beyond that."""

    max_in_flight: int = Field(ge=1)
    overflow: Literal["reject", "queue", "degrade"] = "reject"
    max_queued: int = Field(default=0, ge=0)
    resource: str = Field(description='Template naming the resource, e.g. "slots:{args.date}".')


class ResultDecl(_Decl):
    """What the model hears of an answer: a few fields, a sentence, a length cap."""

    fields: list[str] = Field(
        default_factory=list, description="Dotted fields picked from the answer's record."
    )
    message: str | None = Field(
        default=None, description='Sentence over the picked fields, e.g. "Free at {times}."'
    )
    max_chars: int = Field(default=200, ge=20, le=1000, description="Cap on every text.")
    not_found_message: str | None = Field(
        default=None, description="Reads: what the model hears when the answer is 404."
    )


class ToolDecl(_Decl):
    """One tool: what the model sees, how policy treats it, and how to call it."""

    name: str = Field(description="What the model calls (letters, digits, _ and -).")
    description: str = Field(
        min_length=1, description="What it does, when to call it, and when not to."
    )
    kind: Literal["read", "mutation"]
    arguments: dict[str, Any] = Field(
        default_factory=lambda: {"type": "object", "properties": {}},
        description="JSON schema (subset) of the arguments, as the model sees it.",
    )
    confirmation: Literal["required", "none"] | bool | None = Field(
        default=None,
        description=(
            "Mutations must say: `required` (read back, run only on the caller's own yes) or "
            "`none` (sent at once, named at start-up). true/false are the older spelling."
        ),
    )
    confirm_window_s: float = Field(default=120.0, gt=0)
    verification: bool = Field(default=False, description="Needs a PIN (or proof of ownership).")
    caller_id: bool = Field(default=False, description="Refuse withheld numbers.")
    limits: list[LimitDecl] = Field(default_factory=list)
    deadline_s: float = Field(
        default=5.0, gt=0, le=300, description="One attempt; a read's inline answer."
    )
    retry: RetryDecl | None = None
    idempotent: bool = Field(
        default=False,
        description="The provider honours the idempotency key (a resend cannot double it).",
    )
    request: Request
    outcome: Outcomes | None = Field(default=None, description="Mutations: reading the answer.")
    lookup: Lookup | None = Field(
        default=None, description="Mutations: how an unknown outcome is reconciled."
    )
    on_unknown: Literal["reconcile", "ask_staff"] | None = Field(
        default=None,
        description="ask_staff: no lookup exists, a person settles an unknown outcome.",
    )
    compensated_by: str | None = Field(default=None, description="The tool that undoes it.")
    reference_arg: str | None = Field(
        default=None, description="The argument carrying the reference this tool acts on."
    )
    describe: str | None = Field(
        default=None,
        description='Readback phrase, e.g. "a check-up on {args.date} at {args.time}".',
    )
    result: ResultDecl | None = None
    concurrency: ConcurrencyDecl | None = None
    label: str | None = Field(default=None, description="Who confirms (default: the provider's).")


class TransferDecl(_Decl):
    """A person the agent may transfer a caller to (`transfer_call`)."""

    to: str = Field(description="An E.164 number (+15550100009) or a sip: URI.")
    hours: str | None = Field(
        default=None,
        description="When it takes calls, in `timezone`: `mon-fri 09:00-17:00; sat 10:00-14:00` "
        "(default: always).",
    )
    timezone: str = Field(default="UTC", description="IANA time zone of `hours`.")
    who: Literal["anyone", "verified"] = Field(
        default="anyone",
        description="Who may be put through: anyone, or only a caller verified by PIN.",
    )

    @field_validator("to")
    @classmethod
    def _destination(cls, value: str) -> str:
        from tools.transfers import check_destination

        return check_destination(value)  # a ValueError names what is wrong

    @field_validator("timezone")
    @classmethod
    def _zone(cls, value: str) -> str:
        from tools.transfers import zone_name

        return zone_name(value)

    @model_validator(mode="after")
    def _hours(self) -> TransferDecl:
        from tools.transfers import OpenHours

        if self.hours:
            OpenHours.parse(self.hours, self.timezone)
        return self


class ToolsFile(_Decl):
    """A tools file: providers (HTTP APIs) and the tools that call them."""

    version: Literal[1] = 1
    name: str | None = Field(default=None, description="Name of this catalog (for messages).")
    instructions: str | None = Field(
        default=None, description="The assistant's persona for calls (the call rules are added)."
    )
    label: str | None = Field(default=None, description="Default `label` of every tool.")
    providers: dict[str, ProviderDecl] = Field(min_length=1)
    tools: list[ToolDecl] = Field(min_length=1)
    agents: list[AgentDecl] | None = Field(
        default=None,
        description="Agents that share the call (as in an AGENTS_FILE): each with its "
        "instructions, tools, handoff targets, disclosures and voice. None: one agent.",
    )
    start_agent: str | None = Field(
        default=None, description="The agent a call starts with (default: the first one)."
    )
    transfers: dict[str, TransferDecl] | None = Field(
        default=None,
        description="Where the agent may transfer a caller, by name (instead of "
        "TRANSFER_TARGETS), each with its hours and who may be put through.",
    )


def tools_file_schema() -> dict[str, Any]:
    """The JSON schema of a tools file (for editors and CI)."""
    schema = ToolsFile.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": SCHEMA_ID, **schema}
