"""What the TE source costs per training step on the GPU (not a test; prints one JSON line per case).

Model: 4 ``te.TransformerLayer`` (hidden 2048, seq 2048, batch 4, BF16 params). Cases: no source,
and the source's ``read()`` after every backward, for DelayedScaling (history 1024) and
Float8CurrentScaling (hooks). Reports the median step time and the host time of one ``read()``.
Run from the repository root: ``python3 tests/gpu/te_read_cost.py``.
"""

from __future__ import annotations

import json
import statistics
import time
import warnings

import torch

warnings.simplefilter("ignore")

import transformer_engine.pytorch as te  # noqa: E402
from transformer_engine.common.recipe import DelayedScaling, Float8CurrentScaling  # noqa: E402

from fp8guard.agent.sources import te as te_source  # noqa: E402
from fp8guard.agent.sources.base import STATS  # noqa: E402

H, LAYERS, S, B, STEPS, WARM = 2048, 4, 2048, 4, 30, 5


def run(recipe_name: str, with_source: bool) -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.ModuleList([
        te.TransformerLayer(H, 4 * H, H // 128, params_dtype=torch.bfloat16, hidden_dropout=0.0,
                            attention_dropout=0.0, layer_number=i + 1) for i in range(LAYERS)]).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(S, B, H, device="cuda", dtype=torch.bfloat16)
    recipe = DelayedScaling(amax_history_len=1024) if recipe_name == "delayed" else Float8CurrentScaling()
    src = None
    out = None
    read_host: list[float] = []

    def step() -> None:
        with te.autocast(enabled=True, recipe=recipe):
            h = x
            for layer in model:
                h = layer(h)
        h.float().pow(2).mean().backward()
        if src is not None and out is not None:
            t0 = time.perf_counter()
            src.read(out)
            read_host.append(time.perf_counter() - t0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if with_source:
        src = te_source.discover(model, required=True)
        assert src is not None
        out = torch.zeros(len(STATS), len(src.tensors()), device="cuda")
    times = []
    for i in range(WARM + STEPS):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= WARM:
            times.append(time.perf_counter() - t0)
    result: dict[str, object] = {
        "recipe": recipe_name, "source": with_source, "tensors": len(src.tensors()) if src else 0,
        "median_step_ms": round(statistics.median(times) * 1e3, 3),
        # inside the step: includes waiting for a launch queue the backward filled
        "read_in_step_host_us": round(statistics.median(read_host[WARM:]) * 1e6, 1) if read_host else None}
    if src is not None and out is not None:
        # read() alone on an idle GPU: host time per call, and GPU time of 100 calls / 100
        host = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            src.read(out)
            host.append(time.perf_counter() - t0)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(100):
            src.read(out)
        end.record()
        end.synchronize()
        result["read_idle_host_us"] = round(statistics.median(host) * 1e6, 1)
        result["read_gpu_us"] = round(start.elapsed_time(end) * 1e3 / 100, 1)
    return result


if __name__ == "__main__":
    for name in ("delayed", "current"):
        for with_source in (False, True) * 3:  # interleaved, to see run-to-run noise
            print(json.dumps(run(name, with_source)), flush=True)
