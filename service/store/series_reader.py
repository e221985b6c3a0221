"""Queries. Every series is bucketed server-side with extremes kept (see ``buckets``).

Rollbacks start a new *segment* at an earlier step. Unless a segment is asked for, queries
show the effective timeline: each step comes from the newest segment that covers it, so
the abandoned stretch of an older segment is hidden there (ask for that segment to see it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import numpy as np
import sqlalchemy as sa

from fp8guard.service.domain import (
    EventRecord,
    RankProgress,
    RunDetail,
    RunSummary,
    ScalarSeries,
    TensorInfo,
    TensorMatrix,
    TensorSeries,
)
from fp8guard.service.errors import InvalidPayload, NotFound
from fp8guard.service.store import buckets
from fp8guard.service.store.models import (
    SqlEvent,
    SqlRun,
    SqlRunRank,
    SqlSegment,
    SqlStat,
    SqlStep,
    SqlTensor,
    SqlTensorSeries,
)
from fp8guard.wire import STEP_FIELDS

__all__ = [
    "Window",
    "event_list",
    "run_detail",
    "run_pk",
    "run_summaries",
    "scalar_series",
    "tensor_list",
    "tensor_matrix",
    "tensor_series",
]


@dataclass(frozen=True, slots=True)
class Window:
    """What part of a run a query covers."""

    rank: int | None = None
    """None: the run's lead rank (:func:`lead_rank`: its lowest reporting rank, 0 in most runs)."""
    start: int | None = None
    end: int | None = None
    width: int = 2000
    segment: int | None = None


def run_pk(conn: sa.Connection, run_id: str) -> int:
    pk = conn.scalar(sa.select(SqlRun.id).where(SqlRun.run_id == run_id))
    if pk is None:
        raise NotFound(f"run {run_id!r} not found", loc=("path", "run_id"))
    return int(pk)


def _summary_query() -> sa.Select[Any]:
    agg = (
        sa.select(
            SqlRunRank.run_pk,
            sa.func.max(SqlRunRank.last_step).label("last_step"),
            sa.func.sum(SqlRunRank.samples).label("samples"),
            sa.func.max(SqlRunRank.updated_at).label("active_at"),
        )
        .group_by(SqlRunRank.run_pk)
        .subquery()
    )
    lead = sa.orm.aliased(SqlRunRank)
    # Ingest touches only run_ranks (one row lock per rank), so activity time is derived here.
    active = sa.func.coalesce(agg.c.active_at, SqlRun.updated_at).label("active_at")
    return (
        sa.select(SqlRun, agg.c.last_step, agg.c.samples, lead.last_loss, lead.last_loss_nan, active)
        .outerjoin(agg, agg.c.run_pk == SqlRun.id)
        .outerjoin(lead, (lead.run_pk == SqlRun.id) & (lead.rank == lead_rank(SqlRun.id)))
    )


def lead_rank(run_pk: Any) -> Any:
    """The run's lead rank as a correlated scalar subquery: its lowest reporting rank. Rank 0 in
    every run but one whose agents' ``report_ranks`` leave it out (the last pipeline stage, which
    holds the loss, say); the run's latest loss, saturation and harm gap are that rank's."""
    ranks = sa.orm.aliased(SqlRunRank)
    return sa.select(sa.func.min(ranks.rank)).where(ranks.run_pk == run_pk).scalar_subquery()


def _aware(value: datetime) -> datetime:
    """SQLite hands back naive datetimes for what was stored as UTC."""
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


def _to_summary(row: Any) -> RunSummary:
    run: SqlRun = row[0]
    loss = math.nan if row.last_loss_nan else row.last_loss
    return RunSummary(
        run_id=run.run_id, model=run.model, status=run.status, world_size=run.world_size,
        created_at=run.created_at, updated_at=max(run.updated_at, _aware(row.active_at)),
        last_step=row.last_step, last_loss=loss,
        samples=int(row.samples or 0),
    )


def run_summaries(
    session: sa.orm.Session, *, status: str | None = None, search: str | None = None, limit: int = 100, offset: int = 0
) -> list[RunSummary]:
    query = _summary_query().order_by(sa.desc("active_at"), SqlRun.id.desc()).limit(limit).offset(offset)
    if status:
        query = query.where(SqlRun.status == status)
    if search:
        escaped = search.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
        like = f"%{escaped}%"
        query = query.where(SqlRun.run_id.like(like, escape="\\") | SqlRun.model.like(like, escape="\\"))
    return [_to_summary(row) for row in session.execute(query)]


