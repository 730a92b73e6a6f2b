"""FastAPI dependencies as Annotated aliases."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from sqlalchemy.ext.asyncio import AsyncEngine
from starlette.requests import HTTPConnection

from app.calls.events import EventWriter
from app.calls.registry import CallRegistry
from app.runtime import Runtime
from app.settings import Settings
from tools.reconcile import Compensation


def runtime_of(conn: HTTPConnection) -> Runtime:
    runtime: Runtime = conn.app.state.runtime
    return runtime


async def get_runtime(conn: HTTPConnection) -> Runtime:
    return runtime_of(conn)


RuntimeDep = Annotated[Runtime, Depends(get_runtime)]


async def get_settings_dep(runtime: RuntimeDep) -> Settings:
    return runtime.settings


async def get_engine(runtime: RuntimeDep) -> AsyncEngine:
    return runtime.engine


async def get_registry(runtime: RuntimeDep) -> CallRegistry:
    return runtime.registry


async def get_events(runtime: RuntimeDep) -> EventWriter:
    return runtime.events


async def get_compensation(runtime: RuntimeDep) -> Compensation | None:
    """How this process undoes a committed operation (None without the tool pipeline)."""
    tools = runtime.tools
    if tools is None:
        return None
    return Compensation(registry=tools.registry, enqueue=tools.enqueue)


SettingsDep = Annotated[Settings, Depends(get_settings_dep)]
CompensationDep = Annotated[Compensation | None, Depends(get_compensation)]
EngineDep = Annotated[AsyncEngine, Depends(get_engine)]
RegistryDep = Annotated[CallRegistry, Depends(get_registry)]
EventsDep = Annotated[EventWriter, Depends(get_events)]
