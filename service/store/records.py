"""Reads of the closed loop's records (findings, actions, commands, precision, checkpoints) and
of the per-run figures ``/metrics`` exports, as typed domain values."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import sqlalchemy as sa

from fp8guard import wire
from fp8guard.service.domain import ActionRecord, CheckpointRecord, FindingRecord, PrecisionRecord
from fp8guard.service.kinds import ActionKind, ActionStatus, Precision, Rule, Severity
from fp8guard.service.store import sql
from fp8guard.service.store.models import (
    SqlAction,
    SqlCheckpoint,
    SqlFinding,
    SqlLayerPrecision,
    SqlRun,
    SqlRunRank,
    SqlStat,
    SqlStep,
    SqlTensorSeries,
)
from fp8guard.service.store.series_reader import lead_rank

__all__ = ["RunMetrics", "action_list", "active_run_metrics", "checkpoint_list", "finding_list", "pending_commands",
           "pending_commands_later", "precision_list"]

_SATURATION_STAT = "saturation"
_UNDERFLOW_STAT = "underflows"
GAP_LOOKBACK_STEPS = 5000
"""How far back from rank 0's last step ``/metrics`` looks for the harm probe's latest gap: the
read walks the steps primary key backwards from the newest step and stops at the first probed
one, so a probing run costs about ``harm_interval_steps`` rows per scrape and a run without the
probe at most this many; a run whose newest probe is older exports no gap."""
_GAP_NAN_BIT = 1 << wire.STEP_FIELDS.index("fp8_loss_gap")


def finding_list(conn: sa.Connection, pk: int, *, limit: int = 1000) -> list[FindingRecord]:
    rows = conn.execute(sa.select(SqlFinding).where(SqlFinding.run_pk == pk).order_by(SqlFinding.id).limit(limit))
    return [FindingRecord(id=int(r.id), rank=r.rank, segment=r.segment, step=r.step, onset_step=r.onset_step,
                          rule=Rule(r.rule), severity=Severity(r.severity), explanation=r.explanation,
                          modules=list(r.modules or []), evidence=dict(r.evidence or {})) for r in rows]


def action_list(conn: sa.Connection, pk: int, *, limit: int = 1000) -> list[ActionRecord]:
    rows = conn.execute(sa.select(SqlAction).where(SqlAction.run_pk == pk).order_by(SqlAction.id).limit(limit))
    return [ActionRecord(id=int(r.id), kind=ActionKind(r.kind), status=ActionStatus(r.status), step=r.step,
                         reason=r.reason, details=dict(r.payload or {}), finding_ids=list(r.finding_ids or []),
                         applied_step=r.applied_step, error=r.error) for r in rows]


_PENDING_SQL = (f"SELECT id, kind, reason, payload FROM actions WHERE run_pk = ? AND status = '{ActionStatus.PENDING}' "
                f"AND kind IN ({', '.join(repr(str(k)) for k in wire.CommandKind)}) ORDER BY id")


def pending_commands(conn: sa.Connection, pk: int) -> list[wire.Command]:
    """Commands the agent has not answered yet, oldest first (every ingest answer carries them)."""
    return pending_commands_later(conn, pk)()


def pending_commands_later(conn: sa.Connection, pk: int) -> Callable[[], list[wire.Command]]:
    """``pending_commands``, read now and parsed when called (in a pipeline: once answered)."""
    later = sql.fetch_later(conn, _PENDING_SQL, (pk,))
    return lambda: [wire.Command.from_json({**(sql.json_value(conn, payload) or {}), "id": int(cid), "kind": kind,
                                            "reason": reason})
                    for cid, kind, reason, payload in later.rows()]


def precision_list(conn: sa.Connection, pk: int) -> list[PrecisionRecord]:
    lp = SqlLayerPrecision
    rows = conn.execute(sa.select(lp.module, lp.precision, lp.since_step).where(lp.run_pk == pk).order_by(lp.module))
    return [PrecisionRecord(module=r.module, precision=Precision(r.precision), since_step=r.since_step) for r in rows]


def checkpoint_list(conn: sa.Connection, pk: int) -> list[CheckpointRecord]:
    ck = SqlCheckpoint
    rows = conn.execute(sa.select(ck).where(ck.run_pk == pk).order_by(ck.segment, ck.step))
    return [CheckpointRecord(rank=r.rank, segment=r.segment, step=r.step, path=r.path, known_good=bool(r.known_good))
            for r in rows]


@dataclass(slots=True)
class RunMetrics:
    """One active run's figures for ``/metrics``."""

    pk: int
    run_id: str
    last_step: int | None = None
    last_loss: float | None = None
    layers_bf16: int = 0
    findings: int = 0
    rollbacks: int = 0
    actions: dict[ActionKind, int] = field(default_factory=dict)
    worst_saturation: float | None = None
    saturating: int | None = None
    underflowing: int | None = None
    fp8_loss_gap: float | None = None
    """The harm probe's latest gap on the lead rank (NaN when it was NaN; None: no probe lately)."""


