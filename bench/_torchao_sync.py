"""``bench/gpu_torchao.py``'s ``sync`` part (GPU only, last): ``--sync-steps`` plain and then
monitored steps under ``torch.cuda.set_sync_debug_mode("error")``, and no error in the agent's
log.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bench._te_model import Records
from bench._torchao_model import Loop, source_off


def part_sync(torch: Any, loop: Loop, steps: int, records: Records) -> dict[str, Any]:
    """Whole steps under sync debug 'error': plain first (is the check meaningful?), then
    monitored. The monitor swallows its own errors (and switches off), so its log is checked too:
    this part runs last."""
    out: dict[str, Any] = {}
    logged = len(records.messages)
    for mode in ("plain", "monitor"):
        torch.cuda.synchronize()
        raised = None
        done = 0
        with source_off(loop.model) if mode == "plain" else contextlib.nullcontext():
            try:
                for _ in range(steps):
                    torch.cuda.set_sync_debug_mode("error")
                    try:
                        loop.step(mode)
                    finally:
                        torch.cuda.set_sync_debug_mode(0)
                    done += 1
            except Exception as exc:
                raised = f"{type(exc).__name__}: {exc}"[:400]
        torch.cuda.synchronize()
        loop.opt.zero_grad(set_to_none=True)  # a step cut short leaves its gradients
        out[mode] = {"steps": done, "raised": raised}
    out["monitor_log"] = records.messages[logged:][:5]
    out["ok"] = (out["monitor"]["raised"] is None and out["monitor"]["steps"] == steps
                 and not any(m.startswith(("ERROR", "CRITICAL")) for m in out["monitor_log"]))
    return out
