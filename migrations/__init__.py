"""Alembic migrations: the source of truth for fp8guard's schema (shipped as fp8guard.migrations)."""
