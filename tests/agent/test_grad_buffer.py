"""MonitorConfig(grad_buffer=True): the gradients as views of one buffer per dtype, read without
walking the parameters while the loop keeps them in place, and given up (values still right)
when it does not."""

from __future__ import annotations

import logging
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import ConfigError, Monitor, MonitorConfig, NullTransport  # noqa: E402
from fp8guard.agent import grad_buffer as grad_buffer_module  # noqa: E402
from fp8guard.agent import monitor as monitor_module  # noqa: E402
from fp8guard.agent import telemetry as telemetry_module  # noqa: E402
from fp8guard.agent.grad_buffer import GradBuffer  # noqa: E402
from fp8guard.agent.telemetry import GradNorm  # noqa: E402


def _model(seed: int = 0, dtypes: tuple[Any, ...] = (torch.float32,)) -> torch.nn.Module:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for i in range(6):
        lin = torch.nn.Linear(9 + i, 10 + i)
        layers += [lin.to(dtypes[i % len(dtypes)]), _Cast(dtypes[(i + 1) % len(dtypes)])]
    return torch.nn.Sequential(*layers)


class _Cast(torch.nn.Module):
    def __init__(self, dtype: Any) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Any) -> Any:
        return x.to(self.dtype)


def _loss(model: torch.nn.Module, seed: int) -> Any:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 9, generator=gen).to(next(model.parameters()).dtype)
    return model(x).float().pow(2).mean()


def _reference(model: torch.nn.Module) -> float:
    return float(torch.linalg.vector_norm(torch.stack(
        [p.grad.double().norm() for p in model.parameters() if p.grad is not None])))


def _views_in_place(buf: GradBuffer, model: torch.nn.Module) -> bool:
    storages = {b.untyped_storage().data_ptr() for b in buf.buffers}
    return all(p.grad is not None and p.grad.untyped_storage().data_ptr() in storages for p in model.parameters())


