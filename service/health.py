"""GET /healthz: liveness plus a database round trip."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from fp8guard import __version__, wire
from fp8guard.service.deps import StoreDep

__all__ = ["router"]

router = APIRouter(tags=["health"])


class Health(BaseModel):
    status: str
    version: str
    protocol: int
    database: str


@router.get("/healthz", response_model=Health, responses={503: {"description": "database unavailable"}})
def healthz(store: StoreDep) -> Health:
    store.ping()  # raises StorageUnavailable -> 503
    return Health(status="ok", version=__version__, protocol=wire.PROTOCOL_VERSION, database=store.engine.dialect.name)
