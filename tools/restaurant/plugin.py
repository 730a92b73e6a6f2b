"""The restaurant demo as a catalog: `TOOLS=tools.restaurant.plugin:catalog` (the default).

This is what a deployment's own plugin looks like: a factory that receives the
`CatalogContext` and returns a `Catalog` of `ToolSpec`s and the providers they name.
"""

from __future__ import annotations

from tools.catalog import Catalog, CatalogContext
from tools.restaurant.catalog import INSTRUCTIONS, restaurant_tools
from tools.restaurant.client import SorClient
from tools.restaurant.provider import SorProvider

# The standalone `voice-agent sor` listens here when nothing else is said.
DEFAULT_SOR_URL = "http://127.0.0.1:8766"


def catalog(ctx: CatalogContext) -> Catalog:
    """The restaurant's tools on the demo system of record at `ctx.sor_base_url`."""
    client = SorClient(ctx.sor_base_url or DEFAULT_SOR_URL)
    return Catalog(
        restaurant_tools(),
        {"sor": SorProvider(client)},
        name="restaurant",
        instructions=INSTRUCTIONS,
    )
