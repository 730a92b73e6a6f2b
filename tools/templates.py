"""Templates of a tools file: `"/appointments/{args.id}"`, `"{idempotency_key}"`, `"{date}"`.

A placeholder is a dotted name in braces; `{{` and `}}` are literal braces. Placeholders are
checked against the names a template may use when the file is loaded, so a typo is refused
at start, not discovered on a live call.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

_NAME = r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+)*"
_TOKEN = re.compile(r"\{\{|\}\}|\{(" + _NAME + r")\}|\{[^}]*\}?|\}")
_WHOLE = re.compile(r"^\{(" + _NAME + r")\}$")

MISSING = object()


class TemplateError(ValueError):
    """A template that cannot be read (a stray brace, an empty or malformed placeholder)."""


def _tokens(template: str) -> Iterator[tuple[str, str]]:
    """("text", s) and ("name", dotted) pieces of a template, in order."""
    pos = 0
    for m in _TOKEN.finditer(template):
        if m.start() > pos:
            yield "text", template[pos : m.start()]
        tok = m.group(0)
        if tok == "{{":
            yield "text", "{"
        elif tok == "}}":
            yield "text", "}"
        elif m.group(1):
            yield "name", m.group(1)
        else:
            raise TemplateError(
                f"bad placeholder {tok!r} in {template!r} (write {{name}}, or {{{{ for a brace)"
            )
        pos = m.end()
    if pos < len(template):
        yield "text", template[pos:]


def names(template: str) -> list[str]:
    """The placeholders of a template, in order (`TemplateError` if it is malformed)."""
    return [value for kind, value in _tokens(template) if kind == "name"]


def resolve(values: Mapping[str, Any], dotted: str) -> Any:
    """`values["a"]["b"]` for `"a.b"`; an exact key wins (picked fields may be dotted)."""
    if dotted in values:
        return values[dotted]
    current: Any = values
    for part in dotted.split("."):
        if isinstance(current, Mapping) and part in current:
            current = current[part]
        elif isinstance(current, list) and part.isdigit() and int(part) < len(current):
            current = current[int(part)]
        else:
            return MISSING
    return current


def text_of(value: Any) -> str:
    """How a value reads inside text: JSON-ish scalars, lists joined with commas."""
    if value is MISSING or value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return ", ".join(text_of(v) for v in value)
    return str(value)


def render(
    template: str, values: Mapping[str, Any], *, escape: Callable[[str], str] | None = None
) -> str:
    """Fill a template; `escape` (e.g. URL quoting) applies to each filled value."""
    out = []
    for kind, value in _tokens(template):
        if kind == "text":
            out.append(value)
        else:
            filled = text_of(resolve(values, value))
            out.append(escape(filled) if escape else filled)
    return "".join(out)


def render_json(node: Any, values: Mapping[str, Any]) -> Any:
    """A JSON body template: a string that is one placeholder keeps the value's type
    (`"{args.party_size}"` -> 4), other strings are filled as text, containers recurse."""
    if isinstance(node, str):
        whole = _WHOLE.match(node)
        if whole:
            found = resolve(values, whole.group(1))
            return None if found is MISSING else found
        return render(node, values)
    if isinstance(node, Mapping):
        return {str(k): render_json(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [render_json(v, values) for v in node]
    return node


def json_names(node: Any) -> list[str]:
    """Every placeholder in a JSON body template."""
    if isinstance(node, str):
        return names(node)
    if isinstance(node, Mapping):
        return [n for v in node.values() for n in json_names(v)]
    if isinstance(node, list):
        return [n for v in node for n in json_names(v)]
    return []
