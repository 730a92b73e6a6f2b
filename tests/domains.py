"""The two domains the engine is tested with, behind one shape, so the same test drives both.

- `restaurant`: the Python plugin (`tools.restaurant.plugin:catalog`) on the demo system of
  record (its own Postgres schema).
- `appointments`: declared entirely in `tools/appointments/appointments.yaml`, on the
  stand-in clinic API (in memory), reached with a bearer token from the environment.

Each catalog is built the way a deployment builds it (the plugin factory with a
`CatalogContext`, the tools file loader with an environment); tests only shorten deadlines.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import yaml

from tests.sor_support import start_sor
from tools.appointments import TOOLS_FILE
from tools.appointments.api import AppointmentsApi
from tools.appointments.api import Faults as ApiFaults
from tools.catalog import Catalog, CatalogContext
from tools.registry import ToolKind
from tools.restaurant import plugin
from tools.restaurant.sor import Faults as SorFaults
from tools.restaurant.sor import SystemOfRecord
from tools.tools_file import load_tools_text

CLINIC_TOKEN = "clinic-token-for-tests"


def clinic_environ(url: str) -> dict[str, str]:
    """The environment a deployment of the appointments tools file needs."""
    return {"APPOINTMENTS_API_URL": url, "APPOINTMENTS_API_TOKEN": CLINIC_TOKEN}


class Backend(Protocol):
    """A running stand-in system of record, as the tests drive and observe it."""

    url: str

    def set_faults(
        self, *, latency_s: float = 0.0, lose_response: int = 0, hang: int = 0
    ) -> None: ...

    def release(self) -> None: ...

    async def booked(self) -> int:
        """Bookings the system of record really made."""
        ...

    def catalog(self, *, deadline_s: float | None = None) -> Catalog:
        """The domain's catalog on this backend (mutation deadlines shortened if asked)."""
        ...


def _short(catalog: Catalog, deadline_s: float | None) -> Catalog:
    if deadline_s is None:
        return catalog
    tools = [
        dataclasses.replace(t, deadline_s=deadline_s) if t.kind is ToolKind.MUTATION else t
        for t in catalog.tools
    ]
    return Catalog(
        tools, catalog.providers, name=catalog.name, instructions=catalog.instructions
    ).checked()


class _Catalogs:
    """The catalogs a backend made, closed when it stops: each holds its providers' HTTP
    clients, whose idle connections would otherwise outlive the test's event loop."""

    def __init__(self) -> None:
        self.made: list[Catalog] = []

    def keep(self, catalog: Catalog) -> Catalog:
        self.made.append(catalog)
        return catalog

    async def aclose(self) -> None:
        for catalog in self.made:
            await catalog.aclose()
        self.made.clear()


class RestaurantBackend:
    def __init__(self, sor: SystemOfRecord) -> None:
        self.sor = sor
        self.url = sor.url
        self.catalogs = _Catalogs()

    def set_faults(self, *, latency_s: float = 0.0, lose_response: int = 0, hang: int = 0) -> None:
        self.sor.set_faults(SorFaults(latency_s=latency_s, lose_response=lose_response, hang=hang))

    def release(self) -> None:
        self.sor.release()

    async def booked(self) -> int:
        return (await self.sor.side_effects()).bookings_inserted

    def catalog(self, *, deadline_s: float | None = None) -> Catalog:
        return self.catalogs.keep(restaurant_catalog(self.url, deadline_s=deadline_s))


def restaurant_catalog(url: str, *, deadline_s: float | None = None) -> Catalog:
    """The restaurant plugin, built as `TOOLS` builds it (deadlines shortened)."""
    return _short(plugin.catalog(CatalogContext(sor_base_url=url)), deadline_s)


class AppointmentsBackend:
    def __init__(self, api: AppointmentsApi) -> None:
        self.api = api
        self.url = api.url
        self.catalogs = _Catalogs()

    def set_faults(self, *, latency_s: float = 0.0, lose_response: int = 0, hang: int = 0) -> None:
        self.api.set_faults(ApiFaults(latency_s=latency_s, lose_response=lose_response, hang=hang))

    def release(self) -> None:
        self.api.release()

    async def booked(self) -> int:
        return self.api.effects().booked

    def catalog(self, *, deadline_s: float | None = None) -> Catalog:
        return self.catalogs.keep(appointments_catalog(self.url, deadline_s=deadline_s))


def appointments_catalog(url: str, *, deadline_s: float | None = None) -> Catalog:
    """The shipped tools file, loaded as a deployment loads it (deadlines shortened)."""
    text = TOOLS_FILE.read_text("utf-8")
    if deadline_s is not None:
        data = yaml.safe_load(text)
        for tool in data["tools"]:
            if tool["kind"] == "mutation":
                tool["deadline_s"] = deadline_s
        text = yaml.safe_dump(data, sort_keys=False)
    return load_tools_text(text, source=str(TOOLS_FILE), environ=clinic_environ(url))


@dataclass(frozen=True)
class Domain:
    """What a booking looks like in one domain."""

    name: str
    book_tool: str
    book_args: dict[str, Any]  # as the model sends them ({tomorrow} is filled by the sim)
    reference_prefix: str
    confirmed_text: str  # what the scripted agent says once it is confirmed
    start: Callable[[str], Any]  # database URL -> async context manager of a Backend
    ledger_args: dict[str, Any]  # normalized arguments, as an admitted operation holds them
    catalog: Callable[..., Catalog]  # (url, deadline_s=...) -> the domain's catalog

    def __str__(self) -> str:
        return self.name


@asynccontextmanager
async def _restaurant(db: str) -> AsyncIterator[Backend]:
    sor = await start_sor(db)
    backend = RestaurantBackend(sor)
    try:
        yield backend
    finally:
        await backend.catalogs.aclose()
        await sor.stop()


@asynccontextmanager
async def _appointments(db: str) -> AsyncIterator[Backend]:
    async with AppointmentsApi(token=CLINIC_TOKEN) as api:
        backend = AppointmentsBackend(api)
        try:
            yield backend
        finally:
            await backend.catalogs.aclose()


RESTAURANT = Domain(
    name="restaurant",
    book_tool="book_table",
    book_args={"date": "{tomorrow}", "time": "20:00", "party_size": 4, "name": "Alex"},
    reference_prefix="BK",
    confirmed_text="The restaurant has confirmed your table.",
    start=_restaurant,
    ledger_args={"date": "2026-12-05", "time": "21:00", "party_size": 4, "name": "Ada"},
    catalog=restaurant_catalog,
)
APPOINTMENTS = Domain(
    name="appointments",
    book_tool="book_appointment",
    book_args={"date": "{tomorrow}", "time": "10:00", "service": "checkup", "name": "Alex"},
    reference_prefix="AP",
    confirmed_text="The clinic has confirmed your appointment.",
    start=_appointments,
    ledger_args={"date": "2026-12-05", "time": "10:00", "service": "checkup", "name": "Ada"},
    catalog=appointments_catalog,
)
DOMAINS = (RESTAURANT, APPOINTMENTS)
BY_NAME = {d.name: d for d in DOMAINS}
