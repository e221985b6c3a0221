"""What the closed loop reads and writes, as one unit of work per run: ``LoopTxn``.

The loop (``service/loop``) decides; this module only persists and reads, inside a transaction
that holds the run's loop lock, so one run is judged by one worker at a time across every
service process sharing the database (PostgreSQL: a transaction-scoped advisory lock; SQLite:
the database's single write lock, taken first). The queue rows a pass judged are deleted in the
same transaction as its findings, decisions and alert rows: a crash either keeps all of it or
none, and the next pass judges the batch again.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import sqlalchemy as sa

from fp8guard import wire
from fp8guard.service.domain import Batch, Decision, EventRecord, Finding, QueuedBatch, StatBlock, StepRow
from fp8guard.service.kinds import FP8_RULES, ActionKind, ActionStatus, Precision, Severity
from fp8guard.service.store import records, sql
from fp8guard.service.store.models import (
    SqlEvent,
    SqlFinding,
    SqlLoopQueue,
    SqlStat,
    SqlStep,
    SqlTensorSeries,
)
from fp8guard.service.store.outbox import OutboxRow, insert_rows
from fp8guard.wire import STEP_FIELDS, EventKind

__all__ = ["LOOP_LOCK_CLASS", "LoopTxn", "PassInputs", "TensorRow", "ViewInputs"]

LOOP_LOCK_CLASS = 0x6C6F6F70
"""First key of the PostgreSQL advisory lock that serialises the loop of one run ('loop')."""

_SWITCHES = (ActionKind.FALLBACK, ActionKind.PROMOTE)
_JUDGED_EVENTS = (EventKind.HARM_ATTRIBUTED.value, EventKind.PROMOTION_TRIAL.value)
"""Event kinds the loop's detector reads (the others are applied by ingest)."""

_FINDING_COLUMNS = (("run_pk", "bigint"), ("rank", "integer"), ("segment", "integer"), ("step", "bigint"),
                    ("onset_step", "bigint"), ("rule", "text"), ("severity", "text"), ("explanation", "text"),
                    ("modules", "json"), ("evidence", "json"), ("created_at", "timestamptz"))
_ACTION_COLUMNS = (("run_pk", "bigint"), ("kind", "text"), ("status", "text"), ("step", "bigint"),
                   ("reason", "text"), ("payload", "json"), ("finding_ids", "json"), ("created_at", "timestamptz"))
"""Columns the loop inserts in bulk, with their PostgreSQL types (``sql.insert_returning_ids``)."""


class TensorRow:
    """One row of the run's tensor table, as the detector needs it."""

    __slots__ = ("fp8_format", "module", "name", "role")

    def __init__(self, name: str, module: str | None, role: str | None, fp8_format: str | None) -> None:
        self.name, self.module, self.role, self.fp8_format = name, module, role, fp8_format


class ViewInputs:
    """The run's situation the policy weighs, read in the pass's transaction."""

    __slots__ = ("checkpoints", "known_good", "last_fp8_finding", "last_loss_event", "last_page", "pending_modules",
                 "pinned", "precision", "recent_rollbacks", "rollback_pending", "segment_firsts", "stored_checkpoints",
                 "whole_model_pending")

    def __init__(self) -> None:
        self.precision: dict[str, tuple[Precision, int]] = {}
        """Module -> (precision the agent applied, since step)."""
        self.pinned: frozenset[str] = frozenset()
        self.pending_modules: dict[str, ActionKind] = {}
        """Module -> the kind of a switch command the agent has not answered yet."""
        self.whole_model_pending = False
        """A whole-model fallback is pending."""
        self.rollback_pending = False
        self.recent_rollbacks: list[int] = []
        self.known_good: list[int] = []
        self.checkpoints: list[int] = []
        """Every checkpoint step of the current timeline (known-good or not yet)."""
        self.last_fp8_finding: dict[str, int] = {}
        self.last_loss_event: int | None = None
        """Onset of the latest finding of a rollback rule."""
        self.last_page: int | None = None
        self.segment_firsts: dict[int, int] = {}
        """Segment -> its first step (over ranks): what ``checkpoints`` is derived from, with ..."""
        self.stored_checkpoints: dict[tuple[int, int, int], bool] = {}
        """... every (rank, segment, step) checkpoint and whether it is known-good."""


