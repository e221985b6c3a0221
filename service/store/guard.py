"""The closed loop inside the ingest transaction: agent events (acks, checkpoints, precision
changes), the detector over the batch, the policy's decisions, and the commands to answer with.

Runs under the (run, rank) row lock that ingest already holds; decisions additionally lock the
run row, so ranks of one run never decide the same rollback twice.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from fp8guard.service.detect import (
    Decision,
    Detector,
    Finding,
    GuardConfig,
    RunView,
    TensorMeta,
    decide,
    promotions,
)
from fp8guard.service.domain import Batch
from fp8guard.service.store.models import (
    SqlAction,
    SqlCheckpoint,
    SqlDetectorState,
    SqlFinding,
    SqlLayerPrecision,
    SqlRun,
    SqlSegment,
    SqlTensor,
)

__all__ = ["AlertHook", "apply_events", "guard_batch", "pending_commands"]

log = logging.getLogger(__name__)

_COMMAND_KINDS = ("fallback", "promote", "rollback")


class AlertHook:
    """Called with each stored decision, inside the transaction (the alert outbox plugs in here)."""

    def __call__(self, conn: sa.Connection, run_pk: int, run_id: str, action_id: int, decision: Decision,
                 step: int, now: datetime) -> None:
        return None


def guard_batch(conn: sa.Connection, run_pk: int, batch: Batch, last_step: int, now: datetime,
                alert: AlertHook, cache: Any) -> None:
    """Detector over the batch, then decisions; the caller holds this (run, rank)'s detector
    lock, so batches of one rank are judged one at a time and in order."""
    guard_json = conn.scalar(sa.select(SqlRun.guard).where(SqlRun.id == run_pk))
    cfg = GuardConfig.model_validate(guard_json or {})
    count = int(conn.scalar(sa.select(sa.func.count()).select_from(SqlTensor).where(SqlTensor.run_pk == run_pk)) or 0)
    metas = cache.metas.get((run_pk, count))
    if metas is None:
        metas = _tensor_metas(conn, run_pk)
        cache.pending.append(("metas", (run_pk, count), metas))  # published after commit only
    key = (SqlDetectorState.run_pk == run_pk) & (SqlDetectorState.rank == batch.rank)
    # FOR UPDATE: on PostgreSQL the state row is the detector lock across service processes.
    state = conn.scalar(sa.select(SqlDetectorState.state).where(key).with_for_update())
    detector = Detector(cfg, metas, state)
    findings = detector.observe(batch.steps, batch.blocks)
    if state is None:
        conn.execute(sa.insert(SqlDetectorState).values(run_pk=run_pk, rank=batch.rank, state=detector.state_dict(),
                                                        last_step=last_step, updated_at=now))
    else:
        conn.execute(sa.update(SqlDetectorState).where(key).values(state=detector.state_dict(), last_step=last_step,
                                                                   updated_at=now))
    _mark_known_good(conn, run_pk, last_step, cfg)
    finding_ids = [_store_finding(conn, run_pk, batch, f, now) for f in findings]
    has_bf16 = conn.scalar(sa.select(sa.func.count()).select_from(SqlLayerPrecision).where(
        SqlLayerPrecision.run_pk == run_pk, SqlLayerPrecision.precision == "bf16"))
    if not findings and not has_bf16:
        return
    # Decide under the run's row lock: ranks of one run must not both order a rollback.
    # FOR NO KEY UPDATE, not FOR UPDATE: every insert into a table referencing runs holds a KEY
    # SHARE lock on this row, which FOR UPDATE would wait for (two ranks deadlocked that way).
    run_id = conn.execute(sa.select(SqlRun.run_id).where(SqlRun.id == run_pk)
                          .with_for_update(key_share=True)).scalar_one()
    view = _view(conn, run_pk, last_step, metas)
    decisions = decide(findings, view, cfg) + promotions(view, cfg)
    for d in decisions:
        ids = [finding_ids[i] for i in d.findings]
        action_id = _store_action(conn, run_pk, d, ids, last_step, cfg, now, view)
        alert(conn, run_pk, run_id, action_id, d, last_step, now)


def _tensor_metas(conn: sa.Connection, run_pk: int) -> list[TensorMeta]:
    rows = conn.execute(sa.select(SqlTensor.name, SqlTensor.module, SqlTensor.role, SqlTensor.fp8_format)
                        .where(SqlTensor.run_pk == run_pk).order_by(SqlTensor.idx))
    return [TensorMeta(name=r.name, module=r.module or r.name.split(":")[0],
                       backward=(r.role or "").startswith("bwd") or (r.fp8_format or "") == "e5m2") for r in rows]


def _store_finding(conn: sa.Connection, run_pk: int, batch: Batch, f: Finding, now: datetime) -> int:
    return int(conn.execute(
        sa.insert(SqlFinding).values(run_pk=run_pk, rank=batch.rank, segment=batch.segment, step=f.step,
                                     onset_step=f.onset_step, rule=f.rule, severity=str(f.severity),
                                     explanation=f.explanation[:1024], modules=list(f.modules), evidence=f.evidence,
                                     created_at=now)
        .returning(SqlFinding.id)).scalar_one())


def _view(conn: sa.Connection, run_pk: int, step: int, metas: Sequence[TensorMeta]) -> RunView:
    precision = conn.execute(sa.select(SqlLayerPrecision.module, SqlLayerPrecision.precision,
                                       SqlLayerPrecision.since_step).where(SqlLayerPrecision.run_pk == run_pk)).all()
    bf16 = {r.module: int(r.since_step) for r in precision if r.precision in ("bf16", "pinned")}
    pinned = frozenset(r.module for r in precision if r.precision == "pinned")
    rollback_pending = bool(conn.scalar(sa.select(sa.func.count()).select_from(SqlAction).where(
        SqlAction.run_pk == run_pk, SqlAction.kind == "rollback", SqlAction.status == "pending")))
    rollbacks = [int(s) for s in conn.scalars(sa.select(SqlAction.step).where(
        SqlAction.run_pk == run_pk, SqlAction.kind == "rollback", SqlAction.status.in_(("pending", "applied"))))]
    last_finding: dict[str, int] = {}
    for modules, fstep in conn.execute(sa.select(SqlFinding.modules, SqlFinding.step).where(
            SqlFinding.run_pk == run_pk, SqlFinding.rule.in_(("saturation", "amax_growth", "inf_amax")))):
        for m in modules or []:
            last_finding[m] = max(last_finding.get(m, 0), int(fstep))
    return RunView(step=step, modules=sorted({m.module for m in metas}), bf16=bf16, rollback_pending=rollback_pending,
                   known_good=_known_good_steps(conn, run_pk), recent_rollbacks=rollbacks,
                   last_finding_step=last_finding, pinned=pinned)


def _known_good_steps(conn: sa.Connection, run_pk: int) -> list[int]:
    """Known-good checkpoints still on the current timeline: a checkpoint of segment k at a step
    that a later segment re-ran was abandoned by the rollback that started that segment."""
    firsts = {int(s): int(f) for s, f in conn.execute(
        sa.select(SqlSegment.segment, sa.func.min(SqlSegment.first_step)).where(SqlSegment.run_pk == run_pk)
        .group_by(SqlSegment.segment))}
    out = []
    for seg, step in conn.execute(sa.select(SqlCheckpoint.segment, SqlCheckpoint.step).where(
            SqlCheckpoint.run_pk == run_pk, SqlCheckpoint.known_good.is_(True))):
        later = [f for s, f in firsts.items() if s > seg]
        if not later or step < min(later):
            out.append(int(step))
    return sorted(set(out))


def _mark_known_good(conn: sa.Connection, run_pk: int, last_step: int, cfg: GuardConfig) -> None:
    """A checkpoint is known-good once ``known_good_after_steps`` followed it with no warning or
    critical finding whose onset falls in [step - margin, step + known_good_after_steps]."""
    ck = SqlCheckpoint
    candidates = conn.execute(sa.select(ck.rank, ck.segment, ck.step).where(
        ck.run_pk == run_pk, ck.known_good.is_(False), ck.step + cfg.known_good_after_steps <= last_step)).all()
    for rank, segment, step in candidates:
        trouble = conn.scalar(sa.select(sa.func.count()).select_from(SqlFinding).where(
            SqlFinding.run_pk == run_pk, SqlFinding.severity.in_(("warning", "critical")),
            SqlFinding.onset_step.between(step - cfg.rollback_margin_steps, step + cfg.known_good_after_steps)))
        if not trouble:
            conn.execute(sa.update(ck).where(ck.run_pk == run_pk, ck.rank == rank, ck.segment == segment,
                                             ck.step == step).values(known_good=True))


def _store_action(conn: sa.Connection, run_pk: int, d: Decision, finding_ids: list[int], step: int,
                  cfg: GuardConfig, now: datetime, view: RunView) -> int:
    # Commands wait for the agent (or, in dry-run, only recommend); alerts and pages are records.
    status = ("recommended" if cfg.dry_run else "pending") if d.kind in _COMMAND_KINDS else "recorded"
    action_id = int(conn.execute(sa.insert(SqlAction).values(
        run_pk=run_pk, kind=d.kind, status=status, step=step, reason=d.reason[:1024], payload=d.payload,
        finding_ids=finding_ids, created_at=now).returning(SqlAction.id)).scalar_one())
    if status == "pending" and d.kind in ("fallback", "promote"):
        # Record the intended precision now, so the next batch does not order the same switch;
        # the agent's *_applied event confirms it with the step it took effect.
        modules = d.payload.get("modules") or list(view.modules)
        precision = "fp8" if d.kind == "promote" else ("pinned" if d.payload.get("escalation") else "bf16")
        _set_precision(conn, run_pk, modules, precision, step, action_id)
    return action_id


def _set_precision(conn: sa.Connection, run_pk: int, modules: Sequence[str], precision: str, step: int,
                   action_id: int | None) -> None:
    from fp8guard.service.store.writer import upsert_insert

    if not modules:
        return
    stmt = upsert_insert(conn)(SqlLayerPrecision)
    stmt = stmt.on_conflict_do_update(index_elements=["run_pk", "module"],
                                      set_={"precision": stmt.excluded.precision,
                                            "since_step": stmt.excluded.since_step,
                                            "action_id": stmt.excluded.action_id})
    conn.execute(stmt, [{"run_pk": run_pk, "module": m, "precision": precision, "since_step": step,
                         "action_id": action_id} for m in modules])


def apply_events(conn: sa.Connection, run_pk: int, batch: Batch, now: datetime) -> None:
    from fp8guard.service.store.writer import upsert_insert

    for e in batch.events:
        data: dict[str, Any] = e.data or {}
        if e.kind == "command_acknowledged" and isinstance(data.get("command_id"), int):
            status = {"applied": "applied", "failed": "failed", "ignored": "ignored"}.get(str(data.get("status")),
                                                                                          "failed")
            conn.execute(sa.update(SqlAction).where(SqlAction.run_pk == run_pk, SqlAction.id == data["command_id"],
                                                    SqlAction.status.in_(("pending", "recommended")))
                         .values(status=status, applied_step=e.step, applied_at=now,
                                 error=(str(data["error"])[:1024] if data.get("error") else None)))
        elif e.kind == "checkpoint_saved" and e.step is not None:
            conn.execute(upsert_insert(conn)(SqlCheckpoint).values(
                run_pk=run_pk, rank=batch.rank, segment=batch.segment, step=e.step,
                path=str(data.get("path"))[:1024] if data.get("path") else None,
                known_good=bool(data.get("known_good", False)), created_at=now).on_conflict_do_nothing())
        elif e.kind in ("fallback_applied", "promotion_applied") and e.step is not None:
            modules = data.get("modules")
            if not modules:
                modules = sorted({m.module for m in _tensor_metas(conn, run_pk)})
            current = {r.module: r.precision for r in conn.execute(sa.select(
                SqlLayerPrecision.module, SqlLayerPrecision.precision).where(SqlLayerPrecision.run_pk == run_pk))}
            if e.kind == "fallback_applied":
                precision = "pinned" if any(current.get(m) == "pinned" for m in modules) else "bf16"
            else:
                precision = "fp8"
            _set_precision(conn, run_pk, modules, precision, e.step, data.get("command_id"))


def pending_commands(conn: sa.Connection, run_pk: int) -> list[dict[str, Any]]:
    rows = conn.execute(sa.select(SqlAction.id, SqlAction.kind, SqlAction.reason, SqlAction.payload).where(
        SqlAction.run_pk == run_pk, SqlAction.status == "pending", SqlAction.kind.in_(_COMMAND_KINDS))
        .order_by(SqlAction.id))
    return [{"id": int(r.id), "kind": r.kind, "reason": r.reason, **(r.payload or {})} for r in rows]