def run_detail(session: sa.orm.Session, run_id: str) -> RunDetail:
    row = session.execute(_summary_query().where(SqlRun.run_id == run_id)).one_or_none()
    if row is None:
        raise NotFound(f"run {run_id!r} not found", loc=("path", "run_id"))
    run: SqlRun = row[0]
    ranks = [
        RankProgress(rank=r.rank, last_step=r.last_step, last_segment=r.last_segment, last_time=r.last_time,
                     last_loss=math.nan if r.last_loss_nan else r.last_loss, batches=r.batches, samples=r.samples)
        for r in session.scalars(sa.select(SqlRunRank).where(SqlRunRank.run_pk == run.id).order_by(SqlRunRank.rank))
    ]
    num_tensors = session.scalar(sa.select(sa.func.count()).select_from(SqlTensor).where(SqlTensor.run_pk == run.id))
    stats = list(session.scalars(sa.select(SqlStat.name).where(SqlStat.run_pk == run.id).order_by(SqlStat.id)))
    return RunDetail(summary=_to_summary(row), recipe=run.recipe, config=run.config, ranks=ranks,
                     num_tensors=int(num_tensors or 0), stats=stats, guard=run.guard)


def tensor_list(conn: sa.Connection, pk: int) -> list[TensorInfo]:
    rows = conn.execute(sa.select(SqlTensor).where(SqlTensor.run_pk == pk).order_by(SqlTensor.idx))
    return [
        TensorInfo(index=r.idx, name=r.name, module=r.module, role=r.role, fp8_format=r.fp8_format,
                   first_step=r.first_step)
        for r in rows
    ]


def _ranked(conn: sa.Connection, pk: int, window: Window) -> Window:
    """The window with its rank given: the run's lead rank when it asked for none."""
    if window.rank is not None:
        return window
    lead = conn.scalar(sa.select(lead_rank(pk)))
    return replace(window, rank=0 if lead is None else int(lead))


def _pieces(conn: sa.Connection, pk: int, window: Window) -> list[tuple[int, int, int]]:
    """(segment, first, last) stretches making up the requested view."""
    query = sa.select(SqlSegment.segment, SqlSegment.first_step, SqlSegment.last_step).where(
        SqlSegment.run_pk == pk, SqlSegment.rank == window.rank
    )
    if window.segment is not None:
        query = query.where(SqlSegment.segment == window.segment)
    pieces: list[tuple[int, int, int]] = []
    floor = math.inf
    for seg, first, last in conn.execute(query.order_by(SqlSegment.segment.desc())):
        hi = int(min(last, floor - 1))
        if hi >= first:
            pieces.append((seg, first, hi))
        floor = min(floor, first)
    lo_req = window.start if window.start is not None else -math.inf
    hi_req = window.end if window.end is not None else math.inf
    return [(s, int(max(a, lo_req)), int(min(b, hi_req))) for s, a, b in pieces if max(a, lo_req) <= min(b, hi_req)]


def _plan(pieces: Sequence[tuple[int, int, int]], window: Window) -> buckets.BucketPlan | None:
    if not pieces:
        return None
    start = window.start if window.start is not None else min(p[1] for p in pieces)
    end = window.end if window.end is not None else max(p[2] for p in pieces)
    return buckets.plan_buckets(start, end, window.width)


