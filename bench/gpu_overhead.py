"""Every-step telemetry overhead of the fp8guard agent on a real Transformer Engine model on one
GPU, side by side in one run, plus a check that the agent adds no host sync.

    python bench/gpu_overhead.py --json

The model is the one in ``../shared/gpu/te_baseline.py`` (beside the checkout): 12
``te.TransformerLayer`` (hidden 2048, FFN 8192, 16 heads, about 604M parameters, bf16
parameters), sequence 2048, batch 8, fused AdamW, loss = mean(h**2). It trains under
``DelayedScaling(HYBRID, amax_history_len=1024, max)``.

1. One FP8 warm-up step, then the Monitor is attached::

       Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50,
                             count_interval_steps=0), transport=NullTransport()).attach(model, opt)

   ``monitor.step(loss)`` runs after ``opt.step()`` and before ``zero_grad``. It records the loss,
   the global grad norm (computed on the device), and TE's amax/scale/history-max of every FP8
   operand. Every 50 steps it flushes: one non-blocking device-to-host copy into pinned memory,
   then encoding on the shipper thread, which NullTransport discards.
2. Timing: ``--rounds`` rounds, each with one block of ``--block`` plain FP8 steps and one block
   of FP8 steps + ``monitor.step``, in an order that flips every round. A block is timed as
   synchronize, then the steps with no sync between them, then synchronize. That is the
   throughput of a training loop that never syncs. The figure is the median over blocks of the
   block time / steps, for each mode. The ratio is monitored over plain.
   Then an untimed probe: CUDA events around the parts of ``monitor.step`` while the GPU is
   still busy with the step, so the events bracket only the monitor's kernels. One part is the
   grad norm, the other is the rest with that norm handed in. The probe also takes the host time
   of ``monitor.step`` on an idle GPU.
3. Sync check: ``torch.cuda.set_sync_debug_mode("error")`` is set around whole training steps.
   It is set first for ``--sync-steps-plain`` plain steps, to show that TE's step itself does not
   sync and so the check is meaningful. Then it is set for ``--sync-steps`` monitored steps, at
   least one of which flushes. After each monitored step the script also asks the stream (a
   query, not a sync) whether the step's GPU work is still pending. If it is, ``monitor.step``
   cannot have waited for the device.

Prints one JSON line. Without CUDA, Transformer Engine or FP8 support it prints
``{"skipped": reason}`` and exits 0.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._paired import MONITOR, paired_ratios
from bench._te_model import Records, skip


def _skip(reason: str) -> None:
    skip("gpu_overhead", reason)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="accepted for symmetry; the JSON line is always printed")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--block", type=int, default=10, help="steps per mode per round")
    parser.add_argument("--warmup", type=int, default=8, help="steps of each mode before timing")
    parser.add_argument("--probe-steps", type=int, default=10, help="steps of each untimed cost probe")
    parser.add_argument("--sync-steps", type=int, default=60, help="monitored steps under sync debug 'error'")
    parser.add_argument("--sync-steps-plain", type=int, default=10, help="plain steps under sync debug 'error'")
    parser.add_argument("--layers", type=int, default=int(os.environ.get("L", 12)))
    parser.add_argument("--hidden", type=int, default=int(os.environ.get("H", 2048)))
    parser.add_argument("--seq", type=int, default=int(os.environ.get("S", 2048)))
    parser.add_argument("--batch", type=int, default=int(os.environ.get("B", 8)))
    parser.add_argument("--out", default=os.environ.get("OUT"), help="also write the JSON line to OUT/gpu_overhead.json")
    args = parser.parse_args()

    try:
        import torch
    except ImportError as exc:
        _skip(f"torch not importable: {exc}")
    if not torch.cuda.is_available():
        _skip("needs a CUDA GPU (torch.cuda.is_available() is False)")
    try:
        import transformer_engine
        import transformer_engine.pytorch as te
        from transformer_engine.common.recipe import DelayedScaling, Format
    except Exception as exc:  # ImportError, or TE's own load errors (missing libs)
        _skip(f"Transformer Engine not importable: {type(exc).__name__}: {exc}"[:300])
    fp8_ok = te.is_fp8_available()
    if isinstance(fp8_ok, tuple):  # some TE versions return (available, reason)
        fp8_ok, why = fp8_ok[0], fp8_ok[1]
    else:
        why = ""
    if not fp8_ok:
        _skip(f"FP8 not available on {torch.cuda.get_device_name()}: {why}")

    from fp8guard.agent import Monitor, MonitorConfig, NullTransport
    from fp8guard.agent.kernels import triton_available

    records = Records()
    logging.getLogger("fp8guard").addHandler(records)

    H, L, S, B = args.hidden, args.layers, args.seq, args.batch
    torch.manual_seed(0)
    model = torch.nn.ModuleList([
        te.TransformerLayer(H, 4 * H, H // 128, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0, fuse_qkv_params=True, layer_number=i + 1,
                            name=f"layer{i}")
        for i in range(L)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=1024, amax_compute_algo="max")
    stream = torch.cuda.current_stream()

    monitor: Any = None

    def train_step(with_agent: bool) -> None:
        with te.autocast(enabled=True, recipe=recipe):
            h = x
            for layer in model:
                h = layer(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        if with_agent:
            monitor.step(loss)  # grad norm computed on the device: before zero_grad
        opt.zero_grad(set_to_none=True)

    # FP8 warm-up step: TE creates its FP8 state at the first FP8 forward; attach after it.
    train_step(False)
    torch.cuda.synchronize()
    transport = NullTransport()
    monitor = Monitor(MonitorConfig(url=None, sources=["te"], flush_interval_steps=50, count_interval_steps=0),
                      transport=transport).attach(model, opt)
    ring = monitor._ring  # a flush empties it: len(ring) == 0 right after a step that flushed

    for _ in range(args.warmup):
        train_step(False)
    for _ in range(args.warmup):
        train_step(True)
    torch.cuda.synchronize()

    # -- 2. timing, alternating blocks ---------------------------------------------------------
    per_step: dict[str, list[float]] = {"plain": [], "agent": []}
    host_us: list[float] = []  # host time of the monitor.step call itself
    flushes_timed = 0
    t_start = time.perf_counter()
    for r in range(args.rounds):
        order = ("plain", "agent") if r % 2 == 0 else ("agent", "plain")
        for mode in order:
            agent = mode == "agent"
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.block):
                if agent:
                    with te.autocast(enabled=True, recipe=recipe):
                        h = x
                        for layer in model:
                            h = layer(h)
                    loss = h.float().pow(2).mean()
                    loss.backward()
                    opt.step()
                    c0 = time.perf_counter()
                    monitor.step(loss)
                    host_us.append((time.perf_counter() - c0) * 1e6)
                    opt.zero_grad(set_to_none=True)
                    flushes_timed += len(ring) == 0
                else:
                    train_step(False)
            torch.cuda.synchronize()
            per_step[mode].append((time.perf_counter() - t0) / args.block * 1e3)
    timed_s = time.perf_counter() - t_start

    plain_ms = statistics.median(per_step["plain"])
    agent_ms = statistics.median(per_step["agent"])
    # Paired ratios: each round's agent block over the same round's plain block.
    paired = sorted(a / p for a, p in zip(per_step["agent"], per_step["plain"], strict=True))

    # -- 2b. where the cost goes (untimed pass): the GPU time of the monitor's own kernels, from
    # CUDA events around monitor.step while the GPU is still busy with the step (so the events
    # bracket only the monitor's kernels), and the host time of monitor.step on an idle GPU
    # (without the back-pressure of a launch queue that the backward filled).
    gpu_ms: list[float] = []
    norm_ms: list[float] = []
    foreach_ms: list[float] = []
    rest_ms: list[float] = []
    grad_bytes = 0
    idle_host_us: list[float] = []
    norm_rel_diff = float("nan")
    for k in range(2 * args.probe_steps):
        with te.autocast(enabled=True, recipe=recipe):
            h = x
            for layer in model:
                h = layer(h)
        loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        if k < args.probe_steps:
            # The default monitor.step split in two: the grad norm it computes, then the rest
            # (loss copy, TE read, ring writes) with that norm handed in.
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(5)]
            ev[0].record()
            gn = monitor.grad_norm()
            ev[1].record()
            monitor.step(loss, grad_norm=gn)
            ev[2].record()
            # The previous default, for comparison: torch._foreach_norm over every gradient.
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            ev[3].record()
            old = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
            ev[4].record()
            grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters()
                             if p.grad is not None)
            opt.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            if len(ring):  # leave out a step that flushed
                norm_ms.append(ev[0].elapsed_time(ev[1]))
                rest_ms.append(ev[1].elapsed_time(ev[2]))
                gpu_ms.append(ev[0].elapsed_time(ev[2]))
                foreach_ms.append(ev[3].elapsed_time(ev[4]))
                norm_rel_diff = float((gn - old).abs() / old)
        else:
            torch.cuda.synchronize()
            c0 = time.perf_counter()
            monitor.step(loss)
            idle_host_us.append((time.perf_counter() - c0) * 1e6)
            opt.zero_grad(set_to_none=True)

    # -- 3. sync check ---------------------------------------------------------------------------
    def sync_pass(n: int, with_agent: bool) -> dict[str, Any]:
        out: dict[str, Any] = {"steps": n, "raised": None, "flushes": 0, "pending_after_monitor_step": 0}
        torch.cuda.synchronize()
        done = 0
        try:
            for i in range(n):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    if with_agent:
                        with te.autocast(enabled=True, recipe=recipe):
                            h = x
                            for layer in model:
                                h = layer(h)
                        loss = h.float().pow(2).mean()
                        loss.backward()
                        opt.step()
                        monitor.step(loss)
                        # A query, not a sync: still-pending work proves monitor.step did not wait.
                        out["pending_after_monitor_step"] += not stream.query()
                        opt.zero_grad(set_to_none=True)
                        out["flushes"] += len(ring) == 0
                    else:
                        train_step(False)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                done = i + 1
        except RuntimeError as exc:
            frames = traceback.extract_tb(exc.__traceback__)
            out["raised"] = {"at_step": done, "error": str(exc).splitlines()[0][:300],
                             "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[-6:]]}
            opt.zero_grad(set_to_none=True)
        out["steps_done"] = done
        torch.cuda.synchronize()
        return out

    # Positive control: the checker is live, a real sync (.item()) raises under "error".
    torch.cuda.set_sync_debug_mode("error")
    try:
        x[0, 0, 0].item()
        control_raised = False
    except RuntimeError:
        control_raised = True
    finally:
        torch.cuda.set_sync_debug_mode(0)

    sync_plain = sync_pass(args.sync_steps_plain, False)
    shipped_before = monitor._shipper.stats().processed if monitor._shipper else 0
    sync_agent = sync_pass(args.sync_steps, True)
    monitor.flush()  # waits (outside the checked region) for the shipper thread to finish the flushes
    shipped_after = monitor._shipper.stats().processed if monitor._shipper else 0
    sync_agent["flushes_shipped"] = shipped_after - shipped_before

    try:
        harm = _harm_probe(torch, te, model, x, recipe, monitor, plain_ms)
    except Exception as exc:  # the overhead figures above stand on their own
        harm = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    shipper = monitor._shipper.stats() if monitor._shipper else None
    broken = bool(monitor._broken)
    n_columns = len(monitor.tensors)
    monitor.close()

    n_params = sum(p.numel() for p in model.parameters())
    result = {
        "bench": "gpu_overhead",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "transformer_engine": transformer_engine.__version__,
        "model": {"layers": L, "hidden": H, "seq": S, "batch": B, "params_M": round(n_params / 1e6)},
        "recipe": "DelayedScaling(HYBRID, amax_history_len=1024, max)",
        "monitor": {"sources": ["te"], "flush_interval_steps": 50, "count_interval_steps": 0,
                    "transport": "NullTransport", "columns": n_columns},
        "rounds": args.rounds, "block": args.block,
        "plain_fp8_ms_per_step": round(plain_ms, 3),
        "agent_fp8_ms_per_step": round(agent_ms, 3),
        "ratio": round(agent_ms / plain_ms, 5),
        "paired_ratio_median": round(statistics.median(paired), 5),
        "paired_ratio_min_max": [round(paired[0], 5), round(paired[-1], 5)],
        "paired": paired_ratios(per_step["agent"], per_step["plain"], MONITOR),
        "plain_block_ms_min_max": [round(min(per_step["plain"]), 3), round(max(per_step["plain"]), 3)],
        "agent_block_ms_min_max": [round(min(per_step["agent"]), 3), round(max(per_step["agent"]), 3)],
        "target_ratio_max": MONITOR,
        "meets_target": agent_ms / plain_ms <= MONITOR,
        "monitor_step_host_us_in_loop_median": round(statistics.median(host_us), 1),
        "monitor_step_host_us_in_loop_p90": round(sorted(host_us)[int(0.9 * (len(host_us) - 1))], 1),
        "flushes_in_timed_blocks": flushes_timed,
        "monitor_step_gpu_ms_median": round(statistics.median(gpu_ms), 4) if gpu_ms else None,
        "monitor_step_gpu_share_of_plain_step": round(statistics.median(gpu_ms) / plain_ms, 5) if gpu_ms else None,
        "monitor_step_gpu_ms_split": {
            "grad_norm_ms": round(statistics.median(norm_ms), 4) if norm_ms else None,
            "rest_ms": round(statistics.median(rest_ms), 4) if rest_ms else None,
            "grad_bytes_GB": round(grad_bytes / 1e9, 3),
            "grad_norm_GBps": round(grad_bytes / 1e6 / statistics.median(norm_ms)) if norm_ms else None,
            "grad_norm_kernel": "triton" if triton_available(torch.device("cuda")) else "foreach",
            "foreach_norm_ms": round(statistics.median(foreach_ms), 4) if foreach_ms else None,
            "foreach_norm_GBps": round(grad_bytes / 1e6 / statistics.median(foreach_ms)) if foreach_ms else None,
            "norm_rel_diff_vs_foreach": norm_rel_diff},
        "monitor_step_host_us_idle_gpu_median": round(statistics.median(idle_host_us), 1),
        "tokens_per_s_plain": round(S * B / (plain_ms / 1e3)),
        "timed_s": round(timed_s, 1),
        "sync_debug": {"mode": "error", "control_item_raised": control_raised,
                       "plain": sync_plain, "agent": sync_agent,
                       "ok": control_raised and sync_plain["raised"] is None and sync_agent["raised"] is None
                       and sync_agent["flushes"] >= 1},
        "shipper": None if shipper is None else {"submitted": shipper.submitted, "processed": shipper.processed,
                                                 "errors": shipper.errors, "dropped": shipper.dropped},
        "transport_batches": transport.stats().sent_batches,
        "harm_probe": harm,
        "monitor_broken": broken,
        "agent_log": records.messages[:10],
    }
    line = json.dumps(result)
    print(line, flush=True)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_overhead.json").write_text(line + "\n")


def _harm_probe(torch: Any, te: Any, model: Any, x: Any, recipe: Any, monitor: Any, plain_ms: float,
                n: int = 10) -> dict[str, Any]:
    """The harm probe on this model: its GPU time (two no-grad forwards, CUDA events), the cost it
    adds at the default interval (probe time / (interval x plain step)), the gap of this healthy
    run, and that it leaves TE's FP8 state, the RNG and the host (no sync) as they were."""
    harm = monitor._harm
    if harm is None:
        return {"skipped": "the monitor has no harm probe (no probeable source)"}

    def loss_fn() -> Any:
        with te.autocast(enabled=True, recipe=recipe):
            h = x
            for layer in model:
                h = layer(h)
        return h.float().pow(2).mean()

    hists, scales = monitor.sources[0]._live_state()
    before = [t.clone() for t in (*hists, *scales)]
    rng = torch.cuda.get_rng_state()
    harm.measure(1, loss_fn)  # warm-up (first BF16 forward of TE's modules)
    torch.cuda.synchronize()
    times, gaps = [], []
    raised = None
    for i in range(n):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if i == n - 1:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out = harm.measure(2 + i, loss_fn)
        except RuntimeError as exc:
            raised = str(exc)[:200]
            out = None
        finally:
            torch.cuda.set_sync_debug_mode("default")
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if out is not None:
            gaps.append(float(out[2]))
    state_kept = all(torch.equal(a, b) for a, b in zip(before, (*hists, *scales), strict=True))
    interval = monitor.config.harm_interval_steps
    probe_ms = statistics.median(times)
    return {
        "probe_ms_median": round(probe_ms, 3), "probe_ms_min_max": [round(min(times), 3), round(max(times), 3)],
        "plain_step_ms": round(plain_ms, 3), "probe_over_step": round(probe_ms / plain_ms, 4),
        "interval_steps": interval, "cost_at_interval": round(probe_ms / (interval * plain_ms), 5),
        "target_cost_max": 0.005, "meets_target": probe_ms / (interval * plain_ms) <= 0.005,
        "healthy_gaps": [round(g, 6) for g in gaps],
        "fp8_state_unchanged": state_kept, "rng_unchanged": torch.equal(rng, torch.cuda.get_rng_state()),
        "sync_debug_raised": raised,
    }


if __name__ == "__main__":
    main()
