"""Scenario files for the Realtime simulator: what the scripted model says and calls, in order.

A scenario is JSON::

    {
      "name": "restaurant-booking",
      "greeting": {"text": "Thanks for calling. How can I help?"},
      "steps": [
        {"caller_transcript": "Is there a table for four tomorrow at eight?",
         "function_call": {"name": "check_availability",
                           "arguments": {"date": "{tomorrow}", "time": "20:00", "party_size": 4},
                           "preamble": "Let me check that for you."}},
        {"reply": {"text": "We have a table at eight. Shall I book it?", "audio_ms": 2500}}
      ],
      "fallback": {"text": "Sorry, could you say that again?"}
    }

- `greeting` is played by the first `response.create` that arrives before any caller speech.
  A `response.create` whose instructions say `Say exactly: "…"` (a resumed call's apology)
  says that line instead, and takes no step.
- Every other response consumes the next step. A step speaks its `reply`, calls its
  `function_call`, or both (the reply then plays before the call, like a preamble).
- `caller_transcript` is how the caller's turn that precedes the step is transcribed.
- Reply texts may use `{output}` (the latest `function_call_output`, verbatim) or
  `{output[key]}` (a field of it when it is JSON); missing fields render empty. `{note}` is
  the text of the latest system message the client added (how a late result is announced),
  so the scripted model says what it was asked to say. A step whose reply says `{note}` waits
  for one: a response before any system message arrived speaks `fallback` and leaves the
  step next (a model told nothing has nothing to tell).
- String arguments may use `{today}` and `{tomorrow}` (ISO dates, UTC), so a scenario does not
  age into the past.
- When the steps run out, every response speaks `fallback`.
- `audio_ms` is the reply's audio duration; by default it follows the text length.
- `function_call.repeat` makes the same call that many times in one response.

A step can follow what its function output said, as a real model does, instead of one fixed
line. `on_output` lists cases, tried in order; the first whose `status` names the latest
function output's `status` (a tool layer's output without one but with an `error` counts as
`error`) speaks its `reply` in place of the step's, and `then` (a step's `id`) says where the
script goes on (default: the next step). A case with `at_most` is taken that many times in a
call, then skipped, so a later case for the same status can give up. The step's own `reply`
is said when no case matches::

    {"id": "confirm", "caller_transcript": "Yes.",
     "function_call": {"name": "confirm_operation", ...}},
    {"reply": "Let me check where that stands.",
     "on_output": [
       {"status": ["admitted", "running"], "reply": "I've sent it; it isn't confirmed yet."},
       {"status": "awaiting_confirmation", "at_most": 2, "then": "confirm",
        "reply": "Sorry, I didn't hear your answer. {output[readback]}"},
       {"status": "awaiting_confirmation", "reply": "I still did not hear a yes, so I did nothing."}
     ]}

A step with `on_output` needs its own `reply` and makes no function call.
"""

from __future__ import annotations

import datetime as dt
import json
import string
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# Speech runs at roughly 14-15 characters per second; keeps derived durations plausible.
_MS_PER_CHAR = 65
_MIN_AUDIO_MS = 600
DEFAULT_SCENARIO = "default.json"


class Reply(BaseModel):
    """Something the agent says: a transcript and the duration of its audio."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    text: str = Field(min_length=1)
    audio_ms: int | None = Field(default=None, gt=0, le=120_000)
    # Samples past the last whole millisecond (0-7 at 8 kHz): a real voice's line is any
    # number of samples long, not a whole number of milliseconds.
    tail_samples: int = Field(default=0, ge=0, le=7)

    def duration_ms(self, text: str | None = None) -> int:
        """The audio duration: `audio_ms` if given, else derived from the (rendered) text."""
        if self.audio_ms is not None:
            return self.audio_ms
        return max(_MIN_AUDIO_MS, len(text if text is not None else self.text) * _MS_PER_CHAR)


class FunctionCallStep(BaseModel):
    """A function call the scripted model makes, optionally preceded by a spoken sentence."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_-]+$")
    arguments: dict[str, Any] = Field(default_factory=dict)
    preamble: Reply | None = None
    # The same call this many times in one response (each its own call_id): a model that
    # fans out, as the per-response and in-flight caps must withstand.
    repeat: int = Field(default=1, ge=1, le=100)
    # How long the arguments take to stream (default: a few tens of ms): a slow model gives
    # a caller time to cut in before the call is complete.
    arguments_ms: int | None = Field(default=None, ge=0, le=60_000)

    @field_validator("preamble", mode="before")
    @classmethod
    def _text_is_enough(cls, value: object) -> object:
        return {"text": value} if isinstance(value, str) else value

    def rendered_arguments(self, today: dt.date | None = None, output: str | None = None) -> str:
        """The arguments as the JSON string the model streams, with placeholders filled:
        `{today}`/`{tomorrow}`, and `{output[key]}` from the latest function output (so a
        scripted `confirm_operation` can name the operation it was just given)."""
        day = today or dt.datetime.now(dt.UTC).date()
        values: dict[str, Any] = {
            "today": day.isoformat(),
            "tomorrow": (day + dt.timedelta(days=1)).isoformat(),
        }
        if output:
            try:
                parsed: Any = json.loads(output)
            except ValueError:
                parsed = output
            values["output"] = _Field(parsed, raw=output)

        def fill(value: Any) -> Any:
            if isinstance(value, str):
                return _render(value, values)
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            if isinstance(value, list):
                return [fill(v) for v in value]
            return value

        return json.dumps(fill(self.arguments), separators=(",", ":"))