def scalar_series(conn: sa.Connection, pk: int, fields: Sequence[str], window: Window) -> ScalarSeries:
    window = _ranked(conn, pk, window)
    unknown = [f for f in fields if f not in (*STEP_FIELDS, "tokens", "time")]
    if unknown:
        raise InvalidPayload(f"unknown scalar {unknown[0]!r}; choose from {', '.join((*STEP_FIELDS, 'tokens', 'time'))}",
                             loc=("query", "fields"))
    pieces = _pieces(conn, pk, window)
    plan = _plan(pieces, window)
    if plan is None:
        return ScalarSeries(bucket=1, steps=[], minimum={f: [] for f in fields}, maximum={f: [] for f in fields})
    bucket_col = (SqlStep.step // plan.bucket).label("b")
    cols: list[Any] = [bucket_col, sa.func.min(SqlStep.step)]
    for f in fields:
        col = getattr(SqlStep, f)
        cols += [sa.func.min(col), sa.func.max(col)]
        bit = 1 << STEP_FIELDS.index(f) if f in STEP_FIELDS else 0
        cols.append(sa.func.max(SqlStep.nan_mask.op("&")(bit)) if bit else sa.literal(0))
    merged: dict[int, list[Any]] = {}
    for seg, lo, hi in pieces:
        query = (
            sa.select(*cols)
            .where(SqlStep.run_pk == pk, SqlStep.rank == window.rank, SqlStep.segment == seg,
                   SqlStep.step.between(lo, hi))
            .group_by(bucket_col)
        )
        for row in conn.execute(query):
            _merge_scalar_row(merged, row, len(fields))
    order = sorted(merged)
    minimum: dict[str, list[float | None]] = {}
    maximum: dict[str, list[float | None]] = {}
    for j, f in enumerate(fields):
        minimum[f] = [merged[b][1 + 3 * j] for b in order]
        maximum[f] = [merged[b][2 + 3 * j] for b in order]
    return ScalarSeries(bucket=plan.bucket, steps=[merged[b][0] for b in order], minimum=minimum, maximum=maximum)


def _merge_scalar_row(merged: dict[int, list[Any]], row: Any, nfields: int) -> None:
    b = int(row[0])
    vals: list[Any] = [int(row[1])]
    for j in range(nfields):
        lo, hi, nan = row[2 + 3 * j], row[3 + 3 * j], row[4 + 3 * j]
        if nan:
            lo = hi = math.nan
        vals += [lo, hi, None]
    if b not in merged:
        merged[b] = vals
        return
    old = merged[b]
    old[0] = min(old[0], vals[0])
    for j in range(nfields):
        for off, pick in ((1, min), (2, max)):
            a, c = old[off + 3 * j], vals[off + 3 * j]
            if a is None or c is None:
                old[off + 3 * j] = c if a is None else a
            elif math.isnan(a) or math.isnan(c):
                old[off + 3 * j] = math.nan
            else:
                old[off + 3 * j] = pick(a, c)


def _stat_id(conn: sa.Connection, pk: int, stat: str) -> int:
    sid = conn.scalar(sa.select(SqlStat.id).where(SqlStat.run_pk == pk, SqlStat.name == stat))
    if sid is None:
        known = list(conn.scalars(sa.select(SqlStat.name).where(SqlStat.run_pk == pk).order_by(SqlStat.id)))
        raise NotFound(f"stat {stat!r} was never reported for this run; known stats: {known}", loc=("query", "stat"))
    return int(sid)


def _series_rows(conn: sa.Connection, pk: int, sid: int, level: int, seg: int, lo: int, hi: int,
                 window: Window, data: Any) -> list[Any]:
    t = SqlTensorSeries
    query = (
        sa.select(t.block, *data)
        .where(t.run_pk == pk, t.rank == window.rank, t.segment == seg, t.stat_id == sid, t.level == level,
               t.block.between(lo // level, hi // level))
        .order_by(t.block)
    )
    if conn.dialect.name == "postgresql":
        # Binary results: bytea over the text protocol doubles as hex and must be decoded;
        # on a 25 MB heatmap read this was half of the query time.
        compiled = query.compile(dialect=conn.dialect)
        raw = conn.connection.driver_connection
        assert raw is not None
        with raw.cursor(binary=True) as cur:
            cur.execute(str(compiled), compiled.params)
            return list(cur.fetchall())
    return list(conn.execute(query))


def tensor_series(conn: sa.Connection, pk: int, index: int, stat: str, window: Window) -> TensorSeries:
    window = _ranked(conn, pk, window)
    info = conn.execute(sa.select(SqlTensor).where(SqlTensor.run_pk == pk, SqlTensor.idx == index)).one_or_none()
    if info is None:
        raise NotFound(f"tensor index {index} is not defined for this run", loc=("path", "index"))
    tensor = TensorInfo(index=info.idx, name=info.name, module=info.module, role=info.role,
                        fp8_format=info.fp8_format, first_step=info.first_step)
    sid = _stat_id(conn, pk, stat)
    pieces = _pieces(conn, pk, window)
    plan = _plan(pieces, window)
    if plan is None:
        return TensorSeries(tensor=tensor, stat=stat, bucket=1, steps=[], minimum=[], maximum=[])
    col = SqlTensorSeries.data
    offset = 4 * index + 1
    # Slice this tensor's 4 bytes out in SQL instead of shipping whole rows.
    lo_expr = sa.func.substr(col, offset, 4)
    hi_expr = lo_expr if plan.level == 1 else sa.func.substr(
        col, sa.func.length(col).op("/", return_type=sa.Integer)(2) + offset, 4)  # integer division in both dialects
    out_min, out_max = buckets.empty_planes(1, plan.columns)
    present = np.zeros(plan.columns, dtype=bool)
    for seg, lo, hi in pieces:
        rows = _series_rows(conn, pk, sid, plan.level, seg, lo, hi, window, (lo_expr, hi_expr))
        rows = [r for r in rows if r[1] is not None and len(r[1]) == 4]
        if not rows:
            continue
        blocks = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        mins = np.frombuffer(b"".join(bytes(r[1]) for r in rows), dtype="<f4").reshape(-1, 1)
        maxs = np.frombuffer(b"".join(bytes(r[2]) for r in rows), dtype="<f4").reshape(-1, 1)
        buckets.reduce_into_columns(plan, blocks, mins, maxs, out_min, out_max, present)
    steps = plan.column_steps()[present]
    return TensorSeries(tensor=tensor, stat=stat, bucket=plan.bucket, steps=[int(s) for s in steps],
                        minimum=[float(v) for v in out_min[0, present]],
                        maximum=[float(v) for v in out_max[0, present]])


def tensor_matrix(conn: sa.Connection, pk: int, stat: str, window: Window) -> TensorMatrix:
    window = _ranked(conn, pk, window)
    sid = _stat_id(conn, pk, stat)
    tensors = tensor_list(conn, pk)
    pieces = _pieces(conn, pk, window)
    plan = _plan(pieces, window) or buckets.BucketPlan(bucket=1, level=1, first=0, columns=0)
    out_min, out_max = buckets.empty_planes(len(tensors), plan.columns)
    present = np.zeros(plan.columns, dtype=bool)
    for seg, lo, hi in pieces:
        rows = _series_rows(conn, pk, sid, plan.level, seg, lo, hi, window, (SqlTensorSeries.data,))
        if not rows:
            continue
        blocks = np.fromiter((r[0] for r in rows), dtype=np.int64, count=len(rows))
        mins, maxs = buckets.unpack_rows([bytes(r[1]) for r in rows], level=plan.level, num_tensors=len(tensors))
        buckets.reduce_into_columns(plan, blocks, mins, maxs, out_min, out_max, present)
    return TensorMatrix(stat=stat, bucket=plan.bucket, level=plan.level, column_steps=plan.column_steps(),
                        present=present, minimum=out_min, maximum=out_max, tensors=tensors)


EVENT_DATA_READ_BYTES = 64 * 2**10
"""Largest event ``data`` a read hands back; a larger one (stored before ingest bounded event
sizes, or under a raised ``max_event_data_bytes``) comes back as ``{"truncated": true, "bytes":
N}``, and is never loaded from the database: a 250 MB event was served to every dashboard load."""
EVENTS_READ_BYTES = 8 * 2**20
"""Most event data one read carries in all; the events after it keep their place in the list with
truncated data (the next page, ``after`` the last id served whole, has theirs)."""


def event_list(
    conn: sa.Connection, pk: int, *, kinds: Sequence[str] = (), start: int | None = None, end: int | None = None,
    limit: int = 1000, after: int | None = None,
) -> list[EventRecord]:
    """Events in id order (from the one after the id ``after``), each one's data and the whole
    answer bounded in bytes (the sizes are measured in SQL, so an oversized event's data never
    leaves the database)."""
    size = sa.func.length(sa.cast(SqlEvent.data, sa.Text))
    query = sa.select(SqlEvent.id, size.label("size")).where(SqlEvent.run_pk == pk)
    if kinds:
        query = query.where(SqlEvent.kind.in_(list(kinds)))
    if start is not None:
        query = query.where(SqlEvent.step >= start)
    if end is not None:
        query = query.where(SqlEvent.step <= end)
    if after is not None:
        query = query.where(SqlEvent.id > after)
    picked = query.order_by(SqlEvent.id).limit(limit).subquery()
    running = sa.func.sum(picked.c.size).over(order_by=picked.c.id)
    fits = sa.and_(picked.c.size <= EVENT_DATA_READ_BYTES, running <= EVENTS_READ_BYTES)
    rows = conn.execute(
        sa.select(SqlEvent.id, SqlEvent.kind, SqlEvent.step, SqlEvent.time, SqlEvent.rank, SqlEvent.segment,
                  picked.c.size, sa.case((fits, SqlEvent.data), else_=sa.null()).label("data"))
        .join(picked, picked.c.id == SqlEvent.id).order_by(SqlEvent.id))
    return [EventRecord(id=r.id, kind=r.kind, step=r.step, time=r.time, rank=r.rank, segment=r.segment,
                        data=_event_data(r.data, r.size)) for r in rows]


def _event_data(data: dict[str, Any] | None, size: int | None) -> dict[str, Any]:
    if data is not None:
        return data
    if size is None or size <= len("null"):
        return {}  # stored as JSON null
    return {"truncated": True, "bytes": int(size)}