class _CountingGrad:
    """Stands in for ``attrgetter('grad')``: counts every gradient read."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self, p: Any) -> Any:
        self.reads += 1
        return p.grad


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.bfloat16)], ids=["one", "two_dtypes"])
def test_norm_is_right_and_steady_steps_read_no_gradient(dtypes: tuple[Any, ...], monkeypatch: Any) -> None:
    counting = _CountingGrad()
    monkeypatch.setattr(grad_buffer_module, "_grad", counting)
    monkeypatch.setattr(telemetry_module, "_grad", counting)
    model = _model(dtypes=dtypes)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buf = GradBuffer(model, model.parameters())
    norm = GradNorm(model.parameters(), buffer=buf)
    assert len(buf.buffers) == len(dtypes)
    reads = []
    for step in range(8):
        opt.zero_grad(set_to_none=False)
        _loss(model, step).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = counting.reads
        got = norm()
        reads.append(counting.reads - before)
        assert got is not None and got.dtype == torch.float32
        assert float(got) == pytest.approx(_reference(model), rel=1e-5 if len(dtypes) == 1 else 1e-2)
        opt.step()
    assert buf.adopted and _views_in_place(buf, model)
    assert buf.full_checks == 1  # the first step learns the loop's version bump
    assert reads[0] == len(list(model.parameters())) and reads[1:] == [0] * 7


def test_the_norm_asked_twice_in_a_step_walks_nothing_more() -> None:
    model = _model()
    opt, buf, norm = _steady(model)
    for step in range(3, 7):
        opt.zero_grad(set_to_none=False)
        _loss(model, step).backward()
        first, second = norm(), norm()
        assert torch.equal(first, second)
        opt.step()
    assert buf.full_checks == 1 and buf.adopted


def test_views_are_aligned_and_training_is_unchanged() -> None:
    def train(buffered: bool) -> list[Any]:
        model = _model(seed=4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(3):  # gradients exist before attach: they are copied into the buffer
            opt.zero_grad(set_to_none=False)
            _loss(model, step).backward()
            if step < 2:
                opt.step()
        monitor = Monitor(MonitorConfig(grad_buffer=buffered, flush_interval_steps=1000, harm_interval_steps=0),
                          transport=NullTransport()).attach(model, opt)
        buf = monitor._grad_norm.buffer if monitor._grad_norm is not None else None
        assert (buf is not None) == buffered
        if buf is not None:
            base = buf.buffers[0].data_ptr()  # the allocator's own alignment: 64 bytes on a CPU, 512 on CUDA
            assert all((p.grad.data_ptr() - base) % 256 == 0 for p in model.parameters())
        opt.step()
        for step in range(3, 9):
            opt.zero_grad(set_to_none=False)
            loss = _loss(model, step)
            loss.backward()
            monitor.step(loss)
            opt.step()
        if buf is not None:
            assert buf.adopted and _views_in_place(buf, model)
        monitor.close()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train(False), train(True), strict=True):
        assert torch.equal(a, b)


def _steady(model: torch.nn.Module) -> tuple[Any, GradBuffer, GradNorm]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    buf = GradBuffer(model, model.parameters())
    norm = GradNorm(model.parameters(), buffer=buf)
    for step in range(3):
        opt.zero_grad(set_to_none=False)
        _loss(model, step).backward()
        norm()
        opt.step()
    assert buf.full_checks == 1
    return opt, buf, norm


@pytest.mark.parametrize("which", ["all", "first", "last"])
def test_replaced_gradients_end_the_buffer_at_once_and_the_norm_stays_right(which: str, caplog: Any) -> None:
    model = _model()
    opt, buf, norm = _steady(model)
    opt.zero_grad(set_to_none=False)
    _loss(model, 3).backward()
    params = list(model.parameters())
    for p in {"all": params, "first": params[:1], "last": params[-1:]}[which]:
        p.grad = p.grad * 3  # new tensors: the buffer's views go stale
    with caplog.at_level(logging.WARNING, logger="fp8guard.agent"):
        got = norm()
    assert float(got) == pytest.approx(_reference(model), rel=1e-5)
    assert buf.state.startswith("ended: a gradient is no longer") and "gradient buffer given up" in caplog.text
    assert not model._forward_pre_hooks  # the hook left with it


def test_a_middle_gradient_replaced_after_the_writes_is_found_one_step_later() -> None:
    """The documented blind spot: the version bump of that step is the usual one."""
    model = _model()
    opt, buf, norm = _steady(model)
    opt.zero_grad(set_to_none=False)
    _loss(model, 3).backward()
    p = list(model.parameters())[3]
    as_backward_left_it = _reference(model)
    p.grad = p.grad * 3
    assert float(norm()) == pytest.approx(as_backward_left_it, rel=1e-5) and buf.adopted
    opt.step()
    opt.zero_grad(set_to_none=False)
    _loss(model, 4).backward()
    assert float(norm()) == pytest.approx(_reference(model), rel=1e-5)
    assert buf.state.startswith("ended: a gradient is no longer")


def test_gradients_set_to_none_once_come_back_as_views() -> None:
    """What fp8guard's rollback does (the abandoned step's optimizer.step must skip)."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    buf = GradBuffer(model, model.parameters())
    norm = GradNorm(model.parameters(), buffer=buf)
    for step in range(12):
        if step == 5:
            model.zero_grad(set_to_none=True)
            snapshot = [p.detach().clone() for p in model.parameters()]
            opt.step()  # every gradient None: nothing moves
            assert all(torch.equal(a, p) for a, p in zip(snapshot, model.parameters(), strict=True))
        else:
            opt.zero_grad(set_to_none=False)
        _loss(model, step).backward()
        assert float(norm()) == pytest.approx(_reference(model), rel=1e-5)
        opt.step()
    assert buf.adopted and buf.readopted == 1 and _views_in_place(buf, model)


def test_a_loop_that_sets_gradients_to_none_every_step_ends_it(caplog: Any) -> None:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    monitor = Monitor(MonitorConfig(grad_buffer=True, flush_interval_steps=1000, harm_interval_steps=0),
                      transport=NullTransport()).attach(model, opt)
    assert monitor._grad_norm is not None and monitor._grad_norm.buffer is not None
    buf = monitor._grad_norm.buffer
    with caplog.at_level(logging.WARNING, logger="fp8guard.agent"):
        for step in range(5):
            opt.zero_grad()  # set_to_none=True
            loss = _loss(model, step)
            loss.backward()
            assert float(monitor.grad_norm()) == pytest.approx(_reference(model), rel=1e-5)
            monitor.step(loss)
            opt.step()
    assert buf.state.startswith("ended: the gradients were set to None at two steps in a row") and buf.readopted == 1
    assert caplog.text.count("gradient buffer given up") == 1
    monitor.close()


def test_non_finite_gradients_are_data() -> None:
    model = _model()
    buf = GradBuffer(model, model.parameters())
    norm = GradNorm(model.parameters(), buffer=buf)
    _loss(model, 0).backward()
    norm()
    with torch.no_grad():
        list(model.parameters())[2].grad[0, 0] = float("nan")
    assert torch.isnan(norm())


