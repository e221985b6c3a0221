"""``bench/gpu_torchao.py``'s ``heal`` part: a BF16 fallback and re-promotion of one
``Float8Linear`` through the real Remediator while training runs.

``heal``: ``--heal-steps`` more training steps split in three phases; a ``fallback`` command
for one ``Float8Linear`` arrives through ``monitor.receive_commands`` (the path the service's
commands take) at the end of phase 1, a ``promote`` at the end of phase 2; the Remediator is
``Remediator(model=model)``. Checked per step: torchao's casts of that module (counted in
torchao's own cast function: none while in BF16), its output against ``F.linear`` of its
input (equal only in BF16), the ``aten::_scaled_mm`` calls of one profiled step per phase
(GPU: 3 fewer in BF16) and the loss (finite, training goes on).
"""

from __future__ import annotations

from typing import Any

from bench._torchao_casts import TorchaoCasts
from bench._torchao_model import Loop


def part_heal(torch: Any, loop: Loop, steps: int, remediator: Any, start: int) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    from fp8guard.agent.sources.torchao import in_fp8

    names = [n for n, m in loop.model.named_modules() if hasattr(m, "linear_mm_config")]
    target = next((n for n in names if n.endswith("fc1") and n.startswith(f"{len(loop.model) // 2}.")), names[0])
    module = loop.model.get_submodule(target)
    seen: dict[str, Any] = {}

    def check_output(m: Any, args: Any, out: Any) -> None:  # before the optimizer moves the weight
        with torch.no_grad():
            plain = torch.nn.functional.linear(args[0].to(m.weight.dtype), m.weight, m.bias)
        seen.update(equal=bool(torch.equal(out, plain)), dtype=str(out.dtype))

    handle = module.register_forward_hook(check_output)
    outcomes: list[dict[str, Any]] = []
    apply = remediator.apply

    def recording_apply(command: Any, *, step: int) -> Any:
        outcome = apply(command, step=step)
        outcomes.append({"kind": str(command.kind), "step": step, "status": str(outcome.status),
                         "error": outcome.error, "details": outcome.details})
        return outcome

    remediator.apply = recording_apply
    phase_len = max(2, steps // 3)
    rows: list[dict[str, Any]] = []
    try:
        with TorchaoCasts(loop.model) as casts:
            for i in range(3 * phase_len):
                phase = ("fp8", "bf16", "fp8_again")[i // phase_len]
                s = start + i
                if i == phase_len - 1:
                    loop.monitor.receive_commands([{"id": 9001, "kind": "fallback", "modules": [target],
                                                    "reason": "gpu_torchao bench"}])
                if i == 2 * phase_len - 1:
                    loop.monitor.receive_commands([{"id": 9002, "kind": "promote", "modules": [target],
                                                    "reason": "gpu_torchao bench"}])
                was_fp8 = in_fp8(module)  # the precision this step's forward/backward ran in
                profiled = i % phase_len == 1
                if profiled:
                    with profile(activities=[ProfilerActivity.CPU]) as prof:
                        loss = loop.step("monitor", step=s)
                    # aten::_scaled_mm (or a later variant of it): the FP8 GEMMs of the whole step
                    scaled_mm = sum(1 for e in prof.events() if "scaled_mm" in e.name)
                else:
                    loss = loop.step("monitor", step=s)
                    scaled_mm = None
                recs = casts.take()
                rows.append({"step": s, "phase": phase, "in_fp8": was_fp8, "loss": float(loss),
                             "target_casts": sum(1 for r in recs if r["module"] == target),
                             "all_casts": len(recs), "output_equals_plain_linear": seen["equal"],
                             "output_dtype": seen["dtype"], "scaled_mm_calls": scaled_mm})
    finally:
        handle.remove()
        remediator.apply = apply
    # a command received at a phase's last step applies after that step's backward: the next
    # phase is in its new precision from its first step
    by_phase = {p: [r for r in rows if r["phase"] == p] for p in ("fp8", "bf16", "fp8_again")}
    mm = {p: next((r["scaled_mm_calls"] for r in rs if r["scaled_mm_calls"] is not None), None)
          for p, rs in by_phase.items()}
    checks = {
        "fallback_applied": any(o["kind"] == "fallback" and o["status"] == "applied" for o in outcomes),
        "promote_applied": any(o["kind"] == "promote" and o["status"] == "applied" for o in outcomes),
        "fp8_casts_in_fp8": all(r["target_casts"] > 0 and not r["output_equals_plain_linear"]
                                and r["in_fp8"] for p in ("fp8", "fp8_again") for r in by_phase[p]),
        "no_casts_and_plain_gemm_in_bf16": all(r["target_casts"] == 0 and r["output_equals_plain_linear"]
                                               and not r["in_fp8"] for r in by_phase["bf16"]),
        "loss_finite": all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
    }
    if loop.x.is_cuda:
        # 3 GEMMs per Float8Linear (output, grad_input, grad_weight) leave FP8
        checks["fewer_scaled_mm_in_bf16"] = (
            None not in mm.values() and mm["fp8"] > mm["bf16"] and mm["fp8_again"] == mm["fp8"])
    return {"target": target, "phase_steps": phase_len, "outcomes": outcomes, "scaled_mm_per_step": mm,
            "checks": checks, "ok": all(checks.values()), "loss_first": rows[0]["loss"],
            "loss_last": rows[-1]["loss"], "steps": rows}