class PassInputs:
    """What every pass reads first, in one round trip (``LoopTxn.open``)."""

    __slots__ = ("guard", "n_tensors", "queued", "remediating", "run_id", "states", "unconfirmed")

    def __init__(self, queued: list[QueuedBatch], run_id: str, guard: dict[str, Any], n_tensors: int,
                 states: dict[int, str], unconfirmed: list[tuple[int, int, int]], remediating: bool) -> None:
        self.queued = queued
        """The run's queued batches, oldest first (at most the pass's limit)."""
        self.run_id, self.guard, self.n_tensors = run_id, guard, n_tensors
        self.states = states
        """Each rank's stored detector state (JSON text), for the ranks of ``queued``."""
        self.unconfirmed = unconfirmed
        """(rank, segment, step) of checkpoints not yet known-good, at or before the newest queued step."""
        self.remediating = remediating
        """Whether any module is (or is being switched) off FP8."""


class LoopTxn:
    """The loop's reads and writes for one run, inside one transaction (made by ``Store.loop_pass``).

    The run's loop lock is taken before the first statement of the transaction: with the pass's
    first reads (``open``, one round trip on PostgreSQL), or on its own when something else
    comes first."""

    def __init__(self, conn: sa.Connection, run_pk: int, now: datetime) -> None:
        self._conn = conn
        self.run_pk = run_pk
        self.now = now
        self._locked = False
        self._view: ViewInputs | None = None
        """The run's situation, read once per pass and kept up to date by this pass's own writes."""
        self._rollback_rules: frozenset[str] = frozenset()
        self._actions: list[tuple[Decision, ActionStatus, tuple[int, ...], int]] = []
        """Decisions recorded in this pass, written in one statement by ``flush_actions``."""

    @property
    def conn(self) -> sa.Connection:
        """The pass's connection, under the run's loop lock."""
        if not self._locked:
            self.lock()
        return self._conn

    # -- locking and the queue ------------------------------------------------------------------

    def lock(self) -> None:
        """Take the run's loop lock until the transaction ends."""
        if not self._locked:
            with sql.pipeline(self._conn):
                self._send_lock()

    def _send_lock(self) -> None:
        if self._conn.dialect.name == "postgresql":
            # No WAL flush wait at commit: a pass lost in a crash leaves its queue rows, so its batches
            # are judged again (findings and the queue's deletion commit or vanish together).
            # One statement for both (psycopg's Python per statement is a pass's main cost).
            sql.run(self._conn, "SELECT set_config('synchronous_commit', 'off', true), pg_advisory_xact_lock(?, ?)",
                    (LOOP_LOCK_CLASS, self.run_pk))
        else:  # a write first: SQLite's one write lock, held to commit, orders passes of every process
            sql.run(self._conn, "DELETE FROM loop_queue WHERE 0")
        self._locked = True

    def open(self, limit: int) -> PassInputs:
        """Take the lock and read the pass's inputs, all in one round trip on PostgreSQL: the
        queue, the run, the detector states, unconfirmed checkpoints and whether anything is off
        FP8. (Each read is a superset of what the queue will call for, trimmed here.)"""
        conn, pk = self._conn, self.run_pk
        with sql.pipeline(conn):
            if not self._locked:
                self._send_lock()
            queued = sql.fetch_later(conn, _QUEUED, (pk, limit))
            run = sql.fetch_later(conn, _RUN_INFO, (pk,))
            cast = "state::text" if conn.dialect.name == "postgresql" else "state"
            states = sql.fetch_later(conn, f"SELECT rank, {cast} FROM detector_states WHERE run_pk = ?", (pk,))
            checkpoints = sql.fetch_later(conn, _UNCONFIRMED, (pk,))
            remediating = sql.fetch_later(conn, _REMEDIATING, self._remediating_args())
        batches = _queued(queued.rows())
        ranks = {q.rank for q in batches}
        newest = max((q.last_step for q in batches), default=0)
        run_id, guard, n_tensors = _run_info(conn, run.rows())
        return PassInputs(
            queued=batches, run_id=run_id, guard=guard, n_tensors=n_tensors,
            states={int(r): str(t) for r, t in states.rows() if r in ranks},
            unconfirmed=[(int(r), int(g), int(st)) for r, g, st in checkpoints.rows() if st <= newest],
            remediating=bool(remediating.rows()[0][0]))

    def finish(self, states: Sequence[tuple[int, str, int]], queue_ids: Sequence[int], *,
               read_commands: bool = False) -> list[wire.Command]:
        """The pass's last writes: each rank's detector state ``(rank, JSON text, last step)`` and
        the judged queue rows' deletion; on PostgreSQL the transaction commits with them, in one
        round trip. Nothing may be written after. ``read_commands``: also return the run's pending
        commands as this transaction sees them (read in the same round trip)."""
        with sql.pipeline(self.conn, commit=True):
            for rank, text, last_step in states:
                self.save_detector_state(rank, text, last_step)
            self.done(queue_ids)
            commands = records.pending_commands_later(self._conn, self.run_pk) if read_commands else None
        return [] if commands is None else commands()

    def queued(self, limit: int) -> list[QueuedBatch]:
        return _queued(sql.fetch_all(self.conn, _QUEUED, (self.run_pk, limit)))

    def done(self, queue_ids: Sequence[int]) -> None:
        if queue_ids:
            lo, hi = min(queue_ids), max(queue_ids)
            if hi - lo + 1 == len(queue_ids):  # the usual case: a contiguous stretch of this run's queue
                sql.run(self.conn, "DELETE FROM loop_queue WHERE run_pk = ? AND id BETWEEN ? AND ?",
                        (self.run_pk, lo, hi))
            else:
                self.conn.execute(sa.delete(SqlLoopQueue).where(SqlLoopQueue.id.in_(list(queue_ids))))

    def read_batch(self, q: QueuedBatch, run_id: str) -> Batch:
        """Rebuild a queued batch's scalars and level-1 statistics from the stored rows (when the
        process that judges it is not the one that received it, or after a restart)."""
        st = SqlStep
        steps = []
        fields = [getattr(st, name) for name in STEP_FIELDS]
        for row in self.conn.execute(sa.select(st.step, st.time, st.tokens, st.nan_mask, *fields)
                                   .where(st.run_pk == self.run_pk, st.rank == q.rank, st.segment == q.segment,
                                          st.step.between(q.first_step, q.last_step)).order_by(st.step)):
            vals = [math.nan if int(row.nan_mask) & (1 << bit) else getattr(row, name)
                    for bit, name in enumerate(STEP_FIELDS)]
            steps.append(StepRow(step=int(row.step), time=row.time, tokens=row.tokens,
                                 **dict(zip(STEP_FIELDS, vals, strict=True))))
        ts = SqlTensorSeries
        rows = self.conn.execute(
            sa.select(SqlStat.name, ts.block, ts.data).join(SqlStat, SqlStat.id == ts.stat_id)
            .where(ts.run_pk == self.run_pk, ts.rank == q.rank, ts.segment == q.segment, ts.level == 1,
                   ts.block.between(q.first_step, q.last_step))).all()
        blocks: list[StatBlock] = []
        if rows:
            names = sorted({str(r.name) for r in rows})
            at = sorted({int(r.block) for r in rows})
            width = max(len(r.data) for r in rows) // 4
            values = np.full((len(at), len(names), width), np.nan, dtype=np.float32)
            si, ti = {n: i for i, n in enumerate(names)}, {s: i for i, s in enumerate(at)}
            for r in rows:
                v = np.frombuffer(bytes(r.data), dtype="<f4")
                values[ti[int(r.block)], si[str(r.name)], : v.size] = v
            blocks.append(StatBlock(stats=tuple(names), steps=np.asarray(at, dtype=np.int64), values=values))
        # The events the loop judges (the harm probe's); the others were applied at ingest.
        ev = SqlEvent
        events = [EventRecord(kind=r.kind, step=r.step, time=r.time, rank=r.rank, segment=r.segment,
                              data=dict(sql.json_value(self.conn, r.data) or {}))
                  for r in self.conn.execute(
                      sa.select(ev.kind, ev.step, ev.time, ev.rank, ev.segment, ev.data)
                      .where(ev.run_pk == self.run_pk, ev.rank == q.rank, ev.segment == q.segment,
                             ev.kind.in_(_JUDGED_EVENTS), ev.step.between(q.first_step, q.last_step))
                      .order_by(ev.id))]
        return Batch(run_id=run_id, batch_id=f"queued-{q.queue_id}", rank=q.rank, segment=q.segment, tensors=[],
                     steps=steps, blocks=blocks, events=events)

    # -- the run -----------------------------------------------------------------------------

    def tensors(self) -> list[TensorRow]:
        return [TensorRow(*r) for r in sql.fetch_all(
            self.conn, "SELECT name, module, role, fp8_format FROM tensors WHERE run_pk = ? ORDER BY idx", (self.run_pk,))]

    # -- detector state ------------------------------------------------------------------------

    def save_detector_state(self, rank: int, state: str, last_step: int) -> None:
        """``state``: JSON text, stored verbatim (a json column, not jsonb: read back as written)."""
        # An upsert: a run's first batches may be judged in one pass or several, by any process.
        sql.run(self.conn, "INSERT INTO detector_states (run_pk, rank, state, last_step, updated_at) "
                           "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_pk, rank) DO UPDATE SET state = excluded.state, "
                           "last_step = excluded.last_step, updated_at = excluded.updated_at",
                (self.run_pk, rank, state, last_step, sql.timestamp(self.conn, self.now)))

    # -- findings, checkpoints, decisions -------------------------------------------------------

    def add_findings(self, rank: int, segment: int, findings: Sequence[Finding]) -> list[int]:
        """Insert ``findings`` (multi-row statements) and return their ids, in order."""
        if not findings:
            return []
        now = sql.timestamp(self.conn, self.now)
        rows = [(self.run_pk, rank, segment, f.step, f.onset_step, str(f.rule), str(f.severity), f.explanation[:1024],
                 json.dumps(list(f.modules)), json.dumps(f.evidence), now) for f in findings]
        ids = sql.insert_returning_ids(self.conn, "findings", _FINDING_COLUMNS, rows)
        if self._view is not None:
            for f in findings:
                _fold_finding(self._view, self._rollback_rules, str(f.rule), f.onset_step, f.step, f.modules)
        return ids

    def troubled_between(self, first: int, last: int, *, seen_by: int) -> bool:
        """Whether a warning or critical finding made by step ``seen_by`` has its onset in [first, last]."""
        return bool(self.conn.scalar(sa.select(sa.func.count()).select_from(SqlFinding).where(
            SqlFinding.run_pk == self.run_pk, SqlFinding.severity.in_((Severity.WARNING, Severity.CRITICAL)),
            SqlFinding.onset_step.between(first, last), SqlFinding.step <= seen_by)))

    def mark_known_good(self, checkpoints: Sequence[tuple[int, int, int]]) -> None:
        """Mark (rank, segment, step) checkpoints known-good (the run's situation follows)."""
        sql.run_many(self.conn, "UPDATE checkpoints SET known_good = ? WHERE run_pk = ? AND rank = ? AND segment = ? "
                                "AND step = ?", [(True, self.run_pk, *c) for c in checkpoints])
        if checkpoints and self._view is not None:
            self._view.stored_checkpoints.update(dict.fromkeys(checkpoints, True))
            self._view.checkpoints, self._view.known_good = _timeline(self._view)

    def _remediating_args(self) -> tuple[Any, ...]:
        return (self.run_pk, str(Precision.FP8), self.run_pk, str(ActionStatus.PENDING), *map(str, _SWITCHES))

    def view_inputs(self, rollback_rules: Iterable[str]) -> ViewInputs:
        """The run's situation, read once per pass (the policy asks at every decision point: a batch
        of random data has one at nearly every step; one round trip on PostgreSQL) and then kept up
        to date in memory by this pass's own writes (``add_findings``, ``add_action``,
        ``mark_known_good``), so every decision sees the earlier decisions of its pass. Stored rows
        and the pass's own records go through the same rules (``_fold_action``, ``_fold_finding``,
        ``_timeline``): the SQL only narrows the rows read. One set of rollback rules per pass.
        The caller must not change the view."""
        rules = frozenset(str(r) for r in rollback_rules)
        if self._view is None:
            self._view, self._rollback_rules = self._read_view(rules), rules
            for decision, status, _, step in self._actions:  # recorded before the read, not written yet
                _fold_action(self._view, decision.kind, status, step, decision.modules)
        elif rules != self._rollback_rules:
            raise ValueError("a pass judges with one set of rollback rules")
        return self._view

    def _read_view(self, rollback_rules: frozenset[str]) -> ViewInputs:
        v = ViewInputs()
        conn, pk = self.conn, self.run_pk
        rules = sorted(rollback_rules | {str(r) for r in FP8_RULES})
        with sql.pipeline(conn):
            precision = sql.fetch_later(conn, "SELECT module, precision, since_step FROM layer_precision "
                                              "WHERE run_pk = ?", (pk,))
            actions = sql.fetch_later(conn, f"SELECT kind, status, step, payload FROM actions WHERE run_pk = ? "
                                            f"AND kind IN ({', '.join('?' * len(_VIEW_ACTIONS))})",
                                      (pk, *map(str, _VIEW_ACTIONS)))
            findings = sql.fetch_later(conn, f"SELECT rule, onset_step, step, modules FROM findings WHERE run_pk = ? "
                                             f"AND rule IN ({', '.join('?' * len(rules))})", (pk, *rules))
            segments = sql.fetch_later(conn, "SELECT segment, min(first_step) FROM segments WHERE run_pk = ? "
                                             "GROUP BY segment", (pk,))
            checkpoints = sql.fetch_later(conn, "SELECT rank, segment, step, known_good FROM checkpoints "
                                                "WHERE run_pk = ?", (pk,))
        for module, p, since in precision.rows():
            v.precision[str(module)] = (Precision(p), int(since))
        v.pinned = frozenset(m for m, (p, _) in v.precision.items() if p is Precision.PINNED)
        for kind, status, step, payload in actions.rows():
            modules = (sql.json_value(conn, payload) or {}).get("modules")
            _fold_action(v, ActionKind(kind), ActionStatus(status), int(step), modules)
        for rule, onset, step, modules in findings.rows():
            _fold_finding(v, rollback_rules, str(rule), int(onset), int(step), sql.json_value(conn, modules) or ())
        v.segment_firsts = {int(g): int(f) for g, f in segments.rows()}
        v.stored_checkpoints = {(int(r), int(g), int(st)): bool(good) for r, g, st, good in checkpoints.rows()}
        v.checkpoints, v.known_good = _timeline(v)
        return v

    def add_action(self, decision: Decision, status: ActionStatus, finding_ids: Sequence[int], step: int) -> None:
        """Record a decision: the run's situation (``view_inputs``) includes it at once; its row is
        written with the pass's others by ``flush_actions``."""
        self._actions.append((decision, status, tuple(finding_ids), step))
        if self._view is not None:
            _fold_action(self._view, decision.kind, status, step, decision.modules)

    def flush_actions(self) -> list[tuple[int, Decision, int]]:
        """Write the decisions recorded since the last flush (multi-row statements); returns
        (action id, decision, step) in the order they were recorded."""
        pending, self._actions = self._actions, []
        if not pending:
            return []
        now = sql.timestamp(self.conn, self.now)
        rows = [(self.run_pk, str(d.kind), str(status), step, d.reason[:1024], json.dumps(d.details()),
                 json.dumps(list(fids)), now) for d, status, fids, step in pending]
        ids = sql.insert_returning_ids(self.conn, "actions", _ACTION_COLUMNS, rows)
        return [(i, d, step) for i, (d, _, _, step) in zip(ids, pending, strict=True)]

    def enqueue_alerts(self, rows: Sequence[OutboxRow]) -> int:
        return insert_rows(self.conn, rows, run_pk=self.run_pk)


