"""Tools files: HTTP tools declared without Python, and every mistake refused at its line."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools.catalog import CatalogContext, CatalogError
from tools.loading import load_catalog
from tools.registry import OnUnknown, ToolKind
from tools.tools_file import load_tools_file, load_tools_text
from tools.tools_file_model import tools_file_schema

ROOT = Path(__file__).resolve().parent.parent
ENV = {"SHOP_URL": "http://127.0.0.1:9", "SHOP_TOKEN": "s3cret-token"}

BASE = """\
version: 1
name: shop
providers:
  shop:
    base_url: ${ENV:SHOP_URL}
    headers:
      Authorization: Bearer ${ENV:SHOP_TOKEN}
tools:
  - name: order_status
    kind: read
    description: Say where an order stands, when the caller asks about one.
    arguments:
      type: object
      properties:
        order_id: {type: string, maxLength: 20}
      required: [order_id]
    request:
      path: /orders/{args.order_id}
    result:
      fields: [id, status]
      message: "Order {id} is {status}."
  - name: place_order
    kind: mutation
    description: Place an order, only after the caller confirmed the item and quantity.
    arguments:
      type: object
      properties:
        item: {type: string}
        quantity: {type: integer, minimum: 1}
      required: [item, quantity]
    confirmation: true
    limits:
      - {argument: quantity, max: 5}
    idempotent: true
    retry: {max_attempts: 3}
    request:
      method: POST
      path: /orders
      body: {item: "{args.item}", quantity: "{args.quantity}", key: "{idempotency_key}"}
    outcome:
      reference: id
    lookup:
      path: /orders/by-key/{idempotency_key}
      applied: {status: [200]}
      not_found: {status: [404]}
      reference: id
    compensated_by: cancel_order
  - name: cancel_order
    kind: mutation
    confirmation: none
    description: Cancel an order by its reference, when the caller asks to cancel it.
    arguments:
      type: object
      properties:
        order_id: {type: string}
      required: [order_id]
    reference_arg: order_id
    idempotent: true
    request:
      method: POST
      path: /orders/{args.order_id}/cancel
    lookup:
      path: /orders/{args.order_id}
      applied: {status: [200], field: status, equals: [cancelled]}
      not_found: {status: [200], field: status, equals: [open]}
