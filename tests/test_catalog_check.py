"""The check at start: a catalog that could not run safely is refused, naming tool and fix."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
from pydantic import BaseModel, ConfigDict

from tests.domains import appointments_catalog, restaurant_catalog
from tools.catalog import Catalog, CatalogContext, CatalogError, check_catalog, merge
from tools.ledger import OperationRecord
from tools.loading import load_catalog, load_plugin
from tools.provider import ActionResult, Finding, Outcome
from tools.registry import (
    ConcurrencyLimit,
    OnUnknown,
    OverflowPolicy,
    RetryPolicy,
    ToolKind,
    ToolSpec,
)


class Args(BaseModel):
    model_config = ConfigDict(extra="forbid")
    item: str


class RefArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    order_id: str


class TwoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    order_id: str
    reason: str


class FullProvider:
    """Every hook."""

    async def perform(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float, callback_url: Any = None
    ) -> ActionResult:
        return ActionResult(Outcome.committed)

    async def lookup(self, op: OperationRecord, spec: ToolSpec) -> Finding:
        return Finding("not_found")

    async def read(self, spec: ToolSpec, args: BaseModel) -> Mapping[str, Any]:
        return {}


class WriteOnly:
    """perform, and nothing else (no lookup, no read, no cancel)."""

    async def perform(
        self, op: OperationRecord, spec: ToolSpec, *, timeout_s: float, callback_url: Any = None
    ) -> ActionResult:
        return ActionResult(Outcome.committed)


ORDER = ToolSpec(
    name="place_order",
    description="Place an order for one item. Call only after the caller confirmed it.",
    args_model=Args,
    kind=ToolKind.MUTATION,
    provider_action="shop.place_order",
    needs_confirmation=False,
    provider_idempotent=True,
    retry=RetryPolicy(max_attempts=3),
    reconcile="shop.lookup_by_key",
    compensated_by="cancel_order",
)
CANCEL = ToolSpec(
    name="cancel_order",
    description="Cancel an order by its reference, when the caller asks to cancel it.",
    args_model=RefArgs,
    kind=ToolKind.MUTATION,
    provider_action="shop.cancel_order",
    needs_confirmation=False,
    provider_idempotent=True,
    reconcile="shop.lookup_by_key",
    reference_arg="order_id",
)
STATUS = ToolSpec(
    name="order_status",
    description="Say where an order stands, when the caller asks about an order.",
    args_model=RefArgs,
    kind=ToolKind.READ,
    provider_action="shop.order_status",
)


def catalog(*tools: ToolSpec, providers: dict[str, object] | None = None) -> Catalog:
    return Catalog(tools, providers if providers is not None else {"shop": FullProvider()})


def problems_of(cat: Catalog) -> list[str]:
    return [str(p) for p in check_catalog(cat)]


def test_a_sound_catalog_has_no_problems_and_gets_the_control_tools_it_needs() -> None:
    cat = catalog(dataclasses.replace(ORDER, needs_confirmation=True), CANCEL, STATUS)
    assert problems_of(cat) == []
    assert "confirm_operation" in cat.registry and "verify_pin" not in cat.registry


def test_a_mutation_must_declare_its_confirmation_and_none_is_said() -> None:
    undeclared = dataclasses.replace(CANCEL, needs_confirmation=None)
    [problem] = problems_of(
        catalog(dataclasses.replace(ORDER, needs_confirmation=True), undeclared)
    )
    assert "tool 'cancel_order' (needs_confirmation)" in problem
    assert "must say whether it waits for the caller's yes" in problem
    cat = catalog(dataclasses.replace(ORDER, needs_confirmation=True), CANCEL, STATUS)
    assert cat.unconfirmed_mutations() == ["cancel_order"]
    assert any("cancel_order" in n for n in cat.notices())


def test_the_shipped_domains_pass_the_check() -> None:
    for cat in (restaurant_catalog("http://127.0.0.1:1"), appointments_catalog("http://x:1")):
        assert cat.check() == [], cat.name


@pytest.mark.parametrize(
    ("tools", "providers", "expected"),
    [
        pytest.param(
            [dataclasses.replace(ORDER, provider_action=None), CANCEL],
            None,
            ["tool 'place_order' (provider_action): a mutation needs a provider", "Fix: bind it"],
            id="mutation-without-provider",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, provider_action="warehouse.place_order"), CANCEL],
            None,
            ["no provider named 'warehouse' (the catalog has: shop)"],
            id="unknown-provider",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, provider_action="place_order"), CANCEL],
            None,
            ["does not name a provider", '"<provider>.<action>"'],
            id="binding-without-provider-part",
        ),
        pytest.param(
            [STATUS],
            {"shop": WriteOnly()},
            ["tool 'order_status' (provider_action): provider 'shop' has no read hook"],
            id="read-on-a-provider-without-read",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, provider_idempotent=False), CANCEL],
            None,
            [
                "tool 'place_order' (retry): it retries automatically (max_attempts 3) but the "
                "provider is not idempotent",
                "or set retry max_attempts to 1",
            ],
            id="non-idempotent-with-retries",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, reconcile=None), CANCEL],
            None,
            ["tool 'place_order' (reconcile): nothing can resolve an unknown outcome", "ask_staff"],
            id="no-way-to-reconcile",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, on_unknown=OnUnknown.ASK_STAFF), CANCEL],
            None,
            ["both a lookup and on_unknown: ask_staff"],
            id="lookup-and-ask-staff",
        ),
        pytest.param(
            [dataclasses.replace(CANCEL, reconcile=None, provider_action="w.cancel_order")],
            {"w": WriteOnly(), "shop": FullProvider()},
            ["nothing can resolve an unknown outcome"],
            id="write-only-provider-no-reconcile",
        ),
        pytest.param(
            [dataclasses.replace(CANCEL, reconcile="w.lookup")],
            {"w": WriteOnly(), "shop": FullProvider()},
            ["tool 'cancel_order' (reconcile): provider 'w' has no lookup hook"],
            id="reconcile-provider-without-lookup",
        ),
        pytest.param(
            [ORDER],
            None,
            ["tool 'place_order' (compensated_by): no tool named 'cancel_order'"],
            id="dangling-compensation",
        ),
        pytest.param(
            [ORDER, dataclasses.replace(CANCEL, reference_arg=None)],
            None,
            ["cancel_order does not say which argument takes the reference", "set reference_arg"],
            id="compensation-without-reference-arg",
        ),
        pytest.param(
            [ORDER, dataclasses.replace(CANCEL, args_model=TwoArgs)],
            None,
            ["cancel_order needs more than the reference (reason)"],
            id="compensation-needing-more-arguments",
        ),
        pytest.param(
            [ORDER, dataclasses.replace(CANCEL, kind=ToolKind.READ, reconcile=None)],
            None,
            ["cancel_order is a read, and only a mutation can undo an effect"],
            id="compensation-by-a-read",
        ),
        pytest.param(
            [STATUS, STATUS],
            None,
            ["tool 'order_status' (name): declared twice"],
            id="duplicate-names",
        ),
        pytest.param(
            [dataclasses.replace(STATUS, name="confirm_operation")],
            None,
            ["confirm_operation is the engine's own control tool", "rename the tool"],
            id="clash-with-a-control-tool",
        ),
        pytest.param(
            [dataclasses.replace(STATUS, name="order status!")],
            None,
            ["a tool name is 1 to 64 letters"],
            id="bad-name",
        ),
        pytest.param(
            [dataclasses.replace(STATUS, kind=ToolKind.CONTROL)],
            None,
            ["control tools belong to the engine"],
            id="control-kind-in-a-catalog",
        ),
        pytest.param(
            [
                dataclasses.replace(
                    ORDER,
                    concurrency=ConcurrencyLimit(3, OverflowPolicy.QUEUE),
                    compensated_by=None,
                )
            ],
            None,
            ["counts operations per resource, and none is declared", "queues nothing"],
            id="concurrency-without-resource",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, cancellable_at_provider=True, compensated_by=None)],
            None,
            ["the provider has no cancel hook"],
            id="cancellable-without-cancel-hook",
        ),
        pytest.param(
            [dataclasses.replace(STATUS, needs_confirmation=True)],
            None,
            ["a read changes nothing, so there is nothing to confirm"],
            id="confirmation-on-a-read",
        ),
        pytest.param(
            [dataclasses.replace(STATUS, description="  ")],
            None,
            ["no description"],
            id="no-description",
        ),
        pytest.param(
            [dataclasses.replace(ORDER, retry=RetryPolicy(max_attempts=3, total_deadline_s=1.0))],
            None,
            ["the total deadline (1 s) is shorter than one attempt (5 s)"],
            id="total-deadline-below-one-attempt",
        ),
        pytest.param([], None, ["the catalog offers no tools"], id="empty"),
    ],
)
def test_each_kind_of_mistake_is_refused_naming_the_tool_and_the_fix(
    tools: list[ToolSpec], providers: dict[str, object] | None, expected: list[str]
) -> None:
    cat = catalog(*tools, providers=providers)
    found = problems_of(cat)
    text = "\n".join(found)
    for fragment in expected:
        assert fragment in text, text
    assert all("Fix: " in line for line in found)
    with pytest.raises(CatalogError) as err:
        cat.checked()
    message = str(err.value)
    assert message.splitlines()[0].endswith(
        f"{len(found)} problem" + ("s" if len(found) > 1 else "")
    )
    assert len(message.splitlines()) == len(found) + 1  # one line per problem


def test_merging_catalogs_checks_names_across_them_and_refuses_a_provider_clash() -> None:
    a = catalog(STATUS)
    b = Catalog([STATUS], {"other": FullProvider()})
    merged = merge([a, b])
    assert any("declared twice" in str(p) for p in merged.check())
    with pytest.raises(CatalogError, match="declare a provider named 'shop'"):
        merge([a, Catalog([], {"shop": FullProvider()})])


# --- TOOLS=package.module:name ----------------------------------------------------------------


@pytest.fixture
def plugin_module(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package outside the repository, importable for this test only."""
    pkg = tmp_path / "shop_plugin_for_tests"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "from tools.catalog import Catalog\n"
        "from tests.test_catalog_check import STATUS, FullProvider\n"
        "seen = []\n"
        "def catalog(ctx):\n"
        "    seen.append(ctx)\n"
        "    return Catalog([STATUS], {'shop': FullProvider()}, name='shop')\n"
        "def no_ctx():\n"
        "    return Catalog([STATUS], {'shop': FullProvider()}, name='shop0')\n"
        "ready = Catalog([STATUS], {'shop': FullProvider()}, name='ready')\n"
        "def broken(ctx):\n"
        "    raise RuntimeError('no SHOP_URL')\n"
        "def wrong(ctx):\n"
        "    return [1, 2]\n"
        "number = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "shop_plugin_for_tests"
    sys.modules.pop("shop_plugin_for_tests", None)


