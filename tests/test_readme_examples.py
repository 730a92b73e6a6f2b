"""The README's "Add your own tools" examples are true: they load, check, and refuse as shown."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# --- the configuration table and the command line cannot drift from the code --------------

CONFIGURATION = README[README.index("## Configuration") : README.index("## How the agent acts")]
# Settings deliberately left out of the table, each with the reason (none today).
NOT_IN_TABLE: dict[str, str] = {}
# Rows in the table that are not our settings, each with the reason.
NOT_OURS: dict[str, str] = {
    "FORWARDED_ALLOW_IPS": "uvicorn reads it itself (proxy headers)",
    "OTEL_EXPORTER_OTLP_ENDPOINT": "the OpenTelemetry SDK reads the OTEL_* variables itself",
    "TMPDIR": "Python's tempfile reads it (where call recorders spool)",
}


def test_every_setting_is_in_the_readmes_configuration_table() -> None:
    from app.settings import Settings

    documented: set[str] = set()
    for row in CONFIGURATION.splitlines():
        if row.startswith("| `"):
            documented |= set(re.findall(r"`([A-Z][A-Z0-9_]+)`", row.split("|")[1]))
    fields = {name.upper() for name in Settings.model_fields}
    assert sorted(fields - documented - set(NOT_IN_TABLE)) == [], "add them to the table"
    assert sorted(documented - fields - set(NOT_OURS)) == [], (
        "the table names settings that do not exist"
    )


def test_the_db_upgrade_examples_name_revisions_that_exist_and_head_only_for_head() -> None:
    from app.db import head_revision

    migrations = ROOT / "app" / "migrations" / "versions"
    known = {p.name[:4] for p in migrations.glob("[0-9][0-9][0-9][0-9]_*.py")}
    examples = re.findall(r"`(database is\s+at [^`]+)`", README)
    assert examples
    for example in examples:
        text = " ".join(example.split())
        for revision in re.findall(r"\b(\d{4})\b", text):
            assert revision in known, (example, sorted(known))
            if f"{revision} (head)" in text:
                assert revision == head_revision(), f"{example!r}: head is {head_revision()}"


# Options whose help is still to be written in app/cli/staff.py (each listed, so a new option
# cannot join them).
NO_HELP_YET: set[tuple[str, str]] = set()


def _commands(parser: argparse.ArgumentParser, path: str = "") -> Iterator[tuple[str, Any]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            described = {a.dest: a.help for a in action._choices_actions}
            for name, sub in action.choices.items():
                assert described.get(name), f"`voice-agent {path} {name}` has no description"
                yield from _commands(sub, f"{path} {name}".strip())


def test_every_cli_option_says_what_it_does_and_its_default() -> None:
    from app.cli.commands import build_parser

    seen = 0
    for path, parser in _commands(build_parser()):
        formatter = parser._get_formatter()
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            name = action.option_strings[-1] if action.option_strings else action.dest
            seen += 1
            text = formatter._get_help_string(action) or ""
            if (path, name) in NO_HELP_YET:
                assert not text, f"`voice-agent {path} {name}` has help now: drop it from the list"
                continue
            assert text.strip(), f"`voice-agent {path} {name}` has no help text"
            takes_value = action.nargs != 0 and not isinstance(action, argparse._VersionAction)
            if takes_value and (action.option_strings or action.nargs == "?"):
                assert "default" in text, f"`voice-agent {path} {name}`: say its default"
        if path:
            assert parser.description, f"`voice-agent {path} --help` has no description"
    assert seen > 30  # the walk saw every subcommand


def test_voice_agent_version_prints_the_package_version() -> None:
    from importlib.metadata import version

    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "--version"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == f"voice-agent {version('voice-agent')}"