_QUEUED = "SELECT id, rank, segment, first_step, last_step FROM loop_queue WHERE run_pk = ? ORDER BY id LIMIT ?"
_RUN_INFO = "SELECT run_id, guard, (SELECT count(*) FROM tensors WHERE run_pk = runs.id) FROM runs WHERE id = ?"
_UNCONFIRMED = "SELECT rank, segment, step FROM checkpoints WHERE run_pk = ? AND NOT known_good"
_REMEDIATING = ("SELECT EXISTS (SELECT 1 FROM layer_precision WHERE run_pk = ? AND precision <> ?) OR "
                "EXISTS (SELECT 1 FROM actions WHERE run_pk = ? AND status = ? AND kind IN (?, ?))")


def _queued(rows: list[tuple[Any, ...]]) -> list[QueuedBatch]:
    return [QueuedBatch(queue_id=int(r[0]), rank=int(r[1]), segment=int(r[2]), first_step=int(r[3]),
                        last_step=int(r[4])) for r in rows]


def _run_info(conn: sa.Connection, rows: list[tuple[Any, ...]]) -> tuple[str, dict[str, Any], int]:
    assert rows, "the run of a loop pass exists (runs are never deleted while queued)"
    run_id, guard, n_tensors = rows[0]
    return str(run_id), dict(sql.json_value(conn, guard) or {}), int(n_tensors)


