"""Agents declared in configuration (`AGENTS_FILE`): who talks to the caller, with which tools.

An agents file is YAML::

    agents:
      - name: host
        instructions: You are the host of Luigi's...
        tools: [check_availability, get_booking]
        handoffs: [manager]          # whom it may hand the caller to
        disclose: [check_availability, get_booking]   # whose results it may tell
      - name: manager
        instructions: You are the manager...
        tools: [book_table, cancel_booking, get_booking]
    start: host                      # optional: the first agent by default

`tools` names tools of the catalog; the engine's control tools (confirmation, PIN, conflicts,
the handoff) always come along. `disclose` is optional: without it an agent may tell the
result of every tool. Operations belong to the call, not to the agent that admitted them: a
result reaches whichever agent is active, and when that agent may not disclose it the result
goes out of call (SMS) instead. No file: one agent with every tool, as before.

The file is checked against the catalog at start; every mistake is an `AgentsFileError` with
one line naming the file, the problem and the fix.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tools.errors import ToolError
from tools.yaml_source import Located, YamlProblem, load

AGENT_NAME = r"^[a-z][a-z0-9_-]{0,39}$"


class AgentsFileError(ToolError):
    """An agents file that cannot run; the message is one line: file, problem, fix."""

    def __init__(self, message: str, *, at: str, field: str, problem: str, fix: str) -> None:
        super().__init__(message)
        self.at = at  # file[:line]
        self.field = field  # dotted path in the file ("" for the whole file)
        self.problem = problem
        self.fix = fix


class AgentDecl(BaseModel):
    """One agent as the file declares it."""

    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)

    name: str = Field(pattern=AGENT_NAME)
    instructions: str = Field(min_length=1, max_length=8000)
    tools: tuple[str, ...] = ()
    handoffs: tuple[str, ...] = ()
    disclose: tuple[str, ...] | None = None
    # The voice this agent speaks with (a Realtime voice such as `marin`; None: VOICE's).
    voice: str | None = Field(default=None, pattern=r"^[a-z][a-z0-9_-]{0,39}$")


class AgentsFileModel(BaseModel):
    """The whole file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    agents: tuple[AgentDecl, ...]
    start: str | None = None


@dataclass(frozen=True, slots=True)
class Agent:
    """A checked agent: its persona, its domain tools, its handoff targets, its disclosures."""

    name: str
    instructions: str
    tools: frozenset[str]
    handoffs: tuple[str, ...]
    disclose: frozenset[str] | None  # None: every tool's results
    voice: str | None = None  # None: the deployment's voice

    def may_disclose(self, tool: str) -> bool:
        return self.disclose is None or tool in self.disclose


@dataclass(frozen=True, slots=True)
class AgentSet:
    """The agents of a deployment, checked against its catalog."""

    agents: Mapping[str, Agent]
    start: str
    source: str = "AGENTS_FILE"

    def get(self, name: str | None) -> Agent:
        """The agent `name`; the starting one for None or a name no longer declared."""
        if name is not None and name in self.agents:
            return self.agents[name]
        return self.agents[self.start]

    def may_disclose(self, agent: str | None, tool: str) -> bool:
        return self.get(agent).may_disclose(tool)


def _fail_at(
    source: str, line: int | None, where: str, problem: str, fix: str, label: str
) -> AgentsFileError:
    at = f"{source}:{line}" if line else source
    return AgentsFileError(
        f"{label} {at}: {where + ': ' if where else ''}{problem}. Fix: {fix}",
        at=at,
        field=where,
        problem=problem,
        fix=fix,
    )


def _fail(source: str, line: int | None, where: str, problem: str, fix: str) -> AgentsFileError:
    return _fail_at(source, line, where, problem, fix, "AGENTS_FILE")


def load_agents_file(path: str | Path, tool_names: Iterable[str]) -> AgentSet:
    """The agents `path` declares, checked against the catalog's `tool_names`."""
    path = Path(path)
    try:
        text = path.read_text("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "it is not UTF-8 text"
        raise _fail(str(path), None, "", f"cannot read it ({reason})", "check the path") from None
    return load_agents_text(text, tool_names, source=str(path))


def load_agents_text(text: str, tool_names: Iterable[str], *, source: str) -> AgentSet:
    """`load_agents_file` for text already read (`source` names it in messages)."""
    try:
        located = load(text)
    except YamlProblem as exc:
        raise _fail(source, exc.line, "", str(exc), "correct the YAML") from None
    if not isinstance(located.data, Mapping):
        raise _fail(
            source, 1, "", "an agents file is a mapping with `agents`", "write `agents:` and a list"
        )
    try:
        decl = AgentsFileModel.model_validate(located.data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        raise _fail(
            source,
            located.line(loc),
            located.dotted(loc),
            err["msg"],
            "see the README's 'Agents and handoffs' for each field",
        ) from None
    return check(decl, located, set(tool_names), source)


def check(
    decl: AgentsFileModel,
    located: Located,
    known: set[str],
    source: str,
    label: str = "AGENTS_FILE",
    start_key: str = "start",
) -> AgentSet:
    """The first problem of `decl` against the catalog, or the checked `AgentSet`. `label`
    names the setting the file came from in messages, `start_key` the field naming the first
    agent (the tools file declares agents too, with `start_agent`)."""

    def fail(line: int | None, where: str, problem: str, fix: str) -> AgentsFileError:
        return _fail_at(source, line, where, problem, fix, label)

    if not decl.agents:
        raise fail(located.line(("agents",)), "agents", "no agents", "declare one at least")
    offered = ", ".join(sorted(known)) or "none"
    names: dict[str, int] = {}
    for i, agent in enumerate(decl.agents):
        if agent.name in names:
            raise fail(
                located.line(("agents", i, "name")),
                f"agents[{i}].name",
                f"duplicate agent name {agent.name!r} (also agents[{names[agent.name]}])",
                "give every agent its own name",
            )
        names[agent.name] = i
    for i, agent in enumerate(decl.agents):
        for field in ("tools", "disclose"):
            for j, tool in enumerate(getattr(agent, field) or ()):
                if tool not in known:
                    raise fail(
                        located.line(("agents", i, field, j)),
                        f"agents[{i}].{field}[{j}]",
                        f"no tool {tool!r} in the catalog",
                        f"name one of {offered} (`voice-agent tools check` lists them)",
                    )
        others = ", ".join(n for n in names if n != agent.name) or "none"
        for j, target in enumerate(agent.handoffs):
            if target not in names or target == agent.name:
                raise fail(
                    located.line(("agents", i, "handoffs", j)),
                    f"agents[{i}].handoffs[{j}]",
                    f"no other agent named {target!r}",
                    f"hand off to one of {others}",
                )
    start = decl.start or decl.agents[0].name
    if start not in names:
        raise fail(
            located.line((start_key,)),
            start_key,
            f"no agent named {start!r}",
            f"start with one of {', '.join(names)}",
        )
    agents = {
        a.name: Agent(
            name=a.name,
            instructions=a.instructions,
            tools=frozenset(a.tools),
            handoffs=a.handoffs,
            disclose=frozenset(a.disclose) if a.disclose is not None else None,
            voice=a.voice,
        )
        for a in decl.agents
    }
    return AgentSet(agents, start, source)


def agents_file_schema() -> dict[str, Any]:
    """The JSON schema of an agents file (for editors)."""
    return AgentsFileModel.model_json_schema()
