"""FastAPI dependencies; the app's collaborators live on ``app.state`` (set by create_app)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from fp8guard.service.settings import Settings
from fp8guard.service.store import Store

__all__ = ["SettingsDep", "StoreDep", "get_settings", "get_store"]


def get_store(request: Request) -> Store:
    store: Store = request.app.state.store
    return store


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


StoreDep = Annotated[Store, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
