"""The layering holds in the real import graph: the engine knows no domain, `telephony` and
`tools` never import `app`, and no product module imports the stand-ins.

Every module of `app`, `telephony` and `tools` is parsed (imports inside functions
included, relative imports resolved, `from pkg import module` resolved to the module, and
`importlib.import_module("literal")` counted), not grepped for one name.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("app", "telephony", "tools")
SIM = "telephony.sim"
# Entry points that run the stand-ins or the demo on purpose (the offline mode is a feature):
# the CLI's `simulator`, `call`, `sor` and `demo` commands; the demos themselves; and `serve`,
# which starts the simulator without OPENAI_API_KEY and the demo SOR for the demo catalog.
STAND_IN_USERS = frozenset({"app.cli", "app.demo", "app.demo_openai_sip", "app.server"})


@dataclass(frozen=True, slots=True)
class Edge:
    importer: str
    imported: str
    line: int

    def __str__(self) -> str:
        return f"{self.importer} imports {self.imported} (line {self.line})"


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            if "migrations" in path.parts:
                continue  # Alembic's scripts run under Alembic, not imported by the service
            found[module_name(root, path)] = path
    return found


def _resolve(known: set[str], base: str, name: str | None) -> str:
    """`from base import name`: the submodule when it is one, else the package."""
    if name and f"{base}.{name}" in known:
        return f"{base}.{name}"
    return base


def imports(root: Path, known: set[str], module: str, path: Path) -> Iterator[Edge]:
    tree = ast.parse(path.read_text("utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Edge(module, alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".")
                keep = len(parts) - node.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                yield Edge(module, _resolve(known, base, alias.name), node.lineno)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            yield Edge(module, node.args[0].value, node.lineno)


def graph(root: Path) -> list[Edge]:
    found = modules(root)
    known = set(found)
    return [edge for mod, path in found.items() for edge in imports(root, known, mod, path)]


def domain_packages(root: Path) -> set[str]:
    """Subpackages of `tools/`: each is a domain beside the engine."""
    return {f"tools.{p.name}" for p in (root / "tools").iterdir() if (p / "__init__.py").is_file()}


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(root: Path) -> list[str]:
    edges = graph(root)
    domains = domain_packages(root)
    bad: list[str] = []
    for e in edges:
        importer_domain = next((d for d in domains if within(e.importer, d)), None)
        imported_domain = next((d for d in domains if within(e.imported, d)), None)
        engine = within(e.importer, "tools") and importer_domain is None
        if engine and imported_domain is not None:
            bad.append(f"the engine imports a domain: {e}")
        if importer_domain and imported_domain and importer_domain != imported_domain:
            bad.append(f"a domain imports another domain: {e}")
        if within(e.importer, "tools") or within(e.importer, "telephony"):
            if within(e.imported, "app"):
                bad.append(f"telephony/tools import app: {e}")
        product = not within(e.importer, SIM) and e.importer not in STAND_IN_USERS
        if product and within(e.imported, SIM):
            bad.append(f"a product module imports a stand-in: {e}")
        if within(e.importer, "app") and e.importer not in STAND_IN_USERS and imported_domain:
            bad.append(f"the wiring imports a domain (load it by TOOLS instead): {e}")
    return bad


def test_the_engine_imports_no_domain_and_the_layers_point_one_way() -> None:
    assert {"tools.restaurant", "tools.appointments"} <= domain_packages(ROOT)
    assert violations(ROOT) == []


def test_the_graph_is_the_real_one() -> None:
    # The checker sees what is there: the wiring loads the engine, the demo entry points
    # reach the domain and the stand-ins, domains use the engine.
    edges = {(e.importer, e.imported) for e in graph(ROOT)}
    assert ("app.tool_wiring", "tools.loading") in edges
    assert ("app.server", "tools.restaurant.sor") in edges  # inside a function
    assert ("app.demo", "telephony.sim.simulator") in edges
    assert ("tools.restaurant.plugin", "tools.catalog") in edges
    assert ("tools.tools_file", "tools.http_provider") in edges


@pytest.mark.parametrize(
    ("where", "source", "expected"),
    [
        (
            "tools/results.py",
            "from tools.restaurant import catalog\n",
            "the engine imports a domain",
        ),
        ("tools/results.py", "def f():\n    from .restaurant.sor import Faults\n", "engine"),
        ("tools/results.py", "import tools.appointments.api\n", "the engine imports a domain"),
        (
            "tools/results.py",
            "import importlib\nimportlib.import_module('tools.restaurant.plugin')\n",
            "the engine imports a domain",
        ),
        ("tools/ledger.py", "from app.settings import Settings\n", "telephony/tools import app"),
        ("telephony/bridge/bridge.py", "from app import db\n", "telephony/tools import app"),
        ("telephony/bridge/bridge.py", "from telephony.sim import vad\n", "imports a stand-in"),
        ("app/main.py", "from telephony.sim.simulator import X\n", "imports a stand-in"),
        ("app/worker.py", "from tools.restaurant.plugin import catalog\n", "the wiring imports"),
        ("tools/restaurant/sor.py", "from tools.appointments import api\n", "another domain"),
    ],
)
def test_the_check_catches_a_planted_import(
    tmp_path: Path, where: str, source: str, expected: str
) -> None:
    # A copy of the packages with one import added must fail the same check.
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "migrations" in path.parts:
                continue
            target = tmp_path / path.relative_to(ROOT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(path.read_text("utf-8"))
    planted = tmp_path / where
    planted.write_text(planted.read_text("utf-8") + "\n" + source)
    found = violations(tmp_path)
    assert found and all(expected in v or "engine" in v for v in found), found
    assert any(expected in v for v in found), found


def circles(root: Path, package: str) -> list[list[str]]:
    """The import circles among `package`'s modules (strongly connected parts of more than
    one module), counting imports inside functions and under TYPE_CHECKING: such an import
    holds a circle apart at run time, it does not open it."""
    adjacent: dict[str, set[str]] = {}
    for e in graph(root):
        if within(e.importer, package) and within(e.imported, package):
            if e.importer != e.imported:
                adjacent.setdefault(e.importer, set()).add(e.imported)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(adjacent.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            part: list[str] = []
            while True:
                top = stack.pop()
                part.append(top)
                if top == node:
                    break
            if len(part) > 1:
                found.append(sorted(part))

    for node in sorted(adjacent):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_among_the_tools_modules() -> None:
    # tools.ledger imports tools.deliveries and tools.webhooks; the records they pass live in
    # tools.ledger_models, so nothing imports back, not even under TYPE_CHECKING.
    assert circles(ROOT, "tools") == []


@pytest.mark.parametrize(
    "source",
    [
        "from tools.ledger import OperationRecord\n",
        "def f():\n    from tools import ledger\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tools.ledger import X\n",
    ],
)
def test_the_circle_check_catches_a_planted_circle(tmp_path: Path, source: str) -> None:
    for path in (ROOT / "tools").rglob("*.py"):
        target = tmp_path / path.relative_to(ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text("utf-8"))
    for package in ("app", "telephony"):
        (tmp_path / package).mkdir()
    planted = tmp_path / "tools" / "deliveries.py"
    planted.write_text(planted.read_text("utf-8") + "\n" + source)
    assert any({"tools.ledger", "tools.deliveries"} <= set(c) for c in circles(tmp_path, "tools"))
