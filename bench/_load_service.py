"""The service a load run of ``bench/load.py`` runs against: started (bench/_serve.py) on a fresh
database, a temporary SQLite file or a PostgreSQL database of its own, dropped after.

With ``--auth`` the service requires tokens: the agents send one ingest token (each run is then
checked against the token that registered it, as in production) and the stored-equals-acked
check reads with an admin token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import uuid
from pathlib import Path
from typing import Any

from bench._load_run import _load
from bench._serve import serve_process

PG_ADMIN_URL = os.environ.get("FP8GUARD_BENCH_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test")
PG_LOAD_DB = f"fp8guard_load_{os.getpid()}"
"""One database per load generator: two runs on one PostgreSQL (side-by-side comparisons) never drop
each other's."""


def _tokens(database_url: str) -> dict[str, str]:
    """An ingest and an admin token in a migrated database, made as an operator would."""
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.kinds import Role
    from fp8guard.service.store import Store, make_engine, upgrade

    engine = make_engine(database_url)
    upgrade(engine)
    engine.dispose()
    store = Store.open(database_url)
    try:
        tag = uuid.uuid4().hex[:6]
        return {role: issue_token(store, name=f"load-{role}-{tag}", role=Role(role))[0] for role in ("ingest", "admin")}
    finally:
        store.close()


def _run(database_url: str, args: argparse.Namespace) -> dict[str, Any]:
    tokens = _tokens(database_url) if args.auth else None
    with serve_process(database_url, auth=args.auth) as served:  # serve migrates the database
        return {**asyncio.run(_load(served.base, args, tokens, served.proc.pid)), "auth": args.auth}


def _sqlite(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        return _run(f"sqlite:///{Path(tmp) / 'load.db'}", args)


def _postgres(args: argparse.Namespace) -> dict[str, Any]:
    import psycopg

    with psycopg.connect(PG_ADMIN_URL, autocommit=True, connect_timeout=3) as admin:
        admin.execute(f"DROP DATABASE IF EXISTS {PG_LOAD_DB} WITH (FORCE)")
        admin.execute(f"CREATE DATABASE {PG_LOAD_DB}")
    try:
        return _run(PG_ADMIN_URL.rsplit("/", 1)[0] + f"/{PG_LOAD_DB}", args)
    finally:
        with psycopg.connect(PG_ADMIN_URL, autocommit=True) as admin:
            admin.execute(f"DROP DATABASE IF EXISTS {PG_LOAD_DB} WITH (FORCE)")