def test_a_plugin_is_a_catalog_or_a_factory_given_the_context(plugin_module: str) -> None:
    ctx = CatalogContext(tenant_id="t9", sor_base_url="http://sor")
    assert load_plugin(plugin_module, ctx).name == "shop"  # ":catalog" is the default name
    import importlib

    assert importlib.import_module(plugin_module).seen[-1] is ctx
    assert load_plugin(f"{plugin_module}:no_ctx", ctx).name == "shop0"
    assert load_plugin(f"{plugin_module}:ready", ctx).name == "ready"
    assert load_catalog(ctx, plugin=f"{plugin_module}:ready").registry.names() == ["order_status"]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_such_package_xyz.tools:catalog", "no module named 'no_such_package_xyz'"),
        ("{mod}:missing", "has no 'missing'"),
        ("{mod}:number", "number is a int, not a Catalog or a factory"),
        ("{mod}:broken", "the catalog factory failed: RuntimeError: no SHOP_URL"),
        ("{mod}:wrong", "the factory returned a list, not a Catalog"),
        ("not a path", "not an import path"),
    ],
)
def test_a_plugin_that_cannot_load_is_refused_in_one_line(
    plugin_module: str, spec: str, expected: str
) -> None:
    spec = spec.format(mod=plugin_module)
    with pytest.raises(CatalogError) as err:
        load_plugin(spec, CatalogContext())
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and expected in lines[1] and f"TOOLS={spec}" in lines[1]
    assert "Fix: " in lines[1]
