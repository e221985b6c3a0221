"""The ingest path: one batch stored completely or not at all, in the caller's transaction.

Order inside the transaction matters:
1. the batch id is inserted first, so a retried (or concurrently duplicated) batch stops here;
2. the (run, rank) progress row is updated next; its row lock serialises writers of one rank
   across service processes sharing PostgreSQL, which keeps the roll-up read-modify-write safe.
   On PostgreSQL a rank whose progress this process knows from its own last write is not read
   first (a round trip): the statement checks that the rank is as known and otherwise fails the
   transaction (``StaleProgress``), which is then written again the careful way;
3. tensor and stat tables, scalars, raw stat rows (COPY on PostgreSQL), roll-ups, events;
4. what the agent reported as fact (acknowledged commands, saved checkpoints, precision it
   applied): data, stored with the batch that carries it;
5. the batch's row in the closed loop's queue, so the loop judges it exactly once.

Nothing here decides anything: detection and policy run later, in the loop (``service/loop``).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any

import numpy as np
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from fp8guard import wire
from fp8guard.service.domain import Batch, IngestResult, StatBlock, StepRow, TensorInfo
from fp8guard.service.errors import Conflict, InvalidPayload, NotFound
from fp8guard.service.kinds import ActionStatus, Precision
from fp8guard.service.store import buckets, sql
from fp8guard.service.store.rollup_writer import SERIES_COLUMNS, RollupTail, merge_rollups, recompute_rollups
from fp8guard.service.store.write_cache import CacheTxn, Progress
from fp8guard.wire import STEP_FIELDS

__all__ = ["STALE_PROGRESS_SQLSTATE", "StaleProgress", "ingest_batch", "upsert_insert"]

_STATUS_BY_EVENT = {"run_finished": "finished", "run_failed": "failed", "run_started": "running", "run_resumed": "running"}


def upsert_insert(conn: sa.Connection) -> Callable[..., Any]:
    """The dialect's INSERT construct (both offer on_conflict_do_nothing/do_update)."""
    return postgresql.insert if conn.dialect.name == "postgresql" else sqlite.insert


def ingest_batch(conn: sa.Connection, batch: Batch, now: datetime,
                 cache: CacheTxn) -> tuple[IngestResult, int, sql.Later | None]:
    """Store the batch in the caller's transaction; returns (result, run primary key, the row
    holding its ``loop_queue`` id: read it once the statement was answered, None for a batch
    with no steps or a duplicate)."""
    run_pk = cache.run_pks.get(batch.run_id)
    if run_pk is None:
        row = sql.fetch_one(conn, "SELECT id FROM runs WHERE run_id = ?", (batch.run_id,))
        run_pk = None if row is None else int(row[0])
        if run_pk is not None:
            cache.pending.append(("run_pks", batch.run_id, run_pk))
    if run_pk is None:
        raise NotFound(
            f"run {batch.run_id!r} is not registered; register it first with PUT /v1/runs/{batch.run_id}",
            loc=("body", "run_id"),
        )
    samples = batch.num_samples
    progress = _accept(conn, run_pk, batch, now, samples, cache)
    if progress is None:
        return IngestResult(batch_id=batch.batch_id, duplicate=True, steps=0, samples=0, run_pk=run_pk), run_pk, None

    first_step, last_step = _step_range(batch)
    overlap, extends, fresh = _touch_segment(conn, run_pk, batch, first_step, last_step, progress)
    _define_tensors(conn, run_pk, batch.tensors, first_step if first_step is not None else 0)
    _check_tensor_coverage(conn, run_pk, batch.blocks, cache)
    stat_ids = _stat_ids(conn, run_pk, {name for b in batch.blocks for name in b.stats}, cache)
    _write_steps(conn, run_pk, batch, overlap=overlap)
    tail = cache.tail((run_pk, batch.rank))
    if tail is not None and (tail.batches != progress.batches - 1 or tail.segment != batch.segment):
        tail = None  # another process wrote this rank meanwhile, or a new segment began
    if fresh:  # a new segment has no roll-up rows yet: nothing to read back
        tail = RollupTail(batches=progress.batches - 1, segment=batch.segment, last={})
    new_tail = RollupTail(batches=progress.batches, segment=batch.segment, last=dict(tail.last) if tail else {})
    for block in batch.blocks:
        _write_block(conn, run_pk, batch, block, stat_ids, overlap=overlap, tail=tail, new_tail=new_tail)
    if not overlap and (tail is not None or extends):
        # Otherwise the rows this batch wrote may not be the segment's newest: no tail, so the
        # rank's next batch reads what it extends from the database.
        cache.pending.append(("tails", (run_pk, batch.rank), new_tail))
        cache.staged_tails[(run_pk, batch.rank)] = new_tail
    _write_events(conn, run_pk, batch)
    cache.wrote_progress((run_pk, batch.rank), _update_progress(conn, run_pk, batch, progress, last_step, samples))
    _record_agent_facts(conn, run_pk, batch, now)
    queue_row = None
    if first_step is not None and last_step is not None:
        queue_row = sql.fetch_later(conn, "INSERT INTO loop_queue (run_pk, rank, segment, first_step, last_step) "
                                          "VALUES (?, ?, ?, ?, ?) RETURNING id",
                                    (run_pk, batch.rank, batch.segment, first_step, last_step))
    return IngestResult(batch_id=batch.batch_id, duplicate=False, steps=len(batch.steps), samples=samples,
                        run_pk=run_pk), run_pk, queue_row


