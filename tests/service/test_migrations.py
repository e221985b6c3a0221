"""Migrations are the schema's source of truth: they must equal the models, round-trip, and
the service must refuse a schema that is not at head."""

from __future__ import annotations

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from fp8guard.service import Settings, create_app
from fp8guard.service.errors import SchemaNotAtHead
from fp8guard.service.store import make_engine, upgrade
from fp8guard.service.store.engine import current_revision, downgrade, head_revision
from fp8guard.service.store.models import Base


def _diff(engine: sa.Engine) -> list[object]:
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={"compare_type": True})
        return list(compare_metadata(ctx, Base.metadata))


def test_upgrade_head_on_empty_database_equals_models(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    assert current_revision(engine) == head_revision()
    assert _diff(engine) == []
    engine.dispose()


def test_downgrade_then_upgrade_round_trip(db_url: str) -> None:
    engine = make_engine(db_url)
    upgrade(engine)
    downgrade(engine, "base")
    assert current_revision(engine) is None
    assert set(sa.inspect(engine).get_table_names()) <= {"alembic_version"}
    upgrade(engine)
    assert _diff(engine) == []
    engine.dispose()


def test_service_refuses_schema_not_at_head(db_url: str) -> None:
    with pytest.raises(SchemaNotAtHead, match="fp8guard db upgrade --database-url"):
        create_app(Settings(database_url=db_url, auth="off"))


def test_migrations_do_not_import_models() -> None:
    from pathlib import Path

    import fp8guard.migrations as m

    for path in (Path(m.__file__).parent / "versions").glob("*.py"):
        assert "fp8guard.service" not in path.read_text(), f"{path.name} imports live models"
