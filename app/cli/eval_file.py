"""The scenario file `voice-agent eval` runs: one call, scripted on every side, and what must
come of it. A file is YAML (the README shows one whole)::

    name: booking confirmed and told once
    tool_deadline_s: 1.0          # optional: shorten the mutations' deadline
    provider: {lose_response: 1}  # the demo system of record's faults (tools/restaurant/sor.py)
    faults: {executor.claimed: hold}  # engine fault points (tools/faults.py), held until released
    model:                        # the Realtime simulator's script (telephony/sim/scenario.py)
      greeting: "Luigi's, how can I help?"
      steps: [...]
    caller:                       # what the caller does, in order
      - listen
      - say: Please book a table for four tomorrow at eight.
      - hear: Shall I book it
      - keypad: "1"
      - wait_operation: committed
      - release_provider
      - hangup
    expect:
      operations: [committed]
      bookings: 1
      hears_once: [confirmed by the restaurant]
      never_hears: [sorry]

Loading never raises a traceback at a user: every problem is an `EvalFileError` naming the file,
the line and the field path.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from telephony.sim.scenario import Scenario
from tools.delivery_states import DeliveryState
from tools.faults import POINTS
from tools.restaurant.sor import Faults
from tools.states import OperationStatus

# Caller steps that take no value: written as a bare word (`- listen`).
BARE_STEPS = ("listen", "release_provider", "hangup")


class EvalFileError(Exception):
    """A scenario file that cannot be run, said as `file:line: field: problem` lines."""


class ProviderFaults(Faults):
    """The demo system of record's fault options; a misspelt one is refused, not ignored."""

    model_config = ConfigDict(extra="forbid")


class CallerStep(BaseModel):
    """One thing the caller does; exactly one field is set."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Speaks the line (speech-like audio as long as the line takes to say).
    say: str | None = Field(default=None, min_length=1)
    # Presses keys, one DTMF digit after another.
    keypad: str | None = Field(default=None, pattern=r"^[0-9*#A-D]+$")
    # Until the agent has said something and gone quiet.
    listen: bool | None = None
    # Until the caller has heard an agent line containing this phrase (case-insensitive).
    hear: str | None = Field(default=None, min_length=1)
    # Until the caller has heard this many more milliseconds of the agent.
    hear_ms: int | None = Field(default=None, gt=0, le=120_000)
    # Silence for this many seconds.
    pause: float | None = Field(default=None, gt=0, le=60)
    # Until the call's latest operation has this status.
    wait_operation: OperationStatus | None = None
    # Until the delivery of the call's latest operation has this state.
    wait_delivery: DeliveryState | None = None
    # Until the engine has reached this (held) fault point.
    wait_fault: str | None = None
    # Opens the fault point's hold.
    release: str | None = None
    # The provider answers what it was holding (`hang`, `lose_response`, `async_hold`).
    release_provider: bool | None = None
    hangup: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_word(cls, value: object) -> object:
        if isinstance(value, str):
            if value in BARE_STEPS:
                return {value: True}
            known = ", ".join(cls.model_fields)
            raise ValueError(f"{value!r} is not a caller step; the steps are: {known}")
        return value

    @model_validator(mode="after")
    def _one_thing(self) -> CallerStep:
        set_ = [name for name in type(self).model_fields if getattr(self, name) is not None]
        if len(set_) != 1:
            raise ValueError(f"a caller step does one thing; this one sets {set_ or 'nothing'}")
        return self

    @field_validator("wait_fault", "release")
    @classmethod
    def _known_point(cls, value: str | None) -> str | None:
        if value is not None and value not in POINTS:
            raise ValueError(f"no fault point {value!r}; the points are {sorted(POINTS)}")
        return value

    @property
    def kind(self) -> str:
        return next(n for n in type(self).model_fields if getattr(self, n) is not None)

    def describe(self) -> str:
        value = getattr(self, self.kind)
        if isinstance(value, Enum):
            value = value.value  # 'heard', not <DeliveryState.HEARD: 'heard'>
        return self.kind if value is True else f"{self.kind} {value!r}"


class Expect(BaseModel):
    """What must come of the call; a field left out is not checked."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The statuses of the call's operations, in the order they were admitted.
    operations: list[OperationStatus] | None = None
    # The statuses the call's first operation went through.
    transitions: list[OperationStatus] | None = None
    # Bookings and cancellations the system of record made for this call's operations.
    bookings: int | None = Field(default=None, ge=0)
    cancellations: int | None = Field(default=None, ge=0)
    # Results the agent was asked to announce in the call, and SMS sent to the caller.
    announced: int | None = Field(default=None, ge=0)
    sms: int | None = Field(default=None, ge=0)
    barge_ins: int | None = Field(default=None, ge=0)
    # Phrases (case-insensitive) in what the caller heard of the agent: at least once,
    # exactly once, never.
    hears: list[str] = Field(default_factory=list)
    hears_once: list[str] = Field(default_factory=list)
    never_hears: list[str] = Field(default_factory=list)


