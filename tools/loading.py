"""Finding a deployment's catalog: by import path (`TOOLS`) and/or a tools file (`TOOLS_FILE`).

`TOOLS=package.module:name` names either a `Catalog` or a factory `name(ctx) -> Catalog`
that receives a `CatalogContext` (tenant, public base URL, environment, the system of
record's URL); `package.module` alone means `package.module:catalog`. Every way this can go
wrong (no such module, no such name, a factory that fails, not a catalog) is a
`CatalogError` with one line saying what to fix, never a traceback.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import re
from collections.abc import Sequence
from pathlib import Path

from tools.catalog import Catalog, CatalogContext, CatalogError, CatalogProblem, merge
from tools.tools_file import load_tools_file

log = logging.getLogger(__name__)

_IMPORT_PATH = re.compile(
    r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*(:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*)?$"
)


def _refuse(spec: str, message: str, fix: str) -> CatalogError:
    return CatalogError(
        [CatalogProblem(None, None, message, fix, f"TOOLS={spec}")], source=f"TOOLS={spec}"
    )


def split_import_path(spec: str) -> tuple[str, str]:
    """`"pkg.mod:name"` -> ("pkg.mod", "name"); `"pkg.mod"` -> ("pkg.mod", "catalog")."""
    module, _, attr = spec.strip().partition(":")
    return module, attr or "catalog"


def load_plugin(spec: str, ctx: CatalogContext) -> Catalog:
    """The catalog `TOOLS=spec` names (not yet checked: `checked()` does that)."""
    spec = spec.strip()
    if not _IMPORT_PATH.match(spec):
        raise _refuse(spec, "not an import path", "write TOOLS=package.module:catalog")
    module_name, attr = split_import_path(spec)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        raise _refuse(
            spec,
            f"no module named {exc.name!r}",
            "install the package (pip install …) or put it on PYTHONPATH",
        ) from None
    except Exception as exc:
        raise _refuse(
            spec,
            f"importing {module_name} failed: {type(exc).__name__}: {exc}",
            "fix the module so that it imports",
        ) from None
    target: object = module
    for part in attr.split("."):
        if not hasattr(target, part):
            raise _refuse(
                spec,
                f"{module_name} has no {attr!r}",
                "name the Catalog (or the factory returning one) after the colon",
            )
        target = getattr(target, part)
    if isinstance(target, Catalog):
        return target
    if not callable(target):
        raise _refuse(
            spec,
            f"{attr} is a {type(target).__name__}, not a Catalog or a factory",
            "point TOOLS at a Catalog or at a function (ctx) -> Catalog",
        )
    try:
        takes_ctx = bool(inspect.signature(target).parameters)
    except (TypeError, ValueError):
        takes_ctx = True
    try:
        built = target(ctx) if takes_ctx else target()
    except CatalogError:
        raise
    except Exception as exc:
        raise _refuse(
            spec,
            f"the catalog factory failed: {type(exc).__name__}: {exc}",
            "fix the factory (it receives a tools.catalog.CatalogContext)",
        ) from None
    if not isinstance(built, Catalog):
        raise _refuse(
            spec,
            f"the factory returned a {type(built).__name__}, not a Catalog",
            "return tools.catalog.Catalog(tools, providers)",
        )
    return built


def load_catalog(
    ctx: CatalogContext, *, plugin: str | None = None, tools_file: Path | None = None
) -> Catalog:
    """The checked catalog from a plugin, a tools file, or both (merged); `CatalogError`
    naming every problem otherwise."""
    parts: list[Catalog] = []
    if plugin:
        parts.append(load_plugin(plugin, ctx))
    if tools_file is not None:
        parts.append(load_tools_file(tools_file, environ=ctx.environ))
    if not parts:
        raise CatalogError(
            [CatalogProblem(None, None, "no tools configured", "set TOOLS or TOOLS_FILE")],
            source="configuration",
        )
    catalog = merge(parts)
    problems = catalog.check()
    if problems:
        raise CatalogError(problems, source=_source(plugin, tools_file))
    for notice in catalog.notices():
        log.warning("%s", notice)
    return catalog


def _source(plugin: str | None, tools_file: Path | None) -> str:
    parts: Sequence[str] = [
        p for p in (f"TOOLS={plugin}" if plugin else "", str(tools_file or "")) if p
    ]
    return " + ".join(parts) or "catalog"
