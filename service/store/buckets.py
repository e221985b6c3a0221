"""Extreme-preserving downsampling: bucket planning and NaN-propagating min/max reductions.

Every reduction here keeps the minimum and the maximum of each bucket, so a one-step spike
survives any zoom level. NaN propagates (a bucket that saw a NaN reports NaN): a NaN amax
or loss is exactly what a user zooming out must not lose. "No data" is encoded as
``min=+inf, max=-inf`` (the identities of min and max), i.e. a cell has data iff
``not (min > max)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "LEVELS",
    "ROLLUP_LEVELS",
    "BucketPlan",
    "empty_planes",
    "group_minmax",
    "pack_minmax",
    "plan_buckets",
    "reduce_into_columns",
    "rollups",
    "unpack_rows",
]

LEVELS = (1, 32, 512, 8192)
"""Block sizes (steps) stored: raw rows, then min/max roll-ups. Roll-ups cost 2/32 + 2/512 +
... = 6.7% of the raw bytes (the 20 bytes/sample budget leaves no room for a level 16), and
with the "up to 2x coarser" rule in ``plan_buckets`` a query reads at most ~32x its width."""
ROLLUP_LEVELS = LEVELS[1:]

F32 = npt.NDArray[np.float32]
I64 = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class BucketPlan:
    bucket: int
    """Steps per output column; a multiple of ``level``; buckets are aligned to multiples of it."""
    level: int
    """Which stored level to read."""
    first: int
    """Index (step // bucket) of the first column."""
    columns: int

    def column_steps(self) -> I64:
        return (np.arange(self.columns, dtype=np.int64) + self.first) * self.bucket


def plan_buckets(start: int, end: int, width: int) -> BucketPlan:
    """Choose the bucket size and stored level for ``[start, end]`` in at most ``width`` columns."""
    if width < 1:
        raise ValueError("width must be at least 1")
    if end < start:
        raise ValueError(f"end ({end}) must not be before start ({start})")
    span = end - start + 1
    bucket = max(1, -(-span // width))
    # Prefer a stored level up to 2x coarser than asked: at most halving the columns beats
    # reading up to 32x more rows from the level below.
    level = max(lv for lv in LEVELS if lv <= 2 * bucket)
    bucket = -(-bucket // level) * level
    # Aligning buckets to multiples of `bucket` can add one column; widen until it fits.
    while end // bucket - start // bucket + 1 > width:
        bucket += level
    return BucketPlan(bucket=bucket, level=level, first=start // bucket, columns=end // bucket - start // bucket + 1)


def group_minmax(mins: F32, maxs: F32, groups: I64) -> tuple[I64, F32, F32]:
    """Min of ``mins`` and max of ``maxs`` over runs of equal (sorted) ``groups`` along axis 0.

    NaN-propagating. A loop of ``.min(axis=0)`` over slices: numpy's ``reduceat`` is about
    20x slower on these shapes.
    """
    n = groups.size
    if n and groups[0] == groups[n - 1] and (n < 3 or bool((groups == groups[0]).all())):
        # one group: every roll-up level of a small batch (a few steps inside one block)
        return groups[:1], mins.min(axis=0, keepdims=True), maxs.max(axis=0, keepdims=True)
    starts = np.concatenate(([0], np.flatnonzero(groups[1:] != groups[:-1]) + 1))
    ends = np.append(starts[1:], n)
    sizes = ends - starts
    if sizes.size and np.all(sizes == sizes[0]) and groups.size == sizes.size * sizes[0]:
        k = int(sizes[0])
        shape = (sizes.size, k, *mins.shape[1:])
        return groups[starts], mins.reshape(shape).min(axis=1), maxs.reshape(shape).max(axis=1)
    out_min = np.empty((starts.size, *mins.shape[1:]), dtype=mins.dtype)
    out_max = np.empty((starts.size, *maxs.shape[1:]), dtype=maxs.dtype)
    for j, (a, b) in enumerate(zip(starts.tolist(), ends.tolist(), strict=True)):
        out_min[j] = mins[a:b].min(axis=0)
        out_max[j] = maxs[a:b].max(axis=0)
    return groups[starts], out_min, out_max


def rollups(steps: I64, values: F32) -> dict[int, tuple[I64, F32, F32]]:
    """Min/max per block for every roll-up level, each level built from the one below.

    ``steps`` sorted ascending; ``values`` shaped (steps, ...). Returns level -> (block ids,
    minima, maxima), minima/maxima shaped (blocks, ...).
    """
    out: dict[int, tuple[I64, F32, F32]] = {}
    blocks, mins, maxs = steps, values, values
    below = 1
    for level in ROLLUP_LEVELS:
        blocks, mins, maxs = group_minmax(mins, maxs, blocks * below // level)
        out[level] = (blocks, mins, maxs)
        below = level
    return out


def pack_minmax(minimum: F32, maximum: F32) -> bytes:
    """One roll-up row: the min plane then the max plane, little-endian float32."""
    return np.concatenate([minimum, maximum]).astype("<f4", copy=False).tobytes()


def unpack_rows(blobs: list[bytes], *, level: int, num_tensors: int) -> tuple[F32, F32]:
    """Decode stored rows into (rows x num_tensors) min and max arrays, padding tensors a row
    does not cover (added later in the run) with "no data"."""
    n = len(blobs)
    mins = np.full((n, num_tensors), np.inf, dtype=np.float32)
    maxs = np.full((n, num_tensors), -np.inf, dtype=np.float32)
    if n == 0:
        return mins, maxs
    planes = 1 if level == 1 else 2
    sizes = {len(b) for b in blobs}
    if len(sizes) == 1:  # fast path: one frombuffer for the whole result
        width = sizes.pop() // (4 * planes)
        arr = np.frombuffer(b"".join(blobs), dtype="<f4").reshape(n, planes, width)[:, :, :num_tensors]
        w = arr.shape[2]
        mins[:, :w] = arr[:, 0]
        maxs[:, :w] = arr[:, -1]
        return mins, maxs
    for i, blob in enumerate(blobs):
        row = np.frombuffer(blob, dtype="<f4").reshape(planes, -1)[:, :num_tensors]
        w = row.shape[1]
        mins[i, :w] = row[0]
        maxs[i, :w] = row[-1]
    return mins, maxs


def empty_planes(num_tensors: int, columns: int) -> tuple[F32, F32]:
    return (
        np.full((num_tensors, columns), np.inf, dtype=np.float32),
        np.full((num_tensors, columns), -np.inf, dtype=np.float32),
    )


def reduce_into_columns(
    plan: BucketPlan,
    blocks: I64,
    mins: F32,
    maxs: F32,
    out_min: F32,
    out_max: F32,
    present: npt.NDArray[np.bool_],
) -> None:
    """Fold rows (block ids at ``plan.level``, sorted) into the (tensors x columns) outputs."""
    if blocks.size == 0:
        return
    cols = blocks * plan.level // plan.bucket - plan.first
    keep = (cols >= 0) & (cols < plan.columns)
    cols, mins, maxs = cols[keep], mins[keep], maxs[keep]
    if cols.size == 0:
        return
    target, red_min, red_max = group_minmax(mins, maxs, cols)
    red_min, red_max = red_min.T, red_max.T
    # np.minimum (not fmin) so NaN wins, merging with what other segments already put there.
    out_min[:, target] = np.minimum(out_min[:, target], red_min)
    out_max[:, target] = np.maximum(out_max[:, target], red_max)
    present[target] = True
