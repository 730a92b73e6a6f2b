"""A tool's argument schema, written as a JSON schema subset, as a pydantic model.

A tools file declares arguments the way the model sees them (a flat JSON schema object);
this builds the pydantic model the engine validates and normalizes with. Only what a phone
conversation needs is supported, so what the model is told and what is enforced are the
same thing:

- `type: object` with `properties`, `required`, optionally `additionalProperties: false`
  (always enforced) and a `description`;
- each property: `type` string | integer | number | boolean | array (of those scalars),
  `description`, `enum`, `default`, `minimum` / `maximum`, `minLength` / `maxLength`,
  `pattern`, `minItems` / `maxItems`, and `format` `date` (YYYY-MM-DD), `time` (HH:MM,
  24-hour) or `date-time`.

Anything else is refused with the path of the offending keyword.
"""

from __future__ import annotations

import datetime as dt
import keyword
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, create_model

HHMM = r"^([01]\d|2[0-3]):[0-5]\d$"
_PROPERTY_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,63}$")
_TOP_KEYS = {"type", "properties", "required", "additionalProperties", "description", "title"}
_SCALAR_KEYS = {
    "type",
    "description",
    "title",
    "enum",
    "default",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "examples",
}
_ARRAY_KEYS = {"type", "description", "title", "items", "minItems", "maxItems", "default"}
_FORMATS = {"date", "time", "date-time"}
_RESERVED = set(dir(BaseModel))

Path = tuple[str | int, ...]


@dataclass(frozen=True, slots=True)
class SchemaProblem(Exception):
    """Where in the schema (a path of keys) and what is wrong."""

    path: Path
    message: str

    def __str__(self) -> str:
        return self.message


class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", str_strip_whitespace=True, frozen=True)


def model_from_schema(name: str, schema: Any, path: Path = ()) -> type[BaseModel]:
    """The pydantic model for `schema`; `SchemaProblem` (with its path) if it is not one."""
    if not isinstance(schema, Mapping):
        raise SchemaProblem(path, "the argument schema must be a mapping (type: object)")
    _only(schema, _TOP_KEYS, path)
    if schema.get("type", "object") != "object":
        raise SchemaProblem((*path, "type"), "the argument schema must be of type object")
    if schema.get("additionalProperties", False) is not False:
        raise SchemaProblem(
            (*path, "additionalProperties"),
            "additionalProperties must be false: a tool takes only the arguments it declares",
        )
    props = schema.get("properties", {})
    if not isinstance(props, Mapping):
        raise SchemaProblem((*path, "properties"), "properties must be a mapping")
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaProblem((*path, "required"), "required must be a list of property names")
    for i, r in enumerate(required):
        if r not in props:
            raise SchemaProblem((*path, "required", i), f"required names {r!r}, not a property")
    fields: dict[str, Any] = {}
    for prop, sub in props.items():
        where = (*path, "properties", prop)
        if not isinstance(prop, str) or not _PROPERTY_NAME.match(prop):
            raise SchemaProblem(
                where,
                f"property name {prop!r}: use letters, digits and '_', starting with a letter",
            )
        if keyword.iskeyword(prop) or prop in _RESERVED:
            raise SchemaProblem(where, f"property name {prop!r} is reserved; rename it")
        fields[prop] = _field(sub, where, required=prop in required)
    try:
        model: type[BaseModel] = create_model(_model_name(name), __base__=_Args, **fields)
        model.model_json_schema()
    except Exception as exc:  # a pattern pydantic's regex engine refuses, and the like
        raise SchemaProblem(path, f"the argument schema cannot be built: {exc}") from exc
    return model


def _model_name(tool: str) -> str:
    return "".join(part.capitalize() for part in re.split(r"[^A-Za-z0-9]", tool) if part) + "Args"


def _only(node: Mapping[str, Any], allowed: set[str], path: Path) -> None:
    for key in node:
        if key not in allowed:
            raise SchemaProblem(
                (*path, key),
                f"unsupported schema keyword {key!r} (supported here: "
                f"{', '.join(sorted(allowed))})",
            )


