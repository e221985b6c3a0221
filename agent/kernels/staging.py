"""``_Staging``: device tables of addresses uploaded without a host sync.

The table kernels (:mod:`.table_norm`, :mod:`.history_gather`) read many tensors in one launch
through a device table of their addresses; the table travels only when the tensors move.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch

STAGING_SLOTS = 8
"""Host staging buffers in flight at once: a table re-pointed more often than this many times
while the device is behind is not re-pointed on that call (it never waits)."""


class Staging:
    """Uploads an int64 table to the device without a host sync: pinned host buffers, each with
    its own event (created once), written with C-level slice assignment and copied non-blocking.
    On the CPU (Triton's interpreter) the table is written in place."""

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table
        n = table.numel()
        self._cuda = table.device.type == "cuda"
        if self._cuda:
            self._host = [torch.zeros(n, dtype=torch.int64, pin_memory=True) for _ in range(STAGING_SLOTS)]
            self._events = [torch.cuda.Event() for _ in range(STAGING_SLOTS)]  # type: ignore[no-untyped-call]
            self._used = [False] * STAGING_SLOTS
            self._words = [(ctypes.c_int64 * n).from_address(h.data_ptr()) for h in self._host]
        else:
            self._words = [(ctypes.c_int64 * n).from_address(table.data_ptr())]
        self._slot = 0

    def upload(self, values: Sequence[int]) -> bool:
        """Enqueue the copy of ``values`` into the table; False (nothing enqueued) while the
        next staging buffer is still being copied from (a query, never a wait)."""
        if not self._cuda:
            self._words[0][:] = list(values)
            return True
        j = self._slot
        if self._used[j] and not self._events[j].query():  # type: ignore[no-untyped-call]
            return False
        self._words[j][:] = list(values)
        self.table.copy_(self._host[j], non_blocking=True)
        self._events[j].record()
        self._used[j] = True
        self._slot = (j + 1) % STAGING_SLOTS
        return True
