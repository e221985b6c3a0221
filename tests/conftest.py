"""Shared fixtures. Store and API tests run on SQLite and, when FP8GUARD_TEST_POSTGRES_URL is
set (CI sets it), on real PostgreSQL: each test gets its own schema there."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

# pytest rewrites the assertions of test files only; the shared helpers' then report like the tests'
pytest.register_assert_rewrite("tests.helpers", "tests.fake_te", "tests.agent.interpreted",
                               "tests.agent.remediation_helpers")

POSTGRES_ENV = "FP8GUARD_TEST_POSTGRES_URL"


def postgres_base_url() -> str | None:
    return os.environ.get(POSTGRES_ENV) or None


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A fresh, empty database URL of each backend."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path_factory.mktemp('db') / 'fp8guard.db'}"
        return
    base = postgres_base_url()
    if base is None:
        if os.environ.get("FP8GUARD_REQUIRE_POSTGRES"):
            pytest.fail(f"FP8GUARD_REQUIRE_POSTGRES is set but {POSTGRES_ENV} is not: PostgreSQL is down?")
        pytest.skip(f"PostgreSQL tests need {POSTGRES_ENV} (e.g. postgresql://postgres@127.0.0.1:5432/test)")
    import psycopg

    schema = f"t_{uuid.uuid4().hex[:12]}"
    plain = base.replace("postgresql+psycopg://", "postgresql://")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute(f'CREATE SCHEMA "{schema}"')
    sep = "&" if "?" in base else "?"
    try:
        yield f"{base}{sep}options=-csearch_path%3D{schema}"
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute(f'DROP SCHEMA "{schema}" CASCADE')


@pytest.fixture
def migrated_url(db_url: str) -> str:
    from fp8guard.service.store import make_engine, upgrade

    engine = make_engine(db_url)
    upgrade(engine)
    engine.dispose()
    return db_url


@pytest.fixture
def store(migrated_url: str) -> Iterator[object]:
    from fp8guard.service.store import Store

    s = Store.open(migrated_url)
    yield s
    s.close()


@pytest.fixture
def client(migrated_url: str) -> Iterator[object]:
    from fastapi.testclient import TestClient

    from fp8guard.service import Settings, create_app

    app = create_app(Settings(database_url=migrated_url, auth="off"))
    with TestClient(app) as c:
        yield c
