"""FastAPI dependencies; the app's collaborators live on ``app.state`` (set by create_app).

They are ``async def`` although they only read an attribute: FastAPI runs a plain ``def``
dependency in its thread pool, two thread hand-offs per ingest request (measured: ~0.4 ms of
the event loop's CPU per request, and a GIL hand-off each)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from fp8guard.service.loop.channel import CommandChannel
from fp8guard.service.settings import Settings
from fp8guard.service.store import Store

__all__ = ["ChannelDep", "SettingsDep", "StoreDep", "get_settings", "get_store"]


async def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_channel(request: Request) -> CommandChannel:
    channel: CommandChannel = request.app.state.commands
    return channel


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ChannelDep = Annotated[CommandChannel, Depends(get_channel)]