def test_under_torch_distributed_it_fails_fast(monkeypatch: Any) -> None:
    monkeypatch.setattr(monitor_module, "rank_and_world", lambda: (0, 2))
    with pytest.raises(ConfigError, match="grad_buffer is for one process"):
        Monitor(MonitorConfig(grad_buffer=True), transport=NullTransport()).attach(_model())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_the_norm_is_right_and_training_unchanged() -> None:
    def train(buffered: bool) -> tuple[list[Any], list[float]]:
        torch.manual_seed(1)
        model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)]).cuda().to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
        buf = GradBuffer(model, model.parameters()) if buffered else None
        norm = GradNorm(model.parameters(), buffer=buf)
        x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
        norms = []
        for _ in range(6):
            opt.zero_grad(set_to_none=False)
            model(x).float().pow(2).mean().backward()
            norms.append(float(norm()))
            assert norms[-1] == pytest.approx(_reference(model), rel=1e-5)
            opt.step()
        if buf is not None:
            assert buf.adopted and buf.full_checks == 1 and _views_in_place(buf, model)
            assert all(p.grad.data_ptr() % 256 == 0 for p in model.parameters())
        return [p.detach().clone() for p in model.parameters()], norms

    plain, buffered = train(False), train(True)
    assert all(torch.equal(a, b) for a, b in zip(plain[0], buffered[0], strict=True))


def _plain_vs_buffered(make: Any, loop: Any, fused: bool = False) -> None:
    """Trains ``make()`` twice through ``loop(model, opt)``, without and with the buffer: same weights."""
    results = []
    for buffered in (False, True):
        model = make()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, fused=fused)
        buf = GradBuffer(model, model.parameters()) if buffered else None
        loop(model, opt, GradNorm(model.parameters(), buffer=buf))
        if buf is not None:
            assert buf.adopted, buf.state
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


def test_gradients_put_back_after_a_rollback_start_from_zero() -> None:
    """The abandoned step's gradients must not leak into the next one (the views are zeroed)."""
    def loop(model: Any, opt: Any, norm: Any) -> None:
        for step in range(9):
            if step in (3, 6):  # two rollbacks, three steps apart
                _loss(model, 100 + step).backward()  # the abandoned step's gradients...
                model.zero_grad(set_to_none=True)  # ...dropped, as fp8guard's rollback does
                opt.step()
            else:
                opt.zero_grad(set_to_none=False)
            _loss(model, step).backward()
            assert float(norm()) == pytest.approx(_reference(model), rel=1e-5)
            opt.step()

    _plain_vs_buffered(_model, loop)


def test_non_contiguous_parameters_get_gradients_laid_out_as_they_are() -> None:
    def make() -> torch.nn.Module:
        torch.manual_seed(2)
        conv = torch.nn.Conv2d(3, 8, 3).to(memory_format=torch.channels_last)
        lin = torch.nn.Linear(8, 5)
        lin.weight = torch.nn.Parameter(torch.randn(5, 8).t().contiguous().t())  # a transposed layout
        return torch.nn.Sequential(conv, torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), lin)

    def loop(model: Any, opt: Any, norm: Any) -> None:
        gen = torch.Generator().manual_seed(0)
        for _ in range(4):
            opt.zero_grad(set_to_none=False)
            model(torch.randn(2, 3, 6, 6, generator=gen)).pow(2).mean().backward()
            for p in model.parameters():
                assert p.grad is not None and p.grad.stride() == p.stride()
            assert float(norm()) == pytest.approx(_reference(model), rel=1e-5)
            opt.step()

    try:
        torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], fused=True)
    except (RuntimeError, ValueError) as exc:
        pytest.skip(f"this torch has no fused AdamW on the CPU: {exc}")
    # fused kernels pair gradient and parameter elements by memory order: contiguous views of a
    # channels_last or transposed parameter trained differently there
    _plain_vs_buffered(make, loop, fused=True)


@pytest.mark.parametrize("move", ["to_bf16", "set_", "data"])
def test_gradients_moved_in_place_are_found_at_once(move: str) -> None:
    """``model.to(dtype)`` and ``.data =`` keep the gradient objects and move their memory."""
    model = _model()
    opt, buf, norm = _steady(model)
    opt.zero_grad(set_to_none=False)
    _loss(model, 3).backward()
    if move == "to_bf16":
        model.to(torch.bfloat16)
    else:
        for p in model.parameters():
            fresh = p.grad.clone() * 2
            if move == "set_":
                p.grad.set_(fresh)
            else:
                p.grad.data = fresh
    assert float(norm()) == pytest.approx(_reference(model), rel=1e-2 if move == "to_bf16" else 1e-5)
    assert buf.state.startswith("ended: a gradient is no longer")


