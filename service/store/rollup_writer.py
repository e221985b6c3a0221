"""Roll-up rows of ``tensor_series`` (levels 32, 512, 8192): kept in step with the raw rows.

Two ways, chosen by the writer per batch:

* ``merge_rollups``, the hot path, for batches that only add steps: the new extremes are folded
  into the stored rows (min of mins, max of maxes). Folding can only widen a row, so it is right
  only when no stored step changes value.
* ``recompute_rollups``, for batches that overwrite stored steps (a job resuming in its segment
  re-sends steps with other values under new batch ids): the touched blocks are rebuilt from the
  rows one level down, raw rows first, so a value replaced is gone from every zoom level. Folding
  had kept it (raw 1 -> 1000 -> 2 read raw 2 but a zoomed-out max of 1000).

A ``RollupTail`` caches, per (run, rank), the newest row of each (stat, level) this process
wrote, so a batch continuing the segment skips reading them back. It is valid only for the
newest rows: the writer publishes one only after a batch that extended its segment (or with a
tail already current), never after an older or overwriting batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import sqlalchemy as sa

from fp8guard.service.store import buckets, sql

__all__ = ["SERIES_COLUMNS", "RollupTail", "merge_rollups", "recompute_rollups", "upsert_rows"]

SERIES_COLUMNS = "run_pk, rank, segment, stat_id, level, block, data"

Levels = dict[int, tuple[np.ndarray[Any, Any], np.ndarray[Any, Any], np.ndarray[Any, Any]]]


@dataclass
class RollupTail:
    batches: int
    """The rank's batch counter after the write this tail describes."""
    segment: int
    last: dict[tuple[int, int], tuple[int, bytes]]
    """(stat_id, level) -> (newest block, its row): the only rows a following batch extends."""


def upsert_rows(conn: sa.Connection, rows: list[tuple[Any, ...]]) -> None:
    """Insert or replace ``tensor_series`` rows (roll-ups; raw rows have their own COPY path)."""
    if not rows:
        return
    if conn.dialect.name == "postgresql":
        # One statement, the rows as binary arrays: in a pipeline every statement costs a send, and
        # ``executemany`` sends one per row. The rows' keys are distinct (one row per stat, level
        # and block), as ON CONFLICT DO UPDATE requires of one statement.
        keys = {r[:3] for r in rows}
        assert len(keys) == 1, "roll-up rows of one (run, rank, segment)"
        _, _, _, sids, levels, blocks, data = zip(*rows, strict=True)
        sql.run(conn, f"INSERT INTO tensor_series ({SERIES_COLUMNS}) SELECT ?, ?, ?, * FROM unnest(?::int4[], "
                      "?::int2[], ?::int8[], %b::bytea[]) "
                      "ON CONFLICT (run_pk, rank, segment, stat_id, level, block) DO UPDATE SET data = EXCLUDED.data",
                (*next(iter(keys)), sql.array_literal(sids), sql.array_literal(levels), sql.array_literal(blocks),
                 list(data)))
    else:
        sql.run_many(conn, f"INSERT OR REPLACE INTO tensor_series ({SERIES_COLUMNS}) VALUES (?,?,?,?,?,?,?)", rows)


