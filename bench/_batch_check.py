"""The same casts counted twice: at once, as TE hands each over, and held for a batched launch.

``count_batch.CountBatch`` holds an operand from TE's ``inspect_tensor`` call until its launch (its
module's forward end, the backward's end, a read). Its counts equal TE's only if nothing changes
the held tensors in between, which ``bench/gpu_counts.py verify --batched`` checks on the 604M
model's ``TransformerLayer`` stack. :func:`batched_vs_at_once` checks it inside any run, here the
heal bench's nanoGPT model of ``te.Linear`` modules (``bench/gpu_heal.py --check-batch``): while it
is open, every operand a ``CountBatch`` takes is also counted at once into a row of its own, and
held a second time by a shadow batch that launches exactly when the real one does, into another
row; the run's own counts are untouched. At the end each operand's two rows must be equal.

What it checks is holding: whether anything changes an operand between its hand-over and the
moment the run's batch launches it. The shadow runs the same kernel with the same arguments but its
own count rows, so a fault in the run's launch alone (a wrong address for the run's row) is not
its business: the batched kernel's GPU tests and ``bench/gpu_counts.py verify --batched`` hold the
run's own counts to TE's. Operands the run's batch never launched inside the block (dropped, still
held at its end, or in a launch that raised) are reported and not compared.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def batched_vs_at_once(limit: int = 20) -> Iterator[dict[str, Any]]:
    """Yields the report, filled in when the block ends: operands compared (those a batch held),
    how many differ, per TE tensor the operands, differing ones and summed counts both ways, up to
    ``limit`` examples, and ``alone``: operands the batch counted at once itself (nothing held).
    A block that raises compares nothing (``aborted``); the patches are undone either way."""
    import torch

    from fp8guard.agent.kernels import count_cast_into
    from fp8guard.agent.kernels.count_batch import CountBatch
    from fp8guard.agent.sources import te_counts

    report: dict[str, Any] = {}
    pairs: list[tuple[str, int | None, torch.Tensor, torch.Tensor]] = []
    shadows: weakref.WeakKeyDictionary[CountBatch, CountBatch] = weakref.WeakKeyDictionary()
    alone = [0]  # operands the batch counted at once itself (not batchable): nothing held to compare
    failed = [0]  # operands whose launch by the run's batch raised
    current: dict[str, Any] = {"name": "?", "step": None}
    orig_inspect, orig_add = te_counts.InspectCounts.inspect, CountBatch.add
    orig_flush_group, orig_drop = CountBatch._flush_group, CountBatch.drop

    def inspect(self: Any, layer_name: str, tensor_name: str, *args: Any, **kwargs: Any) -> None:
        current["name"], current["step"] = f"{layer_name}:{tensor_name}", self.step
        orig_inspect(self, layer_name, tensor_name, *args, **kwargs)

    def add(self: CountBatch, out: torch.Tensor, x: torch.Tensor, *, scale: torch.Tensor, scale_inv: torch.Tensor,
            fmt: Any, fp8_bytes: torch.Tensor) -> None:
        # (the shadow's own adds call the original: this runs for the run's batches alone)
        shadow = shadows.get(self)
        if shadow is None:
            shadow = shadows[self] = CountBatch(self.slots, max_held_bytes=self.max_held_bytes)
        at_once = torch.zeros(2, dtype=torch.int64, device=out.device)
        held = torch.zeros(2, dtype=torch.int64, device=out.device)
        count_cast_into(at_once, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
        before = shadow.alone
        orig_add(shadow, held, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)
        if shadow.alone == before:
            pairs.append((current["name"], current["step"], at_once, held))
        else:
            alone[0] += 1
        orig_add(self, out, x, scale=scale, scale_inv=scale_inv, fmt=fmt, fp8_bytes=fp8_bytes)

    def forget(rows: set[int]) -> int:
        """Leave the pairs whose shadow rows are ``rows`` out of the comparison; how many there were."""
        before = len(pairs)
        pairs[:] = [p for p in pairs if id(p[3]) not in rows]
        return before - len(pairs)

    def flush_group(self: CountBatch, key: tuple[Any, ...], held: list[Any]) -> None:
        shadow = shadows.get(self)
        group = list(shadow._pending.get(key, ())) if shadow is not None else []
        if shadow is not None and group:
            orig_flush_group(shadow, key, shadow._pending[key])
        try:
            orig_flush_group(self, key, held)
        except BaseException:  # the run's launch failed: its counts are lost, so these compare nothing
            failed[0] += forget({id(h.out) for h in group})
            raise

    def drop(self: CountBatch) -> None:
        shadow = shadows.get(self)
        if shadow is not None:  # never launched: not compared
            forget({id(h.out) for held in shadow._pending.values() for h in held})
            orig_drop(shadow)
        orig_drop(self)

    patches = {"inspect": (te_counts.InspectCounts, inspect), "add": (CountBatch, add),
               "_flush_group": (CountBatch, flush_group), "drop": (CountBatch, drop)}
    saved = {name: getattr(owner, name) for name, (owner, _) in patches.items()}
    for name, (owner, fn) in patches.items():
        setattr(owner, name, fn)
    try:
        yield report
    except BaseException:
        # The run failed: what its batch held may never have launched, so nothing is compared.
        report.update({"operands": len(pairs), "differing": None, "aborted": True})
        raise
    else:
        # What the run's batch still holds was not launched inside the block: not compared.
        left = 0
        for shadow in shadows.values():
            left += forget({id(h.out) for held in shadow._pending.values() for h in held})
            shadow.drop()
        report.update(_compare(pairs, limit), alone=alone[0], still_held=left, launch_failed=failed[0])
    finally:
        for name, (owner, _) in patches.items():
            setattr(owner, name, saved[name])


def _compare(pairs: list[tuple[str, int | None, Any, Any]], limit: int) -> dict[str, Any]:
    import torch

    if not pairs:
        return {"operands": 0, "differing": 0, "by_tensor": {}, "examples": []}
    at_once = torch.stack([p[2] for p in pairs]).cpu().tolist()
    held = torch.stack([p[3] for p in pairs]).cpu().tolist()
    by_tensor: dict[str, dict[str, Any]] = {}
    examples = []
    differing = 0
    for (name, step, _, _), a, h in zip(pairs, at_once, held, strict=True):
        row = by_tensor.setdefault(name, {"operands": 0, "differing": 0, "at_once": [0, 0], "held": [0, 0]})
        row["operands"] += 1
        row["at_once"] = [row["at_once"][0] + a[0], row["at_once"][1] + a[1]]
        row["held"] = [row["held"][0] + h[0], row["held"][1] + h[1]]
        if a != h:
            differing += 1
            row["differing"] += 1
            if len(examples) < limit:
                examples.append({"tensor": name, "step": step, "at_once": a, "held": h})
    return {"operands": len(pairs), "differing": differing, "by_tensor": by_tensor, "examples": examples,
            "counts": "[overflows, underflows] per operand"}
