"""``_Staging``: device tables of addresses uploaded without a host sync.

The table kernels (:mod:`.table_norm`, :mod:`.history_gather`) read many tensors in one launch
through a device table of their addresses; the table travels only when the tensors move.
"""

from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence

import torch

STAGING_SLOTS = 8
"""Host staging buffers in flight at once: a table re-pointed more often than this many times
while the device is behind is not re-pointed on that call (it never waits)."""


class Staging:
    """Uploads an int64 table to the device without a host sync: pinned host buffers, each with
    its own event (created once), filled with one ``memmove`` from an ``array('q')`` (a C-level
    conversion of the values; a ctypes slice assignment converted them one by one, 50 us for
    1,152 addresses on a 2-core CI host against 2 us) and copied non-blocking. On the CPU
    (Triton's interpreter) the table is written in place."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        n = table.numel()
        self._cuda = table.device.type == "cuda"
        if self._cuda:
            self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(STAGING_SLOTS)]
            self._events = [torch.cuda.Event() for _ in range(STAGING_SLOTS)]  # type: ignore[no-untyped-call]
            self._used = [False] * STAGING_SLOTS
            self._at = [h.data_ptr() for h in self._host]
        else:
            self._at = [table.data_ptr()]
        self._n = n
        self._slot = 0

    def upload(self, values: Sequence[int]) -> bool:
        """Enqueue the copy of ``values`` (as many as the table holds; an ``array('q')`` is used
        as it is) into the table; False (nothing enqueued) while the next staging buffer is
        still being copied from (a query, never a wait)."""
        words = values if isinstance(values, array) and values.typecode == "q" else array("q", values)
        if len(words) != self._n:
            raise ValueError(f"Staging: {len(words)} values for a table of {self._n}")
        if not self._cuda:
            ctypes.memmove(self._at[0], words.buffer_info()[0], 8 * self._n)
            return True
        j = self._slot
        if self._used[j] and not self._events[j].query():  # type: ignore[no-untyped-call]
            return False
        ctypes.memmove(self._at[j], words.buffer_info()[0], 8 * self._n)
        self.table.copy_(self._host[j], non_blocking=True)
        self._events[j].record()
        self._used[j] = True
        self._slot = (j + 1) % STAGING_SLOTS
        return True