def recompute_rollups(conn: sa.Connection, key: tuple[int, int, int], ids: list[int],
                      steps: np.ndarray[Any, Any]) -> None:
    """Rebuild every roll-up block that holds one of ``steps`` from the rows one level down (the
    raw rows, already written by this transaction, for the first level). Reads at most
    ``level / below`` child rows per rebuilt row: 32, then 16, then 16."""
    children = np.unique(np.asarray(steps, dtype=np.int64))
    below = 1
    for level in buckets.ROLLUP_LEVELS:
        parents = np.unique(children * below // level)
        stored = _read_children(conn, key, ids, below, int(parents[0]) * level // below,
                                (int(parents[-1]) + 1) * level // below - 1)
        rows: list[tuple[Any, ...]] = []
        for sid in ids:
            got = stored.get(sid)
            if not got:
                continue
            blocks = np.fromiter((b for b, _ in got), dtype=np.int64, count=len(got))
            width = max(len(blob) for _, blob in got) // (4 * (1 if below == 1 else 2))
            mins, maxs = buckets.unpack_rows([blob for _, blob in got], level=below, num_tensors=width)
            ids_up, lo, hi = buckets.group_minmax(mins, maxs, blocks * below // level)
            wanted = np.isin(ids_up, parents)
            rows += [(*key, sid, level, int(blk), buckets.pack_minmax(lo[j], hi[j]))
                     for j, blk in enumerate(ids_up.tolist()) if wanted[j]]
        upsert_rows(conn, rows)
        children, below = parents, level


def _read_children(conn: sa.Connection, key: tuple[int, int, int], ids: list[int], level: int, first: int,
                   last: int) -> dict[int, list[tuple[int, bytes]]]:
    """Rows of ``level`` with blocks in [first, last], per stat, in block order."""
    rows = sql.fetch_all(
        conn, "SELECT stat_id, block, data FROM tensor_series WHERE run_pk = ? AND rank = ? AND segment = ? "
              f"AND level = ? AND block BETWEEN ? AND ? AND stat_id IN ({', '.join('?' * len(ids))}) "
              "ORDER BY stat_id, block", (*key, level, first, last, *ids))
    out: dict[int, list[tuple[int, bytes]]] = {}
    for sid, blk, data in rows:
        out.setdefault(int(sid), []).append((int(blk), bytes(data)))
    return out


def merge_rollups(
    conn: sa.Connection, key: tuple[int, int, int], ids: list[int], levels: Levels, tail: RollupTail | None,
    new_tail: RollupTail,
) -> None:
    """Fold new (blocks, stats, tensors) extremes of every level into the stored roll-up rows:
    one read of the touched rows (skipped when this process's tail is current), one write."""
    existing = _existing_from_tail(tail, ids, levels)
    if existing is None:
        existing = _read_rollups(conn, key, ids, {lv: (int(b[0]), int(b[-1])) for lv, (b, _, _) in levels.items()})
    rows: list[tuple[Any, ...]] = []
    for level, (blocks, mins, maxs) in levels.items():
        block_list = blocks.tolist()
        width = int(mins.shape[2])
        # Every (stat, block) row of the level at once, stat-major as the rows go out: the min
        # plane then the max plane of each, folded with the stored rows of the same width in
        # one numpy call (a call per row was most of a small batch's roll-up time).
        planes = np.empty((len(ids), len(block_list), 2, width), dtype="<f4")
        planes[:, :, 0] = mins.transpose(1, 0, 2)
        planes[:, :, 1] = maxs.transpose(1, 0, 2)
        flat = planes.reshape(-1, 2, width)
        olds = [existing.get((sid, level, blk)) for sid in ids for blk in block_list]
        size = 8 * width
        same = [i for i, old in enumerate(olds) if old is not None and len(old) == size]
        if same:
            joined = b"".join([old for old in olds if old is not None and len(old) == size])
            stored = np.frombuffer(joined, dtype="<f4").reshape(len(same), 2, width)
            flat[same, 0] = np.minimum(flat[same, 0], stored[:, 0])
            flat[same, 1] = np.maximum(flat[same, 1], stored[:, 1])
        buf = flat.tobytes()
        data = [buf[i * size:(i + 1) * size] for i in range(len(olds))]
        for i, old in enumerate(olds):
            if old is not None and len(old) != size:  # the run's tensor table grew: widths differ
                data[i] = buckets.pack_minmax(*_merge(old, flat[i, 0], flat[i, 1]))
        i = 0
        for sid in ids:
            for blk in block_list:
                rows.append((*key, sid, level, blk, data[i]))
                i += 1
            prev = new_tail.last.get((sid, level))
            if prev is None or prev[0] <= rows[-1][5]:
                new_tail.last[(sid, level)] = (rows[-1][5], rows[-1][6])
    upsert_rows(conn, rows)


def _existing_from_tail(
    tail: RollupTail | None, ids: list[int], levels: Levels,
) -> dict[tuple[int, int, int], bytes] | None:
    """The stored rows a batch touches, from the tail, or None when the database must be read.

    With a current tail, a touched block is either the tail's newest block (its bytes are in
    the tail), newer than it (not stored yet), or older (out of order: read the database)."""
    if tail is None:
        return None
    existing: dict[tuple[int, int, int], bytes] = {}
    for level, (blocks, _, _) in levels.items():
        for sid in ids:
            newest = tail.last.get((sid, level))
            if newest is None:
                continue  # this stat was never written in this segment
            if int(blocks[0]) < newest[0]:
                return None
            if int(blocks[0]) == newest[0]:
                existing[(sid, level, newest[0])] = newest[1]
    return existing


def _read_rollups(
    conn: sa.Connection, key: tuple[int, int, int], ids: list[int], ranges: dict[int, tuple[int, int]]
) -> dict[tuple[int, int, int], bytes]:
    # One SELECT per level, glued with UNION ALL: an OR of ranges made PostgreSQL's planner use
    # only the index prefix (run, rank, segment) and filter the whole run (12 ms per batch).
    part = ("SELECT stat_id, level, block, data FROM tensor_series WHERE run_pk = ? AND rank = ? AND segment = ? "
            f"AND level = ? AND block BETWEEN ? AND ? AND stat_id IN ({', '.join('?' * len(ids))})")
    params: list[Any] = []
    for lv, (a, b) in ranges.items():
        params += [*key, lv, a, b, *ids]
    rows = sql.fetch_all(conn, " UNION ALL ".join([part] * len(ranges)), params)
    return {(int(sid), int(lv), int(blk)): bytes(data) for sid, lv, blk, data in rows}


def _merge(old: bytes, lo: np.ndarray[Any, Any], hi: np.ndarray[Any, Any]) -> tuple[Any, Any]:
    """Combine a stored roll-up with new extremes; the longer tensor axis wins (tensors are
    only ever appended), missing entries act as min/max identities."""
    planes = np.frombuffer(old, dtype="<f4").reshape(2, -1)
    width = max(planes.shape[1], lo.shape[0])
    out_lo = np.full(width, np.inf, dtype=np.float32)
    out_hi = np.full(width, -np.inf, dtype=np.float32)
    out_lo[: planes.shape[1]] = planes[0]
    out_hi[: planes.shape[1]] = planes[1]
    out_lo[: lo.shape[0]] = np.minimum(out_lo[: lo.shape[0]], lo)
    out_hi[: hi.shape[0]] = np.maximum(out_hi[: hi.shape[0]], hi)
    return out_lo, out_hi