def _field(node: Any, path: Path, *, required: bool) -> tuple[Any, Any]:
    if not isinstance(node, Mapping):
        raise SchemaProblem(path, "a property schema must be a mapping")
    kind = node.get("type")
    if kind == "array":
        _only(node, _ARRAY_KEYS, path)
        items = node.get("items")
        if not isinstance(items, Mapping):
            raise SchemaProblem((*path, "items"), "an array needs `items` (a scalar schema)")
        if items.get("type") in ("array", "object"):
            raise SchemaProblem(
                (*path, "items", "type"), "arrays hold scalars (nested structures: keep it flat)"
            )
        item_type, _ = _scalar(items, (*path, "items"))
        annotation: Any = list[item_type]  # type: ignore[valid-type]
        constraints = _constraints(node, {"minItems": "min_length", "maxItems": "max_length"})
        description = node.get("description")
    else:
        annotation, field_kw = _scalar(node, path)
        constraints = field_kw
        description = node.get("description")
    if description is not None and not isinstance(description, str):
        raise SchemaProblem((*path, "description"), "description must be text")
    default: Any = ...
    if "default" in node:
        default = node["default"]
        try:
            TypeAdapter(annotation).validate_python(default)
        except ValidationError as exc:
            raise SchemaProblem((*path, "default"), f"the default does not fit: {exc}") from exc
    elif not required:
        annotation = annotation | None
        default = None
    return annotation, Field(default, description=description, **constraints)


def _constraints(node: Mapping[str, Any], names: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, kw in names.items():
        if key in node:
            out[kw] = node[key]
    return out


def _scalar(node: Mapping[str, Any], path: Path) -> tuple[Any, dict[str, Any]]:
    _only(node, _SCALAR_KEYS, path)
    kind = node.get("type")
    fmt = node.get("format")
    enum = node.get("enum")
    if kind == "object":
        raise SchemaProblem((*path, "type"), "nested objects are not supported: keep it flat")
    if kind not in ("string", "integer", "number", "boolean"):
        raise SchemaProblem(
            (*path, "type"),
            f"type {kind!r} is not supported (string, integer, number, boolean, array)",
        )
    if fmt is not None and (kind != "string" or fmt not in _FORMATS):
        raise SchemaProblem(
            (*path, "format"), f"format {fmt!r}: only date, time and date-time strings"
        )
    numeric = {"minimum": "ge", "maximum": "le"}
    textual = {"minLength": "min_length", "maxLength": "max_length", "pattern": "pattern"}
    for key in (*numeric, *textual):
        if key not in node:
            continue
        fits_numeric = key in numeric and kind in ("integer", "number")
        fits_text = key in textual and kind == "string" and fmt is None
        if not (fits_numeric or fits_text):
            raise SchemaProblem((*path, key), f"{key} does not apply to a {fmt or kind}")
        value = node[key]
        if key == "pattern":
            if not isinstance(value, str):
                raise SchemaProblem((*path, key), "pattern must be text")
            try:
                re.compile(value)
            except re.error as exc:
                raise SchemaProblem((*path, key), f"bad pattern: {exc}") from exc
        elif isinstance(value, bool) or not isinstance(value, int | float):
            raise SchemaProblem((*path, key), f"{key} must be a number")
    constraints = _constraints(node, {**numeric, **textual})
    if enum is not None:
        if not isinstance(enum, list) or not enum:
            raise SchemaProblem((*path, "enum"), "enum must be a non-empty list")
        if kind == "boolean" or fmt is not None or constraints:
            raise SchemaProblem((*path, "enum"), "enum goes with a plain string or number")
        py = {"string": str, "integer": int, "number": int | float}[kind]
        for i, v in enumerate(enum):
            if isinstance(v, bool) or not isinstance(v, py):
                raise SchemaProblem((*path, "enum", i), f"enum value {v!r} is not a {kind}")
        return Literal[tuple(enum)], {}
    annotation: Any
    if kind == "string":
        if fmt == "date":
            annotation = dt.date
        elif fmt == "date-time":
            annotation = dt.datetime
        elif fmt == "time":
            annotation = str
            constraints["pattern"] = HHMM
        else:
            annotation = str
    elif kind == "integer":
        annotation = int
    elif kind == "number":
        annotation = float
    else:
        annotation = bool
    return annotation, constraints


def property_types(schema: Mapping[str, Any]) -> dict[str, tuple[str, str | None]]:
    """{name: (type, format)} of a (valid) argument schema's properties."""
    out: dict[str, tuple[str, str | None]] = {}
    for prop, sub in (schema.get("properties") or {}).items():
        if isinstance(sub, Mapping):
            out[str(prop)] = (str(sub.get("type")), sub.get("format"))
    return out
