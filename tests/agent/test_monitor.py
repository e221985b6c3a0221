"""The Monitor end to end on the CPU: a small GPT in emulated FP8 streams to the real service
app, and what it reported can be queried back exactly."""

from __future__ import annotations

import base64
import math
import threading
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import ConfigError, Monitor, MonitorConfig, emulate_fp8  # noqa: E402
from fp8guard.agent.transport import HttpTransport, JsonlFileTransport, NullTransport, RunInfo  # noqa: E402
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text  # noqa: E402

TINY = GPTConfig(block_size=32, n_layer=2, n_head=2, n_embd=32)


def _train(monitor: Monitor | None, steps: int, *, seed: int = 0, emulate: bool = True,
           record: list[dict[str, Any]] | None = None) -> tuple[torch.nn.Module, float]:
    torch.manual_seed(seed)
    model = GPT(TINY)
    fp8 = emulate_fp8(model) if emulate else None
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = TextBatches(stdlib_text(200_000), block_size=TINY.block_size, batch_size=4, seed=seed)
    if monitor is not None:
        monitor.attach(model, opt)
    loss = torch.zeros(())
    for _ in range(steps):
        x, y = data.next()
        _, loss = model(x, y)
        loss.backward()
        if fp8 is not None:
            fp8.update()
        if record is not None and fp8 is not None:
            mods = fp8.modules()
            record.append({
                "amax": torch.cat([torch.stack((m.last_amax_fwd[0], m.last_amax_fwd[1], m.last_amax_bwd[0]))
                                   for _, m in mods]).clone(),
                "scale_now": torch.cat([torch.stack((m.scale_fwd[0], m.scale_fwd[1], m.scale_bwd[0]))
                                        for _, m in mods]).clone(),
                "loss": loss.item(),
            })
        if monitor is not None:
            monitor.step(loss)
        opt.step()
        opt.zero_grad()
    return model, float(loss.detach())


def test_small_gpt_streams_and_reads_back_exactly(client) -> None:
    transport = HttpTransport("http://testserver", RunInfo(run_id="gpt-emu", model="tiny-gpt"), client=client)
    record: list[dict[str, Any]] = []
    monitor = Monitor(MonitorConfig(run_id="gpt-emu", flush_interval_steps=4, count_interval_steps=3),
                      transport=transport)
    _train(monitor, 10, record=record)
    monitor.close()

    detail = client.get("/v1/runs/gpt-emu").json()
    assert detail["status"] == "finished" and detail["last_step"] == 9
    n = len(monitor.tensors)
    assert detail["num_tensors"] == n == 3 * 9  # 2 blocks x 4 linears + lm_head, 3 operands each
    assert set(detail["stats"]) == {"amax", "scale", "saturation", "amax_history_max", "overflows", "underflows"}

    def matrix(stat: str) -> np.ndarray:
        m = client.get("/v1/runs/gpt-emu/matrix", params={"stat": stat}).json()
        return np.frombuffer(base64.b64decode(m["max"]), dtype="<f4").reshape(len(m["tensors"]), len(m["steps"]))

    amax, scale, sat = matrix("amax"), matrix("scale"), matrix("saturation")
    fp8_max = np.array([t.fp8_max for t in monitor.tensors], dtype=np.float32)
    for step, rec in enumerate(record):
        np.testing.assert_array_equal(amax[:, step], rec["amax"].numpy())
        # the scale in use at a step is the one set by the previous step's update (1 at first)
        in_use = record[step - 1]["scale_now"].numpy() if step else np.ones(n, dtype=np.float32)
        np.testing.assert_array_equal(scale[:, step], in_use)
        np.testing.assert_allclose(sat[:, step], rec["amax"].numpy() * in_use / fp8_max, rtol=1e-6)
    # first step: scale 1, so saturation = amax / fp8_max (< 1 here: clipping needs amax > 448)
    loss = client.get("/v1/runs/gpt-emu/scalars", params={"fields": "loss,grad_norm,lr"}).json()
    assert loss["min"]["loss"] == pytest.approx([r["loss"] for r in record], rel=1e-6)
    assert all(v > 0 for v in loss["min"]["grad_norm"]) and loss["min"]["lr"][0] == pytest.approx(3e-3)
    counts = client.get("/v1/runs/gpt-emu/matrix", params={"stat": "underflows", "encoding": "json"}).json()
    assert [s for s, p in zip(counts["steps"], counts["present"], strict=True) if p] == [0, 3, 6, 9]
    tensors = {t["name"]: t for t in client.get("/v1/runs/gpt-emu/tensors").json()}
    assert tensors["blocks.0.mlp_fc:bwd_grad_output"]["format"] == "e5m2"
    events = [e["kind"] for e in client.get("/v1/runs/gpt-emu/events").json()]
    assert events[0] == "run_started" and events[-1] == "run_finished"