STALE_PROGRESS_SQLSTATE = "F8G01"
"""What ``fp8guard_expect`` (migration 0006) raises: the transaction wrote nothing."""


class StaleProgress(Exception):
    """The rank's progress was not what this process knew from its last write (another process
    wrote the rank meanwhile, or the batch is stored already): the transaction failed and wrote
    nothing; write the batch again with ``CacheTxn.optimistic`` off."""


_INSERT_BATCH = ("INSERT INTO ingest_batches (run_pk, batch_id, rank, received_at, steps, samples) "
                 "VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING")
_BUMP_RANK = "UPDATE run_ranks SET batches = batches + 1, updated_at = ? WHERE run_pk = ? AND rank = ?"
_PROGRESS = "RETURNING last_step, last_segment, batches"
_ACCEPT_PG = (f"WITH accepted AS ({_INSERT_BATCH} RETURNING rank), "
              f"bumped AS ({_BUMP_RANK} AND EXISTS (SELECT 1 FROM accepted) {_PROGRESS}) "
              "SELECT (SELECT count(*) FROM accepted), b.last_step, b.last_segment, b.batches "
              "FROM (SELECT 1) AS one LEFT JOIN bumped AS b ON true")
"""Both first steps in one statement (one round trip): the batch id goes in unless it is stored
already, and only then is the rank's counter bumped, which takes its row lock until commit."""
_ACCEPT_EXPECT_PG = (f"WITH accepted AS ({_INSERT_BATCH} RETURNING rank), "
                     f"bumped AS ({_BUMP_RANK} AND EXISTS (SELECT 1 FROM accepted) {_PROGRESS}) "
                     "SELECT fp8guard_expect(EXISTS (SELECT 1 FROM bumped WHERE batches = ?::bigint "
                     "AND last_segment = ?::int AND last_step IS NOT DISTINCT FROM ?::bigint), "
                     "'fp8guard: the rank''s progress is not what this process last wrote')")
"""``_ACCEPT_PG`` sent without waiting for its answer: it fails the transaction unless the batch
is new and the rank is as expected."""