class EvalScenario(BaseModel):
    """One scenario file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    model: Scenario
    caller: list[CallerStep] = Field(min_length=1)
    expect: Expect
    provider: ProviderFaults = Field(default_factory=ProviderFaults)
    faults: dict[str, str] = Field(default_factory=dict)
    tool_deadline_s: float | None = Field(default=None, gt=0, le=600)
    # The whole call's bound, a stuck scenario fails instead of hanging CI.
    timeout_s: float = Field(default=60, gt=0, le=900)

    @field_validator("faults")
    @classmethod
    def _held_points(cls, value: dict[str, str]) -> dict[str, str]:
        for point, action in value.items():
            if point not in POINTS:
                raise ValueError(f"no fault point {point!r}; the points are {sorted(POINTS)}")
            if action != "hold":
                raise ValueError(f"{point}: the only action is 'hold', not {action!r}")
        return value

    @model_validator(mode="after")
    def _releases_are_held(self) -> EvalScenario:
        for index, step in enumerate(self.caller):
            point = step.release or step.wait_fault
            if point is not None and point not in self.faults:
                raise ValueError(
                    f"caller step {index + 1} ({step.describe()}) names a point that "
                    f"`faults` does not hold; add `faults: {{{point}: hold}}`"
                )
        return self


def _line_of(root: yaml.Node | None, loc: tuple[int | str, ...]) -> int | None:
    """The 1-based line of the node at `loc` (as deep as the document goes)."""
    node = root
    line = node.start_mark.line + 1 if node is not None else None
    for key in loc:
        child: yaml.Node | None = None
        if isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if k.value == key), None)
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int):
            child = node.value[key] if key < len(node.value) else None
        if child is None:
            break
        node = child
        line = node.start_mark.line + 1
    return line


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for key in loc:
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out or "(file)"


def load_eval(path: Path) -> EvalScenario:
    """The scenario in `path`, or an EvalFileError saying where and what is wrong."""
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise EvalFileError(f"{path}: cannot read: {exc}") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        data: Any = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        problem = getattr(exc, "problem", None) or str(exc)
        raise EvalFileError(f"{where}: not YAML: {problem}") from None
    if not isinstance(data, dict):
        raise EvalFileError(f"{path}:1: a scenario is a mapping (name, model, caller, expect)")
    try:
        return EvalScenario.model_validate(data)
    except ValidationError as exc:
        lines = []
        for error in exc.errors():
            loc = tuple(k for k in error["loc"] if not str(k).startswith("function-"))
            # Union and tagged errors add the model's name to the path; it is no field.
            loc = tuple(k for k in loc if k not in ("CallerStep", "str", "bool"))
            line = _line_of(root, loc)
            where = f"{path}:{line}" if line is not None else str(path)
            message = str(error["msg"]).removeprefix("Value error, ")
            lines.append(f"{where}: {_path(loc)}: {message}")
        raise EvalFileError("\n".join(lines)) from None
