"""What GPT-Live's backends are given: the catalog's tools as function tools, and the
conversation so far as input items (`session.start` input after a reconnect; the
client-delegation backend's Responses input)."""

from __future__ import annotations

from typing import Any

# `session.start`'s `input`: at most 128 text messages within a token budget (8,192 by default).
MAX_INPUT_ITEMS = 128
MAX_INPUT_CHARS = 16_000


def functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The catalog's tools as function tools (of the Responses delegation, or of our own
    client-delegation backend)."""
    return [
        {
            "type": "function",
            "name": tool["name"],
            "description": tool.get("description", ""),
            "parameters": tool.get("parameters", {"type": "object", "properties": {}}),
        }
        for tool in tools
        if tool.get("type") == "function"
    ]


def _recent(lines: list[str]) -> list[tuple[str, str, str]]:
    """The most recent lines within the limits, oldest first: (who, text, line)."""
    kept: list[tuple[str, str, str]] = []
    total = 0
    for line in reversed(lines):
        if len(kept) >= MAX_INPUT_ITEMS or total + len(line) > MAX_INPUT_CHARS:
            break
        total += len(line)
        who, _, text = line.partition(": ")
        kept.append((who, text, line))
    kept.reverse()
    return kept


def history_input(lines: list[str]) -> list[dict[str, Any]]:
    """The conversation so far (the bridge's "Caller: …" / "Agent: …" lines) as `session.start`
    input: user and assistant messages, one text part each, the most recent within the limits.
    An agent line cut by the caller is an incomplete message (Live does not resume it)."""
    items: list[dict[str, Any]] = []
    for who, text, line in _recent(lines):
        item: dict[str, Any]
        if who == "Caller":
            item = {"role": "user", "content": [{"type": "input_text", "text": text}]}
        elif who.startswith("Agent"):
            item = {"role": "assistant", "content": [{"type": "output_text", "text": text}]}
            if who != "Agent":
                item["status"] = "incomplete"
        else:
            item = {"role": "developer", "content": [{"type": "input_text", "text": line}]}
        items.append({"type": "message", **item})
    return items


def responses_input(lines: list[str]) -> list[dict[str, Any]]:
    """The same conversation as Responses API input (easy input messages, text content): what
    the client-delegation backend is given to work out the task. A cut agent line says so."""
    items: list[dict[str, Any]] = []
    for who, text, line in _recent(lines):
        if who == "Caller":
            items.append({"type": "message", "role": "user", "content": text})
        elif who.startswith("Agent"):
            said = text if who == "Agent" else f"{text} [cut off by the caller]"
            items.append({"type": "message", "role": "assistant", "content": said})
        else:
            items.append({"type": "message", "role": "developer", "content": line})
    return items