def _accept(conn: sa.Connection, run_pk: int, batch: Batch, now: datetime, samples: int,
            cache: CacheTxn) -> Progress | None:
    """Record the batch id and lock the rank; the rank's progress, or None for a duplicate."""
    when = sql.timestamp(conn, now)
    inserted = (run_pk, batch.batch_id, batch.rank, when, len(batch.steps), samples)
    bump = (when, run_pk, batch.rank)
    if conn.dialect.name == "postgresql":
        known = cache.known_progress((run_pk, batch.rank))
        if known is not None:
            expected = Progress(known.last_step, known.last_segment, known.batches + 1)
            sql.run(conn, _ACCEPT_EXPECT_PG,
                    (*inserted, *bump, expected.batches, expected.last_segment, expected.last_step))
            return expected
        row = sql.fetch_one(conn, _ACCEPT_PG, (*inserted, *bump))
        assert row is not None
        if not row[0]:
            return None
        if row[3] is not None:
            return Progress(row[1], int(row[2]), int(row[3]))
    # RETURNING: rowcount is not portable for INSERT .. ON CONFLICT
    elif sql.fetch_one(conn, f"{_INSERT_BATCH} RETURNING rank", inserted) is None:
        return None
    else:
        row = sql.fetch_one(conn, f"{_BUMP_RANK} {_PROGRESS}", bump)
        if row is not None:
            return Progress(row[0], int(row[1]), int(row[2]))
    # The rank's first batch: its progress row does not exist yet.
    sql.run(conn, "INSERT INTO run_ranks (run_pk, rank, last_segment, batches, samples, updated_at, last_loss_nan) "
                  "VALUES (?, ?, 0, 0, 0, ?, ?) ON CONFLICT DO NOTHING", (run_pk, batch.rank, when, False))
    row = sql.fetch_one(conn, f"{_BUMP_RANK} {_PROGRESS}", bump)
    assert row is not None
    return Progress(row[0], int(row[1]), int(row[2]))


def _step_range(batch: Batch) -> tuple[int | None, int | None]:
    lows = [r.step for r in batch.steps] + [int(b.steps[0]) for b in batch.blocks if b.steps.size]
    highs = [r.step for r in batch.steps] + [int(b.steps[-1]) for b in batch.blocks if b.steps.size]
    lows += [e.step for e in batch.events if e.step is not None]
    highs += [e.step for e in batch.events if e.step is not None]
    return (min(lows), max(highs)) if lows else (None, None)


def _touch_segment(
    conn: sa.Connection, run_pk: int, batch: Batch, first: int | None, last: int | None, progress: Progress
) -> tuple[bool, bool, bool]:
    """Extend the segment's step range; return whether this batch may overwrite stored steps,
    whether it comes after every step stored in its segment (the segment's newest rows are its),
    and whether the segment is new (nothing of it is stored yet)."""
    if first is None or last is None:
        return False, False, False
    key = (run_pk, batch.rank, batch.segment)
    if batch.segment == progress.last_segment and progress.last_step is not None and first > progress.last_step:
        # The common case, a batch continuing the current segment: one UPDATE, no read.
        sql.run(conn, "UPDATE segments SET last_step = ? WHERE run_pk = ? AND rank = ? AND segment = ?", (last, *key))
        return False, True, False
    row = sql.fetch_one(conn, "SELECT first_step, last_step FROM segments WHERE run_pk = ? AND rank = ? AND segment = ?",
                        key)
    if row is None:
        sql.run(conn, "INSERT INTO segments (run_pk, rank, segment, first_step, last_step) VALUES (?, ?, ?, ?, ?)",
                (*key, first, last))
        return False, True, True
    stored_first, stored_last = int(row[0]), int(row[1])
    sql.run(conn, "UPDATE segments SET first_step = ?, last_step = ? WHERE run_pk = ? AND rank = ? AND segment = ?",
            (min(stored_first, first), max(stored_last, last), *key))
    return bool(first <= stored_last and last >= stored_first), bool(first > stored_last), False


