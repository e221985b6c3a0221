"""Fused device kernels (Triton), each beside the torch path it must agree with.

One concept per module:

- :mod:`._launch`: whether Triton runs here, launch shapes (the only Triton import, with the
  kernels' own modules);
- :mod:`.counts`: exact FP8 cast counts (:func:`count_cast_into`), the same integers as the torch path;
  its Triton code in :mod:`._count_kernels`, imported only where Triton imports;
- :mod:`.count_batch`: several casts counted in one launch (:class:`~.count_batch.CountBatch`);
- :mod:`.staging`: device tables of addresses, uploaded without a host sync;
- :mod:`.table_norm`: the gradients' sum of squares in one launch (:class:`TableSumOfSquares`);
- :mod:`.history_gather`: TE's delayed-scaling reads in one launch (:class:`HistoryGather`);
- :mod:`.tripwire_check`: the tripwire's per-step check in one launch, bit for bit its torch ops';

Triton is optional (the agent's dependencies stay torch and httpx): every caller has a torch
path that runs where Triton or a GPU is missing. Triton's CPU interpreter (``TRITON_INTERPRET=1``)
runs the Triton paths on CPU tensors, which is how CI checks them against the torch references.
Nothing here synchronises with the host.
"""

from __future__ import annotations

from fp8guard.agent.kernels._launch import triton_available
from fp8guard.agent.kernels.counts import count_cast_into
from fp8guard.agent.kernels.history_gather import HistoryGather
from fp8guard.agent.kernels.table_norm import TableSumOfSquares

__all__ = ["HistoryGather", "TableSumOfSquares", "count_cast_into", "triton_available"]