def test_a_second_dtype_buffer_is_watched_too() -> None:
    model = _model(dtypes=(torch.float32, torch.bfloat16))
    opt, buf, norm = _steady(model)
    assert len(buf.buffers) == 2
    middle = [p for p in model.parameters() if p.dtype == torch.bfloat16][1]  # not the first or last parameter
    opt.zero_grad(set_to_none=False)
    middle.grad = torch.zeros_like(middle)  # the backward accumulates into this one, not the view
    _loss(model, 3).backward()
    assert float(norm()) == pytest.approx(_reference(model), rel=1e-2)
    assert buf.state.startswith("ended: a gradient is no longer")


def test_only_some_gradients_none_is_not_put_back_and_ends_it() -> None:
    model = _model()
    opt, buf, norm = _steady(model)
    opt.zero_grad(set_to_none=False)
    next(iter(model.parameters())).grad = None
    _loss(model, 3).backward()
    assert buf.readopted == 0
    assert float(norm()) == pytest.approx(_reference(model), rel=1e-5)
    assert buf.state.startswith("ended: a gradient is no longer")


def test_sparse_gradients_and_gapped_parameters_keep_their_own_gradients(caplog: Any) -> None:
    sparse = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    gapped = torch.nn.Linear(4, 2)
    gapped.weight = torch.nn.Parameter(torch.randn(2, 8)[:, ::2])
    with caplog.at_level(logging.WARNING, logger="fp8guard.agent"):
        for model, why in ((sparse, "sparse gradients"), (gapped, "gaps or overlaps")):
            buf = GradBuffer(model, model.parameters())
            assert buf.state.startswith("ended:") and why in buf.state and not model._forward_pre_hooks
            assert all(p.grad is None for p in model.parameters())
    assert caplog.text.count("gradient buffer given up") == 2


def test_close_leaves_the_gradients_and_removes_the_hook() -> None:
    model = _model()
    monitor = Monitor(MonitorConfig(grad_buffer=True, flush_interval_steps=1000, harm_interval_steps=0),
                      transport=NullTransport()).attach(model)
    assert monitor._grad_norm is not None and monitor._grad_norm.buffer is not None
    buf = monitor._grad_norm.buffer
    _loss(model, 0).backward()
    views = [p.grad for p in model.parameters()]
    monitor.close()
    assert buf.state == "ended: closed" and not model._forward_pre_hooks
    assert all(p.grad is v for p, v in zip(model.parameters(), views, strict=True))


def test_no_buffer_without_the_monitor_computing_the_norm() -> None:
    model = _model()
    monitor = Monitor(MonitorConfig(grad_buffer=True, compute_grad_norm=False, harm_interval_steps=0),
                      transport=NullTransport()).attach(model)
    assert monitor._grad_norm is not None and monitor._grad_norm.buffer is None
    assert all(p.grad is None for p in model.parameters()) and not model._forward_pre_hooks
    monitor.close()



def test_a_real_rollback_keeps_the_buffer_and_trains_as_without_it(tmp_path: Any) -> None:
    """fp8guard's own rollback (gradients set to None, weights restored, batches skipped) in a
    loop that zeroes in place: the same weights and gradient norms with and without the buffer."""
    import torch.nn.functional as F

    from fp8guard.agent import HealConfig, JsonlFileTransport, emulate_fp8

    def run(buffered: bool) -> tuple[list[Any], list[float], GradBuffer | None]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
        emulate_fp8(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(40)]
        folder = tmp_path / ("buffered" if buffered else "plain")
        monitor = Monitor(MonitorConfig(run_id="heal", flush_interval_steps=100, tripwire=False, harm_interval_steps=0,
                                        grad_buffer=buffered),
                          transport=JsonlFileTransport(folder / "telemetry.jsonl"))
        monitor.attach(model, opt, heal=HealConfig(folder / "ckpt", every_n_steps=5))
        norms = []
        rollback = {"id": 3, "kind": "rollback", "reason": "loss spike", "checkpoint_step": 9, "skip_batches": 4}
        for x, y in monitor.batches(data, steps=24):
            step = monitor.next_step
            loss = F.mse_loss(model(x), y)
            loss.backward()
            norms.append(float(monitor.grad_norm()))
            if step == 13 and rollback is not None:
                monitor.receive_commands([rollback])
                rollback = None
            monitor.step(loss)
            opt.step()
            opt.zero_grad(set_to_none=False)
        buf = monitor._grad_norm.buffer if monitor._grad_norm is not None else None
        monitor.close()
        return [p.detach().clone() for p in model.parameters()], norms, buf

    plain_weights, plain_norms, _ = run(False)
    weights, norms, buf = run(True)
    assert buf is not None and buf.readopted == 1 and buf.state == "ended: closed"  # held to the end
    assert norms == pytest.approx(plain_norms, rel=1e-6) and len(norms) == 28
    assert all(torch.equal(a, b) for a, b in zip(plain_weights, weights, strict=True))
