"""YAML read with the line of every key, so a mistake can be reported where it is written.

`load` parses safely (plain data only) and returns the data with a map from each path
(`("tools", 1, "retry")`) to its 1-based line. Duplicate keys, which YAML would silently
resolve to the last one, are refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

Path = tuple[str | int, ...]


class YamlProblem(ValueError):
    """A file that is not (plain, unambiguous) YAML; `line` is 1-based when known."""

    def __init__(self, message: str, line: int | None) -> None:
        super().__init__(message)
        self.line = line


@dataclass(frozen=True, slots=True)
class Located:
    """Parsed data and the line of every path in it."""

    data: Any
    lines: dict[Path, int]

    def line(self, loc: Sequence[str | int]) -> int | None:
        """The line of the deepest known path along `loc` (extra parts are skipped, so a
        validator's location such as ("tools", 0, "function-after[...]", "retry") works)."""
        path: Path = ()
        best = self.lines.get(())
        for part in loc:
            candidate = (*path, part)
            if candidate in self.lines:
                path = candidate
                best = self.lines[candidate]
        return best

    def dotted(self, loc: Sequence[str | int]) -> str:
        """`tools[1].retry.max_attempts`: the known part of `loc`, readable."""
        path: Path = ()
        for part in loc:
            candidate = (*path, part)
            if candidate in self.lines:
                path = candidate
        return dotted(path)


def dotted(path: Sequence[str | int]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


class _Constructor(SafeConstructor):
    pass


def load(text: str) -> Located:
    """Parse `text`; `YamlProblem` with a line for syntax errors and duplicate keys."""
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as exc:
        raise YamlProblem(f"not valid YAML: {exc.problem or exc}", _line_of(exc)) from None
    except yaml.YAMLError as exc:
        raise YamlProblem(f"not valid YAML: {exc}", None) from None
    lines: dict[Path, int] = {}
    if node is None:
        return Located(None, {(): 1})
    constructor = _Constructor()
    data = _build(node, (), lines, constructor)
    return Located(data, lines)


# Constructs that PyYAML notices are broken only at the next token, often on a later line (or
# the end of the file): a key without its `:`, an unclosed quote or flow collection. The
# mistake is where the construct began, which the error's context mark names.
_OPENED_AT_CONTEXT = (
    "while scanning a simple key",
    "while scanning a quoted scalar",
    "while parsing a flow sequence",
    "while parsing a flow mapping",
)


def _line_of(exc: yaml.MarkedYAMLError) -> int | None:
    """The 1-based line a user should look at (PyYAML's marks are 0-based)."""
    problem, context = exc.problem_mark, exc.context_mark
    if problem is None:
        return context.line + 1 if context is not None else None
    if context is not None and context.line < problem.line and exc.context in _OPENED_AT_CONTEXT:
        return context.line + 1
    return problem.line + 1


def _build(node: Node, path: Path, lines: dict[Path, int], c: _Constructor) -> Any:
    lines.setdefault(path, node.start_mark.line + 1)
    if isinstance(node, MappingNode):
        out: dict[Any, Any] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                raise YamlProblem("merge keys (<<) are not supported", key_node.start_mark.line + 1)
            key = _scalar(key_node, c)
            if isinstance(key, list | dict):
                raise YamlProblem("a key must be plain text", key_node.start_mark.line + 1)
            if key in out:
                raise YamlProblem(f"duplicate key {key!r}", key_node.start_mark.line + 1)
            child = (*path, key)
            lines[child] = key_node.start_mark.line + 1
            out[key] = _build(value_node, child, lines, c)
        return out
    if isinstance(node, SequenceNode):
        return [_build(item, (*path, i), lines, c) for i, item in enumerate(node.value)]
    return _scalar(node, c)


def _scalar(node: Node, c: _Constructor) -> Any:
    if not isinstance(node, ScalarNode):
        return [] if isinstance(node, SequenceNode) else {}
    try:
        return c.construct_object(node, deep=True)
    except ConstructorError as exc:
        raise YamlProblem(f"unsupported value: {exc.problem}", node.start_mark.line + 1) from None