def test_step_path_never_syncs_with_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU a sync cannot be observed, so forbid the calls that would sync on a GPU."""
    torch.manual_seed(0)
    model = GPT(TINY)
    fp8 = emulate_fp8(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    monitor = Monitor(MonitorConfig(flush_interval_steps=3, count_interval_steps=1), transport=NullTransport())
    monitor.attach(model, opt)
    data = TextBatches(stdlib_text(100_000), block_size=TINY.block_size, batch_size=2)
    trainer = threading.current_thread()

    def forbid(name: str) -> Any:
        original = getattr(torch.Tensor, name)

        def guarded(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if threading.current_thread() is trainer and guard["on"]:
                raise AssertionError(f"Tensor.{name} called on the training thread during Monitor.step")
            return original(self, *a, **k)
        return guarded

    guard = {"on": False}
    for name in ("item", "tolist", "cpu", "numpy", "__float__", "__bool__", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, forbid(name))
    for _ in range(7):
        x, y = data.next()
        _, loss = model(x, y)
        loss.backward()
        fp8.update()
        guard["on"] = True
        monitor.step(loss, tokens=64)
        guard["on"] = False
        opt.step()
        opt.zero_grad()
    assert not monitor._broken
    monitor.close()


def test_monitoring_never_kills_training(client) -> None:
    """A source that blows up mid-run switches monitoring off; the step returns normally."""
    monitor = Monitor(MonitorConfig(run_id="boom"), transport=NullTransport())
    torch.manual_seed(0)
    model = GPT(TINY)
    emulate_fp8(model)
    monitor.attach(model)

    def broken(out: torch.Tensor) -> None:
        raise RuntimeError("source exploded")

    monitor.sources[0].read = broken  # type: ignore[method-assign]
    monitor.step(1.0)
    monitor.step(1.0)
    assert monitor._broken
    monitor.close()


def test_service_down_spools_and_training_goes_on(tmp_path) -> None:
    monitor = Monitor(MonitorConfig(url="http://127.0.0.1:9", run_id="down", flush_interval_steps=2,
                                    spool_dir=tmp_path, timeout_s=0.5))
    _train(monitor, 4)
    monitor.close(timeout_s=10)
    assert sorted(p.suffix for p in tmp_path.iterdir()) and len(list(tmp_path.iterdir())) >= 2


def test_jsonl_transport_and_nan_loss(tmp_path) -> None:
    path = tmp_path / "out.jsonl"
    monitor = Monitor(MonitorConfig(run_id="nan", flush_interval_steps=100), transport=JsonlFileTransport(path))
    torch.manual_seed(0)
    model = GPT(TINY)
    emulate_fp8(model)
    monitor.attach(model)
    monitor.step(float("nan"), grad_norm=float("inf"))
    monitor.step(torch.tensor(2.0), grad_norm=torch.tensor(1.0))
    monitor.close()
    import json

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    steps = [s for b in lines for s in b["steps"]]
    assert steps[0]["loss"] == "NaN" and steps[0]["grad_norm"] == "Infinity" and steps[1]["loss"] == 2.0


def test_bad_configuration_fails_fast() -> None:
    with pytest.raises(ConfigError, match="flush_interval_steps"):
        MonitorConfig(flush_interval_steps=0)
    with pytest.raises(ConfigError, match="url"):
        MonitorConfig(url="localhost:8000")
    with pytest.raises(ConfigError, match="run_id"):
        MonitorConfig(run_id="has spaces")
    with pytest.raises(ConfigError, match="sources"):
        MonitorConfig(sources=["tpu"])  # type: ignore[list-item]
    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    with pytest.raises(ConfigError, match="emulation"):
        Monitor(MonitorConfig(sources=["emulation"])).attach(model)
    with pytest.raises(ConfigError, match="attach"):
        Monitor().step(1.0)


def test_plain_model_reports_scalars_only(client) -> None:
    transport = HttpTransport("http://testserver", RunInfo(run_id="plain"), client=client)
    monitor = Monitor(MonitorConfig(run_id="plain"), transport=transport)
    _train(monitor, 3, emulate=False)
    monitor.close()
    s = client.get("/v1/runs/plain/scalars", params={"fields": "loss"}).json()
    assert s["steps"] == [0, 1, 2] and all(math.isfinite(v) for v in s["min"]["loss"])


def test_count_cadence_reaches_sources_ahead_and_can_change() -> None:
    """Sources that must know the counting cadence ahead (TE's inspection API decides before
    each forward whether a layer takes its debug path) hear the step and cadence before every
    step; ``set_count_interval`` changes it at run time and bad values fail fast."""
    seen: list[tuple[int, int]] = []
    monitor = Monitor(MonitorConfig(url=None, count_interval_steps=3), transport=NullTransport())
    torch.manual_seed(0)
    model = GPT(TINY)
    emulate_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    monitor.attach(model, opt)
    src = monitor.sources[0]
    src.prepare_step = lambda step, every: seen.append((step, every))  # type: ignore[attr-defined]
    data = TextBatches(stdlib_text(100_000), block_size=TINY.block_size, batch_size=2)
    for i in range(5):
        if i == 3:
            monitor.set_count_interval(1)
        x, y = data.next()
        _, loss = model(x, y)
        loss.backward()
        monitor.step(loss)
        opt.zero_grad()
    assert seen == [(1, 3), (2, 3), (3, 3), (3, 1), (4, 1), (5, 1)]
    with pytest.raises(ConfigError, match=">= 0"):
        monitor.set_count_interval(-1)
    monitor.close()


def test_non_finite_event_data_is_stored_on_every_database(client) -> None:
    """D7: a NaN in event data used to make PostgreSQL refuse the whole batch (422), silently.
    It now travels as the scalars do ("NaN", "Infinity", "-Infinity") and the batch is stored."""
    transport = HttpTransport("http://testserver", RunInfo(run_id="nan-event"), client=client)
    monitor = Monitor(MonitorConfig(run_id="nan-event", flush_interval_steps=50, tripwire=False), transport=transport)
    torch.manual_seed(0)
    monitor.attach(torch.nn.Linear(4, 4))
    for i in range(5):
        monitor.step(float(i))
    monitor.event("note", data={"v": float("nan"), "nested": {"hi": [float("inf"), -math.inf, 1.5]}})
    monitor.close()
    s = transport.stats()
    assert (s.rejected_batches, s.dropped_batches) == (0, 0)
    assert client.get("/v1/runs/nan-event/scalars", params={"fields": "loss"}).json()["steps"] == list(range(5))
    (note,) = [e for e in client.get("/v1/runs/nan-event/events").json() if e["kind"] == "note"]
    assert note["data"] == {"v": "NaN", "nested": {"hi": ["Infinity", "-Infinity", 1.5]}}


def test_a_model_moved_to_float64_after_attach_keeps_its_norm() -> None:
    """The norm's float32 request is refused by float64 gradients: the monitor broke there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.GELU(), torch.nn.Linear(7, 3))
    monitor = Monitor(MonitorConfig(flush_interval_steps=1000, harm_interval_steps=0),
                      transport=NullTransport()).attach(model)
    for step in range(3):
        if step == 1:
            model.double()
        loss = model(torch.randn(4, 9, dtype=next(model.parameters()).dtype)).pow(2).mean()
        loss.backward()
        assert float(monitor.grad_norm()) == pytest.approx(float(torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))), rel=1e-6)
        monitor.step(loss)
        model.zero_grad()
    assert not monitor._broken
    monitor.close()
