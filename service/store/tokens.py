"""Persistence of API tokens, browser sessions and run ownership. Only SHA-256 digests of secrets
are stored; what a token may do is decided in ``service/auth``, never here."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa

from fp8guard.service.domain import TokenRecord
from fp8guard.service.errors import Conflict, NotFound
from fp8guard.service.kinds import AuditEventKind, Role
from fp8guard.service.store.models import SqlEvent, SqlRun, SqlRunRank, SqlSession, SqlToken
from fp8guard.service.store.series_reader import lead_rank

__all__ = ["audit_guard", "delete_session", "insert_session", "insert_token", "revoke_token", "run_owner", "session_token",
           "token_by_hash", "token_list"]


def _record(row: SqlToken) -> TokenRecord:
    return TokenRecord(id=row.id, name=row.name, role=Role(row.role), run_prefix=row.run_prefix, hint=row.hint,
                       created_at=row.created_at, revoked_at=row.revoked_at)


def insert_token(session: sa.orm.Session, *, name: str, role: Role, run_prefix: str | None, secret_hash: str,
                 hint: str, now: datetime) -> TokenRecord:
    live = session.scalar(sa.select(SqlToken.id).where(SqlToken.name == name, SqlToken.revoked_at.is_(None)))
    if live is not None:
        raise Conflict(f"a token named {name!r} exists; revoke it first or pick another name", loc=("name",))
    row = SqlToken(name=name, role=role.value, run_prefix=run_prefix, secret_hash=secret_hash, hint=hint,
                   created_at=now)
    session.add(row)
    session.flush()
    return _record(row)


def token_list(session: sa.orm.Session, *, include_revoked: bool) -> list[TokenRecord]:
    query = sa.select(SqlToken).order_by(SqlToken.id)
    if not include_revoked:
        query = query.where(SqlToken.revoked_at.is_(None))
    return [_record(r) for r in session.scalars(query)]


def revoke_token(session: sa.orm.Session, name: str, now: datetime) -> TokenRecord:
    """Revoke the live token of that name; its sessions end with it."""
    row = session.scalar(sa.select(SqlToken).where(SqlToken.name == name, SqlToken.revoked_at.is_(None)))
    if row is None:
        raise NotFound(f"no live token named {name!r}", loc=("name",))
    row.revoked_at = now
    session.execute(sa.delete(SqlSession).where(SqlSession.token_id == row.id))
    return _record(row)


def token_by_hash(conn: sa.Connection, secret_hash: str) -> TokenRecord | None:
    """The live token with this digest, or None (unknown or revoked)."""
    row = conn.execute(sa.select(SqlToken.__table__).where(SqlToken.secret_hash == secret_hash,
                                                           SqlToken.revoked_at.is_(None))).first()
    return None if row is None else _from_row(row)


def _from_row(row: sa.Row[Any]) -> TokenRecord:
    """A token read through Core (the lookups behind every request)."""
    m = row._mapping
    return TokenRecord(id=int(m["id"]), name=str(m["name"]), role=Role(m["role"]), run_prefix=m["run_prefix"],
                       hint=str(m["hint"]), created_at=m["created_at"], revoked_at=m["revoked_at"])


def insert_session(session: sa.orm.Session, *, secret_hash: str, token_id: int, now: datetime,
                   expires_at: datetime) -> None:
    session.execute(sa.delete(SqlSession).where(SqlSession.expires_at < now))  # expired ones, as we pass
    session.add(SqlSession(secret_hash=secret_hash, token_id=token_id, created_at=now, expires_at=expires_at))


def session_token(conn: sa.Connection, secret_hash: str, now: datetime) -> TokenRecord | None:
    """The live token behind an unexpired session, or None."""
    row = conn.execute(
        sa.select(SqlToken.__table__)
        .join(SqlSession, SqlSession.token_id == SqlToken.id)
        .where(SqlSession.secret_hash == secret_hash, SqlSession.expires_at > now, SqlToken.revoked_at.is_(None))
    ).first()
    return None if row is None else _from_row(row)


def delete_session(session: sa.orm.Session, secret_hash: str) -> None:
    session.execute(sa.delete(SqlSession).where(SqlSession.secret_hash == secret_hash))


def run_owner(conn: sa.Connection, run_id: str) -> tuple[bool, int | None]:
    """(exists, owner token id) of a run."""
    row = conn.execute(sa.select(SqlRun.owner_token_id).where(SqlRun.run_id == run_id)).first()
    return (False, None) if row is None else (True, row[0])


def audit_guard(conn: sa.Connection, run_pk: int, old: dict[str, Any] | None, new: dict[str, Any] | None,
                actor: str, now: datetime) -> None:
    """A ``guard_changed`` event at the run's current step on its lead rank (who, old -> new)."""
    progress = conn.execute(sa.select(SqlRunRank.rank, SqlRunRank.last_step, SqlRunRank.last_segment)
                            .where(SqlRunRank.run_pk == run_pk, SqlRunRank.rank == lead_rank(run_pk))).first()
    rank, step, segment = (0, None, 0) if progress is None else (progress[0], progress[1], progress[2])
    conn.execute(sa.insert(SqlEvent).values(run_pk=run_pk, rank=rank, segment=segment, step=step,
                                            time=now.timestamp(), kind=AuditEventKind.GUARD_CHANGED.value,
                                            data={"by": actor, "old": old, "new": new}))