def _define_tensors(conn: sa.Connection, run_pk: int, tensors: Sequence[TensorInfo], first_step: int) -> None:
    if not tensors:
        return
    # ON CONFLICT DO NOTHING, then read back: two ranks may define the same table at once. A run's
    # first batch carries its whole table (hundreds of rows): one statement on PostgreSQL, its rows
    # in one JSON parameter (a row per statement, or arrays, cost 5-30 ms of Python per table);
    # the read-back asks for the index range, a constant statement.
    if conn.dialect.name == "postgresql":
        rows = json.dumps([[t.index, t.name, t.module, t.role, t.fp8_format] for t in tensors])
        sql.run(conn, "INSERT INTO tensors (run_pk, idx, name, module, role, fp8_format, first_step) "
                      "SELECT ?, (r->>0)::int, r->>1, r->>2, r->>3, r->>4, ? FROM json_array_elements(?::json) AS r "
                      "ON CONFLICT DO NOTHING", (run_pk, first_step, rows))
    else:
        sql.run_many(conn, "INSERT INTO tensors (run_pk, idx, name, module, role, fp8_format, first_step) "
                           "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                     [(run_pk, t.index, t.name, t.module, t.role, t.fp8_format, first_step) for t in tensors])
    wanted = {t.index for t in tensors}
    stored = {int(i): str(n) for i, n in sql.fetch_all(
        conn, "SELECT idx, name FROM tensors WHERE run_pk = ? AND idx BETWEEN ? AND ?",
        (run_pk, min(wanted), max(wanted))) if i in wanted}
    for pos, t in enumerate(tensors):
        have = stored.get(t.index)
        if have != t.name:
            what = f"index {t.index} is already {have!r}" if have is not None else f"name {t.name!r} already has another index"
            raise Conflict(f"tensor {t.name!r} (index {t.index}) conflicts with this run's tensor table: {what}",
                           loc=("body", "tensors", pos))


def _check_tensor_coverage(conn: sa.Connection, run_pk: int, blocks: Sequence[StatBlock], cache: CacheTxn) -> None:
    if not blocks:
        return
    needed = max(int(b.values.shape[2]) for b in blocks)
    if cache.tensors_defined.get(run_pk, 0) >= needed:
        return
    row = sql.fetch_one(conn, "SELECT count(*) FROM tensors WHERE run_pk = ? AND idx < ?", (run_pk, needed))
    defined = 0 if row is None else int(row[0])
    if defined != needed:
        pos = next(i for i, b in enumerate(blocks) if b.values.shape[2] == needed)
        raise InvalidPayload(
            f"n_tensors is {needed} but only {defined} of tensors 0..{needed - 1} are defined for this run; "
            "send their definitions in `tensors` (once per run is enough)",
            loc=("body", "tensor_stats", pos, "n_tensors"),
        )
    cache.pending.append(("tensors_defined", run_pk, needed))


def _stat_ids(conn: sa.Connection, run_pk: int, names: Iterable[str], cache: CacheTxn) -> dict[str, int]:
    names = sorted(set(names))
    known = {n: cache.stat_ids[(run_pk, n)] for n in names if (run_pk, n) in cache.stat_ids}
    if len(known) == len(names):
        return known
    sql.run_many(conn, "INSERT INTO stats (run_pk, name) VALUES (?, ?) ON CONFLICT DO NOTHING",
                 [(run_pk, n) for n in names])
    wanted = set(names)
    ids = {str(n): int(i) for n, i in sql.fetch_all(conn, "SELECT name, id FROM stats WHERE run_pk = ?", (run_pk,))
           if n in wanted}
    cache.pending.extend(("stat_ids", (run_pk, n), i) for n, i in ids.items())
    return ids


_STEP_COLUMNS = ("run_pk", "rank", "segment", "step", "time", *STEP_FIELDS, "tokens", "nan_mask")


def _step_row(run_pk: int, batch: Batch, rec: StepRow) -> tuple[Any, ...]:
    values: list[float | None] = []
    mask = 0
    for bit, name in enumerate(STEP_FIELDS):
        value = getattr(rec, name)
        if value is not None and math.isnan(value):
            mask |= 1 << bit
            value = None  # SQLite cannot hold NaN; the mask bit keeps it distinct from "absent"
        values.append(value)
    return (run_pk, batch.rank, batch.segment, rec.step, rec.time, *values, rec.tokens, mask)


def _write_steps(conn: sa.Connection, run_pk: int, batch: Batch, *, overlap: bool) -> None:
    if not batch.steps:
        return
    rows = [_step_row(run_pk, batch, rec) for rec in batch.steps]
    if conn.dialect.name == "postgresql" and not overlap:
        # One statement of fixed text, the columns as arrays: it rides in the ingest pipeline
        # (COPY cannot), and costs no more Python than COPY's rows did.
        sql.run(conn, _INSERT_STEPS_PG, (run_pk, batch.rank, batch.segment,
                                         *(sql.array_literal(col) for col in list(zip(*rows, strict=True))[3:])))
        return
    sql.run_many(conn, _UPSERT_STEPS, rows)


_STEP_TYPES = ("bigint", "float8", *["float8"] * len(STEP_FIELDS), "bigint", "int2")
_INSERT_STEPS_PG = (f"INSERT INTO steps ({', '.join(_STEP_COLUMNS)}) SELECT ?, ?, ?, * FROM unnest("
                    f"{', '.join(f'?::{t}[]' for t in _STEP_TYPES)})")
_UPSERT_STEPS = (f"INSERT INTO steps ({', '.join(_STEP_COLUMNS)}) VALUES ({', '.join(['?'] * len(_STEP_COLUMNS))}) "
                 f"ON CONFLICT (run_pk, rank, segment, step) DO UPDATE SET "
                 f"{', '.join(f'{c} = excluded.{c}' for c in _STEP_COLUMNS[4:])}")


def _write_block(
    conn: sa.Connection, run_pk: int, batch: Batch, block: StatBlock, stat_ids: dict[str, int], *, overlap: bool,
    tail: RollupTail | None, new_tail: RollupTail,
) -> None:
    key = (run_pk, batch.rank, batch.segment)
    values = np.ascontiguousarray(block.values.astype("<f4", copy=False))
    steps = block.steps
    ids = [stat_ids[n] for n in block.stats]
    _write_raw(conn, key, ids, steps, values, overlap=overlap)
    if overlap:  # stored steps may change value: folding would keep the old extremes
        recompute_rollups(conn, key, ids, steps)
    else:
        merge_rollups(conn, key, ids, buckets.rollups(steps, values), tail, new_tail)


_INSERT_RAW_PG = (f"INSERT INTO tensor_series ({SERIES_COLUMNS}) "
                  "SELECT ?, ?, ?, s.stat_id, 1, b.block, "
                  "substring(%b::bytea from (((s.k - 1) * ?::int + b.i - 1) * ?::int + 1)::int for ?::int) "
                  "FROM unnest(?::int4[]) WITH ORDINALITY AS s(stat_id, k), unnest(?::int8[]) WITH ORDINALITY AS b(block, i)")
"""The raw rows of a block, (stat, step) pairs, cut server-side from one blob of the values in
(stat, step, tensor) order: no Python per row, and a statement that rides in the pipeline (COPY cannot)."""


def _write_raw(
    conn: sa.Connection, key: tuple[int, int, int], stat_ids: list[int], steps: np.ndarray[Any, Any],
    values: np.ndarray[Any, Any], *, overlap: bool,
) -> None:
    """``values``: (steps, stats, tensors) float32, as the block holds them."""
    step_list = [int(s) for s in steps]
    if conn.dialect.name != "postgresql":
        rows = [(*key, sid, 1, step, values[i, k].tobytes())
                for k, sid in enumerate(stat_ids) for i, step in enumerate(step_list)]
        sql.run_many(conn, f"INSERT OR REPLACE INTO tensor_series ({SERIES_COLUMNS}) VALUES (?,?,?,?,?,?,?)", rows)
        return
    if overlap:  # an insert cannot replace: clear re-sent steps first (we hold the rank lock)
        sql.run(conn, "DELETE FROM tensor_series WHERE run_pk = ? AND rank = ? AND segment = ? AND level = 1 "
                      "AND stat_id = ANY(?::int4[]) AND block = ANY(?::int8[])",
                (*key, sql.array_literal(stat_ids), sql.array_literal(step_list)))
    width = int(values.shape[2]) * 4
    blob = np.ascontiguousarray(values.transpose(1, 0, 2)).tobytes()
    sql.run(conn, _INSERT_RAW_PG, (*key, blob, len(step_list), width, width, sql.array_literal(stat_ids),
                                   sql.array_literal(step_list)))


def _write_events(conn: sa.Connection, run_pk: int, batch: Batch) -> None:
    if not batch.events:
        return
    sql.run_many(conn, "INSERT INTO events (run_pk, rank, segment, step, time, kind, data) VALUES (?, ?, ?, ?, ?, ?, ?)",
                 [(run_pk, batch.rank, batch.segment, e.step, e.time, e.kind, json.dumps(e.data)) for e in batch.events])
    status = next((_STATUS_BY_EVENT[e.kind] for e in reversed(batch.events) if e.kind in _STATUS_BY_EVENT), None)
    if status is not None:
        sql.run(conn, "UPDATE runs SET status = ? WHERE id = ?", (status, run_pk))


def _update_progress(
    conn: sa.Connection, run_pk: int, batch: Batch, progress: Progress, last_step: int | None, samples: int
) -> Progress:
    """Update the rank's progress row; what it holds after the batch."""
    newer = last_step is not None and (
        progress.last_step is None
        or batch.segment > progress.last_segment
        or (batch.segment == progress.last_segment and last_step >= progress.last_step)
    )
    latest = max(batch.steps, key=lambda r: r.step, default=None) if newer else None
    if not newer:
        sql.run(conn, "UPDATE run_ranks SET samples = samples + ? WHERE run_pk = ? AND rank = ?",
                (samples, run_pk, batch.rank))
    elif latest is None:
        sql.run(conn, "UPDATE run_ranks SET samples = samples + ?, last_step = ?, last_segment = ? "
                      "WHERE run_pk = ? AND rank = ?", (samples, last_step, batch.segment, run_pk, batch.rank))
    else:
        nan = latest.loss is not None and math.isnan(latest.loss)
        sql.run(conn, "UPDATE run_ranks SET samples = samples + ?, last_step = ?, last_segment = ?, last_time = ?, "
                      "last_loss = ?, last_loss_nan = ? WHERE run_pk = ? AND rank = ?",
                (samples, last_step, batch.segment, latest.time, None if nan else latest.loss, nan, run_pk,
                 batch.rank))
    if newer:
        return Progress(last_step, batch.segment, progress.batches)
    return progress


def _record_agent_facts(conn: sa.Connection, run_pk: int, batch: Batch, now: datetime) -> None:
    """Acknowledged commands, saved checkpoints and applied precision changes, as the agent
    reported them. ``layer_precision`` is written here only: a module is BF16 once the agent
    says it applied the switch, never because a command is pending."""
    for e in batch.events:
        data: dict[str, Any] = e.data or {}
        if e.kind == wire.EventKind.COMMAND_ACKNOWLEDGED:
            ack = wire.CommandAck.from_json(data)  # validated at the door already
            sql.run(conn, "UPDATE actions SET status = ?, applied_step = ?, applied_at = ?, error = ? "
                          "WHERE run_pk = ? AND id = ? AND status IN (?, ?)",
                    (str(ActionStatus(ack.status.value)), ack.applied_step or e.step, sql.timestamp(conn, now),
                     ack.error[:1024] if ack.error else None, run_pk, ack.command_id,
                     str(ActionStatus.PENDING), str(ActionStatus.RECOMMENDED)))
        elif e.kind == wire.EventKind.CHECKPOINT_SAVED and e.step is not None:
            sql.run(conn, "INSERT INTO checkpoints (run_pk, rank, segment, step, path, known_good, created_at) "
                          "VALUES (?, ?, ?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                    (run_pk, batch.rank, batch.segment, e.step,
                     str(data.get("path"))[:1024] if data.get("path") else None,
                     bool(data.get("known_good", False)), sql.timestamp(conn, now)))
        elif e.kind in (wire.EventKind.FALLBACK_APPLIED, wire.EventKind.PROMOTION_APPLIED) and e.step is not None:
            modules = data.get("modules")
            if not modules:
                modules = sorted({module or name.split(":")[0] for name, module in sql.fetch_all(
                    conn, "SELECT name, module FROM tensors WHERE run_pk = ?", (run_pk,))})
            command_id = data.get("command_id") if isinstance(data.get("command_id"), int) else None
            precision = Precision.FP8
            if e.kind == wire.EventKind.FALLBACK_APPLIED:
                row = sql.fetch_one(conn, "SELECT payload FROM actions WHERE run_pk = ? AND id = ?",
                                    (run_pk, command_id)) if command_id is not None else None
                details = sql.json_value(conn, row[0]) if row is not None else None
                precision = Precision.PINNED if (details or {}).get("escalation") else Precision.BF16
            _set_precision(conn, run_pk, [str(m) for m in modules], precision, e.step, command_id)


def _set_precision(conn: sa.Connection, run_pk: int, modules: Sequence[str], precision: Precision, step: int,
                   action_id: int | None) -> None:
    if not modules:
        return
    sql.run_many(conn, "INSERT INTO layer_precision (run_pk, module, precision, since_step, action_id) "
                       "VALUES (?, ?, ?, ?, ?) ON CONFLICT (run_pk, module) DO UPDATE SET "
                       "precision = excluded.precision, since_step = excluded.since_step, action_id = excluded.action_id",
                 [(run_pk, m, str(precision), step, action_id) for m in modules])