def active_run_metrics(conn: sa.Connection, max_runs: int) -> tuple[list[RunMetrics], int]:
    """Up to ``max_runs`` running runs (most recently active first) and how many run in all.

    Two queries whatever the number of runs: one row per run with its scalars and counts
    (correlated sub-selects; the harm probe's latest gap is the lead rank's newest step in its
    newest segment that carries one, within ``GAP_LOOKBACK_STEPS``), then the latest level-1
    ``saturation`` and ``underflows`` rows of the lead rank, found through the primary key, so the
    cost does not grow with run length. The lead rank is the run's lowest reporting rank
    (``series_reader.lead_rank``): rank 0 unless the agents' ``report_ranks`` leave it out."""
    pk = SqlRun.id
    running = SqlRun.status == "running"
    active = int(conn.scalar(sa.select(sa.func.count()).select_from(SqlRun).where(running)) or 0)

    def count(model: Any, *where: sa.ColumnElement[bool]) -> Any:
        return sa.select(sa.func.count()).select_from(model).where(model.run_pk == pk, *where).scalar_subquery()

    lead = sa.orm.aliased(SqlRunRank)
    kinds = list(ActionKind)
    gap_nan = SqlStep.nan_mask.op("&")(_GAP_NAN_BIT)

    def latest_gap(col: Any) -> Any:
        probed = (SqlStep.fp8_loss_gap.is_not(None) | (gap_nan != 0))
        return (sa.select(col)
                .where(SqlStep.run_pk == pk, SqlStep.rank == lead.rank, SqlStep.segment == lead.last_segment,
                       SqlStep.step <= lead.last_step, SqlStep.step >= lead.last_step - GAP_LOOKBACK_STEPS, probed)
                .order_by(SqlStep.step.desc()).limit(1).correlate(SqlRun, lead).scalar_subquery())

    cols: list[Any] = [
        pk, SqlRun.run_id,
        sa.select(sa.func.max(SqlRunRank.last_step)).where(SqlRunRank.run_pk == pk).scalar_subquery(),
        lead.last_loss, lead.last_loss_nan,
        # What the agent reported applied: a pending, failed or ignored fallback is not BF16.
        count(SqlLayerPrecision, SqlLayerPrecision.precision.in_((Precision.BF16, Precision.PINNED))),
        count(SqlFinding),
        # Rollbacks the service decided and did not see fail (dry-run recommendations excluded).
        count(SqlAction, SqlAction.kind == ActionKind.ROLLBACK,
              SqlAction.status.in_((ActionStatus.PENDING, ActionStatus.APPLIED))),
        latest_gap(SqlStep.fp8_loss_gap), latest_gap(gap_nan),
        *(count(SqlAction, SqlAction.kind == kind) for kind in kinds),
    ]
    query = (sa.select(*cols).outerjoin(lead, (lead.run_pk == pk) & (lead.rank == lead_rank(pk))).where(running)
             .order_by(SqlRun.updated_at.desc(), pk.desc()).limit(max_runs))
    runs = []
    for row in conn.execute(query):
        loss = math.nan if row[4] else (float(row[3]) if row[3] is not None else None)
        gap = math.nan if row[9] else (float(row[8]) if row[8] is not None else None)
        runs.append(RunMetrics(
            pk=int(row[0]), run_id=str(row[1]), last_step=None if row[2] is None else int(row[2]),
            last_loss=loss, layers_bf16=int(row[5] or 0), findings=int(row[6] or 0), rollbacks=int(row[7] or 0),
            actions={kind: int(row[10 + i] or 0) for i, kind in enumerate(kinds)}, fp8_loss_gap=gap,
        ))
    _latest_stats(conn, runs)
    return runs, active


def _latest_stats(conn: sa.Connection, runs: list[RunMetrics]) -> None:
    if not runs:
        return
    by_pk = {r.pk: r for r in runs}
    ts = SqlTensorSeries
    lead = sa.orm.aliased(SqlRunRank)
    # The lead rank's newest segment holds its newest steps (a rollback starts a new segment).
    key = ((ts.run_pk == SqlStat.run_pk) & (ts.rank == lead.rank) & (ts.segment == lead.last_segment)
           & (ts.stat_id == SqlStat.id) & (ts.level == 1))
    newest = sa.select(sa.func.max(ts.block)).where(key).correlate(SqlStat, lead).scalar_subquery()
    query = (
        sa.select(SqlStat.run_pk, SqlStat.name, ts.data)
        .select_from(SqlStat)
        .join(lead, (lead.run_pk == SqlStat.run_pk) & (lead.rank == lead_rank(SqlStat.run_pk)))
        .join(ts, key & (ts.block == newest))
        .where(SqlStat.run_pk.in_(list(by_pk)), SqlStat.name.in_((_SATURATION_STAT, _UNDERFLOW_STAT)))
    )
    for run_pk, name, data in conn.execute(query):
        values = np.frombuffer(bytes(data), dtype="<f4")
        values = values[~np.isnan(values)]
        run = by_pk[int(run_pk)]
        if name == _SATURATION_STAT:
            run.saturating = int(np.count_nonzero(values > 1.0))
            if values.size:
                run.worst_saturation = float(np.max(values))
        else:
            run.underflowing = int(np.count_nonzero(values > 0))
