"""Storage: SQLAlchemy models, migrations helpers and the ``Store`` facade."""

from fp8guard.service.store.engine import make_engine, upgrade, verify_schema
from fp8guard.service.store.repository import Store, Window

__all__ = ["Store", "Window", "make_engine", "upgrade", "verify_schema"]
