"""The README's "Add your own tools" examples are true: they load, check, and refuse as shown."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tools.catalog import CatalogContext, CatalogError
from tools.loading import load_plugin
from tools.registry import ToolKind
from tools.tools_file import load_tools_text

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text("utf-8")
SECTION = README[README.index("## Add your own tools") : README.index("## A real Twilio number")]
ENV = {"CLINIC_API_URL": "https://api.example.com", "CLINIC_API_TOKEN": "t0ken"}


def blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", SECTION, flags=re.DOTALL)


def test_the_tools_file_example_loads_and_passes_the_check() -> None:
    (yaml_text,) = blocks("yaml")
    catalog = load_tools_text(yaml_text, source="my-tools.yaml", environ=ENV)
    book = catalog.registry.get("book_appointment")
    assert book.kind is ToolKind.MUTATION and book.provider_idempotent and book.needs_confirmation
    assert book.reconcile == "clinic.lookup" and book.provider_label == "the clinic"
    assert "confirm_operation" in catalog.registry


def test_the_refusal_shown_is_what_the_example_gets_when_it_lies_about_idempotency() -> None:
    (yaml_text,) = blocks("yaml")
    shown = next(
        line.strip() for line in SECTION.splitlines() if line.strip().startswith("my-tools.yaml:")
    )
    with pytest.raises(CatalogError) as err:
        load_tools_text(
            yaml_text.replace("idempotent: true", "idempotent: false"),
            source="my-tools.yaml",
            environ=ENV,
        )
    assert [str(p) for p in err.value.problems] == [shown]


def test_the_python_plugin_example_loads_by_import_path_and_passes_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (code,) = [b for b in blocks("python") if "def catalog(ctx" in b]
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    (tmp_path / "mypkg" / "tools.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        catalog = load_plugin(
            "mypkg.tools:catalog", CatalogContext(environ={"REWARDS_API_URL": "http://x"})
        )
        assert catalog.check() == []
        assert catalog.registry.names() == ["redeem_points", "confirm_operation"]
    finally:
        for name in [m for m in sys.modules if m == "mypkg" or m.startswith("mypkg.")]:
            del sys.modules[name]