class OutputCase(BaseModel):
    """What a step says when the latest function output has one of `status`, and where the
    script goes on from there."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    status: list[str] = Field(min_length=1)
    reply: Reply
    # The `id` of the step the script goes on at (None: the step after this one).
    then: str | None = None
    # Taken this many times in one call at most; after that the later cases are tried.
    at_most: int | None = Field(default=None, ge=1)

    @field_validator("status", mode="before")
    @classmethod
    def _one_is_enough(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator("reply", mode="before")
    @classmethod
    def _text_is_enough(cls, value: object) -> object:
        return {"text": value} if isinstance(value, str) else value


class Step(BaseModel):
    """One scripted model turn."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str | None = Field(default=None, min_length=1)
    caller_transcript: str | None = None
    reply: Reply | None = None
    function_call: FunctionCallStep | None = None
    on_output: list[OutputCase] = Field(default_factory=list)

    @field_validator("reply", mode="before")
    @classmethod
    def _text_is_enough(cls, value: object) -> object:
        return {"text": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _does_something(self) -> Step:
        if self.reply is None and self.function_call is None:
            raise ValueError("a step needs a reply, a function_call, or both")
        if self.reply is not None and self.function_call and self.function_call.preamble:
            raise ValueError("a step with a reply and a function_call takes no preamble")
        if self.on_output and (self.reply is None or self.function_call is not None):
            raise ValueError(
                "a step with on_output needs a reply (said when no case matches) and takes "
                "no function_call"
            )
        return self

    def case_for(self, status: str | None, taken: Callable[[int], int]) -> int | None:
        """The index of the first case for `status` not used up (`taken(i)`: how often case
        `i` was taken in this call); None when the step's own reply applies."""
        if status is None:
            return None
        for index, case in enumerate(self.on_output):
            if status in case.status and (case.at_most is None or taken(index) < case.at_most):
                return index
        return None

    def spoken(self) -> Reply | None:
        """What this step says before anything else (its reply, or the call's preamble)."""
        if self.reply is not None:
            return self.reply
        return self.function_call.preamble if self.function_call else None

    def says_note(self) -> bool:
        """Whether this step speaks the client's latest system message (`{note}`)."""
        spoken = self.spoken()
        return spoken is not None and "{note}" in spoken.text


class Scenario(BaseModel):
    """A whole scripted conversation."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "scenario"
    greeting: Reply | None = None
    steps: list[Step] = Field(default_factory=list)
    fallback: Reply = Reply(text="Sorry, could you say that again?")

    @field_validator("greeting", "fallback", mode="before")
    @classmethod
    def _text_is_enough(cls, value: object) -> object:
        return {"text": value} if isinstance(value, str) else value

    @model_validator(mode="after")
    def _jumps_land(self) -> Scenario:
        ids = [step.id for step in self.steps if step.id is not None]
        if len(ids) != len(set(ids)):
            raise ValueError(f"step ids must be unique: {ids}")
        for step in self.steps:
            for case in step.on_output:
                if case.then is not None and case.then not in ids:
                    raise ValueError(f"on_output goes on at {case.then!r}: no step has that id")
        return self

    def step_index(self, step_id: str) -> int:
        """Where the step with `step_id` is in `steps`."""
        return next(i for i, step in enumerate(self.steps) if step.id == step_id)


def output_status(output: str | None) -> str | None:
    """The `status` of a function output as the tool layer shapes it (a JSON object with a
    `status`; one with only an `error` is an error); None when it says none."""
    if not output:
        return None
    try:
        parsed: Any = json.loads(output)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    status = parsed.get("status")
    if isinstance(status, str) and status:
        return status
    return "error" if "error" in parsed else None


def render_reply_text(text: str, output: str | None, note: str | None = None) -> str:
    """Fill `{output}` / `{output[key]}` from the latest function output (JSON or plain),
    and `{note}` from the latest system message."""
    if "{" not in text:
        return text
    parsed: Any = output or ""
    if output:
        try:
            parsed = json.loads(output)
        except ValueError:
            parsed = output
    values: dict[str, Any] = {"output": _Field(parsed, raw=output or "")}
    if note is not None:
        values["note"] = _Field(note)
    return _render(text, values)


class _Field:
    """A lenient view of a JSON value for str.format: missing keys render empty."""

    def __init__(self, value: Any, raw: str | None = None) -> None:
        self._value = value
        self._raw = raw

    def __getitem__(self, key: str) -> _Field:
        value = self._value
        if isinstance(value, dict):
            return _Field(value.get(key, ""))
        if isinstance(value, list) and key.isdigit() and int(key) < len(value):
            return _Field(value[int(key)])
        return _Field("")

    def __format__(self, spec: str) -> str:
        if self._raw is not None:
            return self._raw
        if isinstance(self._value, str):
            return self._value
        return json.dumps(self._value)


def _render(template: str, values: dict[str, Any]) -> str:
    class Lenient(string.Formatter):
        def get_value(self, key: int | str, args: Any, kwargs: Any) -> Any:
            return values.get(str(key), "{" + str(key) + "}")

    try:
        return Lenient().format(template)
    except (ValueError, IndexError, AttributeError, KeyError, TypeError):
        return template


def load_scenario(source: str | Path | None = None) -> Scenario:
    """Load a scenario file; None loads the built-in restaurant-booking demo."""
    if source is None:
        text = (
            resources.files("telephony.sim.scenarios").joinpath(DEFAULT_SCENARIO).read_text("utf-8")
        )
    else:
        text = Path(source).read_text("utf-8")
    return Scenario.model_validate_json(text)