"""


def test_a_valid_file_becomes_a_catalog_of_http_tools() -> None:
    catalog = load_tools_text(BASE, source="shop.yaml", environ=ENV)
    assert catalog.name == "shop" and list(catalog.providers) == ["shop"]
    place = catalog.registry.get("place_order")
    assert place.kind is ToolKind.MUTATION and place.provider_idempotent
    assert place.provider_action == "shop.place_order" and place.reconcile == "shop.lookup"
    assert place.needs_confirmation and place.retry.max_attempts == 3
    assert place.on_unknown is OnUnknown.RECONCILE and place.origin == "shop.yaml:22"
    assert "confirm_operation" in catalog.registry  # the engine adds what the tools need
    schema = place.definition()["parameters"]
    assert schema["required"] == ["item", "quantity"] and schema["additionalProperties"] is False
    # Schema-valid is not allowed: the limit is policy, refused with a speakable reason.
    args = place.parse('{"item": "tea", "quantity": 9}')
    problem = place.preconditions[0](args, _ctx())
    assert problem == "The quantity can be at most 5."
    # Secrets come from the environment and never show in what the engine prints.
    assert "s3cret" not in repr(catalog.providers["shop"])


def _ctx():  # type: ignore[no-untyped-def]
    from datetime import UTC, datetime

    from tools.registry import PreconditionContext

    return PreconditionContext(now=datetime.now(UTC), limits={})


def _mistake(old: str, new: str, *more: tuple[str, str]) -> tuple[str, int]:
    """BASE with edits; the offending line is the one marked `#<`."""
    text = BASE
    for before, after in ((old, new), *more):
        assert before in text, before
        text = text.replace(before, after, 1)
    marked = [n for n, line in enumerate(text.splitlines(), 1) if "#<" in line]
    assert len(marked) == 1
    return text, marked[0]


MISTAKES: dict[str, tuple[Any, ...]] = {
    # PyYAML notices these at the next token, a line below; the mistake is where they begin.
    "yaml-unclosed-list": (
        "      required: [order_id]\n    request:",
        "      required: [order_id  #<\n    request:",
        "not valid YAML",
    ),
    "yaml-key-without-colon": (
        "    kind: read\n",
        "    kind read  #<\n",
        "could not find expected ':'",
    ),
    "yaml-bad-indent": (
        "    kind: read\n",
        "   kind: read  #<\n",
        "not valid YAML",
    ),
    "duplicate-key": (
        "    confirmation: true\n",
        "    confirmation: true\n    confirmation: false  #<\n",
        "duplicate key 'confirmation'",
    ),
    "misspelt-field": (
        "    idempotent: true\n    retry",
        "    idempotnt: true  #<\n    retry",
        "Extra inputs",
    ),
    # A missing field has no line of its own: the tool that lacks it is named.
    "missing-field": (
        "  - name: order_status\n",
        "  - name: order_status  #<\n",
        "(tools[0].request): Field required",
        ("    request:\n      path: /orders/{args.order_id}\n    result:", "    result:"),
    ),
    # A mutation that says nothing about confirmation is not sent at once: it is refused.
    "mutation-without-confirmation": (
        "  - name: cancel_order\n",
        "  - name: cancel_order  #<\n",
        "must say whether it waits for the caller's yes",
        ("    confirmation: none\n", ""),
    ),
    "unknown-confirmation": (
        "    confirmation: none\n",
        "    confirmation: maybe  #<\n",
        "confirmation",
    ),
    "bad-kind": ("    kind: read\n", "    kind: lookup  #<\n", "'read' or 'mutation'"),
    "unquoted-time": (
        "      - {argument: quantity, max: 5}\n",
        "      - {argument: quantity, between: [09:00, 17:00]}  #<\n",
        "quote it",
    ),
    "unsupported-schema-keyword": (
        "        quantity: {type: integer, minimum: 1}\n",
        "        quantity: {type: integer, oneOf: []}  #<\n",
        "unsupported schema keyword 'oneOf'",
    ),
    "nested-object-argument": (
        "        item: {type: string}\n",
        "        item: {type: object}  #<\n",
        "nested objects are not supported",
    ),
    "template-names-no-argument": (
        '      body: {item: "{args.item}"',
        '      body: {item: "{args.itme}"  #<\n        ',
        "{args.itme} names no argument (arguments: item, quantity)",
    ),
    "unknown-placeholder": (
        "      path: /orders/{args.order_id}\n    result:",
        "      path: /orders/{user_id}  #<\n    result:",
        "unknown placeholder {user_id}",
    ),
    "read-knows-only-its-arguments": (
        "      path: /orders/{args.order_id}\n    result:",
        "      path: /orders/{idempotency_key}  #<\n    result:",
        "a read knows only its arguments",
    ),
    "malformed-placeholder": (
        "      path: /orders/{args.order_id}/cancel",
        "      path: /orders/{args.order_id/cancel  #<",
        "bad placeholder",
    ),
    "unknown-provider": (
        "      method: POST\n      path: /orders\n",
        "      provider: warehouse  #<\n      method: POST\n      path: /orders\n",
        "no provider named 'warehouse'",
    ),
    "secret-in-the-file": (
        "      Authorization: Bearer ${ENV:SHOP_TOKEN}",
        "      Authorization: Bearer s3cret-token  #<",
        "looks like a secret written into the file",
    ),
    "unset-environment-variable": (
        "    base_url: ${ENV:SHOP_URL}",
        "    base_url: ${ENV:SHOP_API_URL}  #<",
        "environment variable SHOP_API_URL is not set",
    ),
    "environment-outside-a-provider": (
        '      body: {item: "{args.item}"',
        '      body: {item: "${ENV:SHOP_TOKEN}"  #<\n        ',
        "environment values (${...}) belong on a provider",
    ),
    "base-url-not-http": (
        "    base_url: ${ENV:SHOP_URL}",
        "    base_url: ftp://example.com  #<",
        "base_url must be an http:// or https:// URL",
    ),
    "retries-without-idempotency": (
        "    idempotent: true\n    retry: {max_attempts: 3}\n",
        "    idempotent: false\n    retry: {max_attempts: 3}  #<\n",
        "it retries automatically (max_attempts 3) but the provider is not idempotent",
    ),
    "no-way-to-reconcile": (
        "    lookup:\n      path: /orders/{args.order_id}\n"
        "      applied: {status: [200], field: status, equals: [cancelled]}\n"
        "      not_found: {status: [200], field: status, equals: [open]}\n",
        "    on_unknown: reconcile  #<\n",
        "nothing can resolve an unknown outcome",
    ),
    "lookup-and-ask-staff": (
        "    compensated_by: cancel_order\n",
        "    compensated_by: cancel_order\n    on_unknown: ask_staff  #<\n",
        "both a lookup and on_unknown: ask_staff",
    ),
    "dangling-compensation": (
        "    compensated_by: cancel_order\n",
        "    compensated_by: refund_order  #<\n",
        "no tool named 'refund_order'",
    ),
    "duplicate-tool": (
        "  - name: cancel_order\n",
        "  - name: order_status  #<\n",
        "declared twice (first at line 9)",
    ),
    "control-tool-name": (
        "  - name: cancel_order\n",
        "  - name: verify_pin  #<\n",
        "verify_pin is the engine's own control tool",
    ),
    "message-outside-the-fields": (
        '      message: "Order {id} is {status}."',
        '      message: "Order {id} is {state}."  #<',
        "{state} is not one of result.fields",
    ),
    "limit-on-no-argument": (
        "      - {argument: quantity, max: 5}\n",
        "      - {argument: qty, max: 5}  #<\n",
        "'qty' is not one of its arguments",
    ),
    "limit-of-the-wrong-kind": (
        "      - {argument: quantity, max: 5}\n",
        "      - {argument: item, max: 5}  #<\n",
        "max/min limit a number, and item is a string",
    ),
    "lookup-on-a-read": (
        "    result:\n      fields: [id, status]\n",
        "    lookup:  #<\n      path: /x\n      applied: {status: [200]}\n"
        "      not_found: {status: [404]}\n    result:\n      fields: [id, status]\n",
        "a read has no lookup",
    ),
    "empty-match-rule": (
        "      not_found: {status: [404]}\n      reference: id",
        "      not_found: {}  #<\n      reference: id",
        "say which answers match",
    ),
    "not-a-status-code": (
        "      applied: {status: [200]}\n",
        "      applied: {status: [2000]}  #<\n",
        "2000 is not an HTTP status code",
    ),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_each_kind_of_mistake_is_refused_with_the_line_that_holds_it(case: str) -> None:
    old, new, expected, *more = MISTAKES[case]
    text, line = _mistake(old, new, *more)
    with pytest.raises(CatalogError) as err:
        load_tools_text(text, source="shop.yaml", environ=ENV)
    problems = [str(p) for p in err.value.problems]
    hits = [p for p in problems if expected in p]
    assert hits, problems
    assert any(p.startswith(f"shop.yaml:{line}:") for p in hits), (line, problems)
    assert all("Fix: " in p for p in problems)


def test_a_file_that_cannot_be_read_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="cannot read it"):
        load_tools_file(tmp_path / "missing.yaml", environ=ENV)
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(CatalogError, match="a tools file is a mapping"):
        load_tools_file(tmp_path / "list.yaml", environ=ENV)


def test_the_published_json_schema_is_the_checked_in_one() -> None:
    checked_in = json.loads((ROOT / "tools" / "tools-file.schema.json").read_text("utf-8"))
    assert checked_in == tools_file_schema()
    out = subprocess.run(
        [sys.executable, "-m", "app.cli", "tools", "schema"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == checked_in


@pytest.mark.parametrize("command", [["serve"], ["worker"], ["tools", "check"]])
def test_the_service_refuses_to_start_on_a_bad_tools_file_naming_the_line(
    tmp_path: Path, command: list[str]
) -> None:
    text, line = _mistake(
        "    idempotent: true\n    retry: {max_attempts: 3}\n",
        "    idempotent: false\n    retry: {max_attempts: 3}  #<\n",
    )
    path = tmp_path / "shop.yaml"
    path.write_text(text)
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("TOOLS", "SOR_"))},
        **ENV,
        "TOOLS_FILE": str(path),
        # Never reached: the catalog is refused before the database is opened.
        "DATABASE_URL": "postgresql://nobody@127.0.0.1:1/none",
        "PYTHONPATH": str(ROOT),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "app.cli", *command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [x for x in proc.stderr.splitlines() if x.strip()]
    assert lines[0].startswith("voice-agent: refusing to start:")
    assert any(x.strip().startswith(f"{path}:{line}: tool 'place_order'") for x in lines), lines
    assert "s3cret" not in proc.stderr + proc.stdout


def test_a_mutation_without_confirmation_is_allowed_but_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "shop.yaml"
    path.write_text(BASE, "utf-8")
    with caplog.at_level(logging.WARNING, logger="tools.loading"):
        catalog = load_catalog(CatalogContext(environ=ENV), tools_file=path)
    # The start-up log names the tools that change things without the caller's yes.
    [logged] = [r.getMessage() for r in caplog.records if "without the caller" in r.getMessage()]
    assert "cancel_order" in logged
    assert catalog.registry.get("place_order").needs_confirmation is True
    assert catalog.registry.get("cancel_order").needs_confirmation is False
    assert catalog.unconfirmed_mutations() == ["cancel_order"]
    [notice] = catalog.notices()
    assert "without the caller's confirmation" in notice and "cancel_order" in notice
    assert "place_order" not in notice
    assert logged == notice