_VIEW_ACTIONS = (ActionKind.FALLBACK, ActionKind.PROMOTE, ActionKind.ROLLBACK, ActionKind.PAGE)
"""The action kinds the run's situation is made of (``_fold_action``)."""


def _fold_action(v: ViewInputs, kind: ActionKind, status: ActionStatus, step: int,
                 modules: Iterable[str] | None) -> None:
    """Add one action, stored or just decided, to the run's situation: the latest page; rollbacks
    pending or applied; switches (``modules`` None: the whole model) the agent has not answered."""
    if kind is ActionKind.PAGE:
        v.last_page = step if v.last_page is None else max(v.last_page, step)
    elif kind is ActionKind.ROLLBACK and status in (ActionStatus.PENDING, ActionStatus.APPLIED):
        v.recent_rollbacks.append(step)
        v.rollback_pending |= status is ActionStatus.PENDING
    elif kind in _SWITCHES and status is ActionStatus.PENDING:
        if modules is None:
            v.whole_model_pending |= kind is ActionKind.FALLBACK
        else:
            v.pending_modules.update({str(m): kind for m in modules})


def _fold_finding(v: ViewInputs, rollback_rules: frozenset[str], rule: str, onset: int, step: int,
                  modules: Iterable[str]) -> None:
    """Add one finding to the run's situation: the onset of the latest rollback-rule finding, and
    the latest FP8 finding per module."""
    if rule in rollback_rules:
        v.last_loss_event = onset if v.last_loss_event is None else max(v.last_loss_event, onset)
    if rule in _FP8_RULE_NAMES:
        for m in modules:
            v.last_fp8_finding[m] = max(v.last_fp8_finding.get(m, 0), step)


_FP8_RULE_NAMES = frozenset(str(r) for r in FP8_RULES)


def _timeline(v: ViewInputs) -> tuple[list[int], list[int]]:
    """Checkpoint steps still on the current timeline (all, known-good): a checkpoint of segment k at
    a step that a later segment re-ran was abandoned by the rollback that started that segment."""
    every, good = set(), set()
    for (_, seg, step), known_good in v.stored_checkpoints.items():
        later = [f for g, f in v.segment_firsts.items() if g > seg]
        if not later or step < min(later):
            every.add(step)
            if known_good:
                good.add(step)
    return sorted(every), sorted(good)
