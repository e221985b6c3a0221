"""Healing a plain loop on the CPU: ``attach(heal=HealConfig(...))`` + ``monitor.batches(data)``
(checkpoints, rollback at the next batch, batch skipping, a lowered learning rate, resume after a
restart), the data positions of ``Batches``, the emulation's step closed by the monitor, and
the agent's errors. The README's block heals against the real service (tests/test_readme.py)."""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from fp8guard.agent import (  # noqa: E402
    CheckpointError,
    ConfigError,
    HealConfig,
    Monitor,
    MonitorConfig,
    NullTransport,
    emulate_fp8,
    watch,
)
from fp8guard.agent.checkpoint import CheckpointManager  # noqa: E402
from fp8guard.agent.healing import Batches  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from fp8guard.nanogpt import TextBatches, stdlib_text  # noqa: E402

# -- Batches: where the data goes back to -------------------------------------------------------------


def _ids(batch: Any) -> list[int]:
    return [int(v) for v in batch[0]]


def test_a_shuffling_dataloader_is_replayed_in_the_same_order() -> None:
    torch.manual_seed(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(64)), batch_size=4,
                                         shuffle=True)
    stream = Batches(loader, epochs=2)
    drawn = [_ids(stream.next()) for _ in range(7)]
    saved = stream.state_dict()  # what a checkpoint after 7 batches holds
    drawn += [_ids(stream.next()) for _ in range(20)]  # into the second epoch (16 batches each)
    torch.randn(100)  # the global RNG moves on meanwhile
    stream.load_state_dict({**saved, "position": saved["position"] + 2})  # restore, then skip two
    assert stream.state_dict()["position"] == 9  # a skip adds to a position loaded but not reached yet
    assert [_ids(stream.next()) for _ in range(7)] == drawn[9:16]  # the rest of the epoch, as it was
    # The next epoch shuffles from the RNG as training left it: every sample once, as in any epoch.
    second = [i for _ in range(16) for i in _ids(stream.next())]
    assert sorted(second) == list(range(64)) and stream.position == 32


class _StatelessLoader(torch.utils.data.DataLoader):  # type: ignore[type-arg]
    """As Accelerate prepares a DataLoader without ``use_stateful_dataloader=True``: both methods
    exist, but ``state_dict()`` raises AttributeError."""

    def state_dict(self) -> dict[str, Any]:
        return self.dl_state_dict  # type: ignore[no-any-return,attr-defined]  # never set: AttributeError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise AssertionError("Batches must not restore a loader whose state_dict() fails")


def test_a_loader_whose_state_dict_raises_is_replayed_instead() -> None:
    torch.manual_seed(2)
    loader = _StatelessLoader(torch.utils.data.TensorDataset(torch.arange(32)), batch_size=4, shuffle=True)
    stream = Batches(loader, epochs=1)
    assert not stream.stateful
    drawn = [_ids(stream.next()) for _ in range(3)]
    saved = stream.state_dict()
    assert "loader" not in saved and "epoch_rng" in saved
    drawn += [_ids(stream.next()) for _ in range(4)]
    stream.load_state_dict({**saved, "position": saved["position"] + 1})  # restore, then skip one
    rest = [_ids(b) for b in stream]  # the epoch replayed in its order from the skipped-to batch
    assert rest[:3] == drawn[4:7] and len(rest) == 4
    assert sorted(i for b in drawn[:4] + rest for i in b) == list(range(32))


def test_a_list_is_replayed_across_epochs_and_ends_after_them() -> None:
    data = [(torch.tensor([i]),) for i in range(5)]
    stream = Batches(data, epochs=2)
    drawn = [_ids(stream.next())[0] for _ in range(7)]
    saved = stream.state_dict()  # epoch 1, offset 2
    assert drawn == [0, 1, 2, 3, 4, 0, 1] and saved["epoch"] == 1
    stream.next()
    stream.load_state_dict(saved)
    assert [_ids(b)[0] for b in stream] == [2, 3, 4]


def test_a_stateful_loader_is_restored_through_its_state_dict() -> None:
    text = TextBatches(stdlib_text(20_000), block_size=8, batch_size=2)
    stream = Batches(text, epochs=None)
    for _ in range(3):
        stream.next()
    saved = stream.state_dict()
    assert saved["loader"] == {"position": 3}
    for _ in range(4):
        stream.next()
    stream.load_state_dict({**saved, "position": saved["position"] + 5})
    x, _ = stream.next()
    assert torch.equal(x, text.batch(8)[0]) and text.position == 9


def test_a_one_shot_iterator_only_skips_ahead() -> None:
    def gen() -> Iterator[tuple[torch.Tensor]]:
        for i in range(100):
            yield (torch.tensor([i]),)

    stream = Batches(gen())
    for _ in range(10):
        stream.next()
    saved = stream.state_dict()  # position 10
    for _ in range(5):
        stream.next()  # position 15
    stream.load_state_dict({**saved, "position": 12})  # cannot go back: continues at 15
    assert _ids(stream.next()) == [15]
    stream.load_state_dict({**saved, "position": 30})  # skipping past the current position works
    assert _ids(stream.next()) == [30]
    with pytest.raises(ConfigError, match="epochs must be"):
        Batches([], epochs=0)


# -- healing through the monitor -------------------------------------------------------------------------


def _setup(tmp_path: Path, *, seed: int = 0, **heal: Any) -> tuple[nn.Module, Any, Any, list[Any], Monitor, Path]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 1))
    emulate_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    g = torch.Generator().manual_seed(seed)
    data = [(torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)) for _ in range(60)]
    events = tmp_path / "telemetry.jsonl"
    monitor = Monitor(MonitorConfig(run_id="heal", flush_interval_steps=100, tripwire=False),
                      transport=JsonlFileTransport(events))
    monitor.attach(model, opt, scheduler=sched, heal=HealConfig(tmp_path / "ckpt", every_n_steps=5, **heal))
    return model, opt, sched, data, monitor, events


def _train(model: nn.Module, opt: Any, sched: Any, data: list[Any], monitor: Monitor, *, steps: int | None = None,
           inject: dict[int, dict[str, Any]] | None = None) -> list[tuple[int, int, float]]:
    """The README's loop; returns (step, batch index, the lr optimizer.step used) of every iteration."""
    seen: list[tuple[int, int, float]] = []
    index = {id(x): i for i, (x, _) in enumerate(data)}
    used: list[float] = []
    hook = opt.register_step_pre_hook(lambda o, args, kwargs: used.append(o.param_groups[0]["lr"]))
    for x, y in monitor.batches(data, steps=steps):
        step = monitor.next_step
        seen.append((step, index[id(x)], -1.0))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if inject and step in inject:
            monitor.receive_commands([inject.pop(step)])
        monitor.step(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
    hook.remove()
    return [(s, b, lr) for (s, b, _), lr in zip(seen, used, strict=True)]


def _events(path: Path) -> list[dict[str, Any]]:
    return [e for line in path.read_text().splitlines() for e in json.loads(line)["events"]]


def test_a_rollback_restores_skips_and_lowers_the_lr_at_the_next_batch(tmp_path: Path) -> None:
    model, opt, sched, data, monitor, events_path = _setup(tmp_path)
    ckpts = monitor.healer.checkpoints  # type: ignore[union-attr]
    saved: dict[int, dict[str, torch.Tensor]] = {}
    original_save = ckpts.save

    def save(step: int, **kw: Any) -> Path:
        saved[step] = {k: v.clone() for k, v in model.state_dict().items()}
        return original_save(step, **kw)

    ckpts.save = save  # type: ignore[method-assign]
    rollback = {"id": 3, "kind": "rollback", "reason": "loss spike", "checkpoint_step": 9, "skip_batches": 4,
                "lr_scale": 0.25, "lr_scale_steps": 3}
    at_resume: dict[str, Any] = {}
    original_finish = monitor.healer.remediator.finish_rollback  # type: ignore[union-attr]

    def finish() -> None:
        original_finish()
        at_resume["state"] = {k: v.clone() for k, v in model.state_dict().items()}

    monitor.healer.remediator.finish_rollback = finish  # type: ignore[union-attr, method-assign]
    seen = _train(model, opt, sched, data, monitor, steps=30, inject={13: rollback})
    monitor.close()

    steps = [s for s, _, _ in seen]
    assert steps == [*range(0, 14), *range(10, 30)]  # step 13 abandoned: training goes on at 10
    batches = [b for _, b, _ in seen]
    assert batches[:14] == list(range(14)) and batches[14] == 10 + 4  # the checkpoint's position, 4 skipped
    for k, v in saved[9].items():  # the restore overwrote all the abandoned iteration did (optimizer.step too)
        assert torch.equal(at_resume["state"][k], v), k
    # The scheduler is not stepped once too often by the abandoned iteration, and the rate is
    # lowered for steps 10-12 only.
    base = {s: 1e-2 / (1 + 0.1 * s) for s in range(30)}
    for i, (s, _, lr) in enumerate(seen):
        if i == 13:
            continue  # the abandoned iteration's optimizer.step: overwritten by the restore
        scaled = i >= 14 and 10 <= s < 13
        assert lr == pytest.approx(base[s] * (0.25 if scaled else 1.0), rel=1e-9), (i, s)
    assert ckpts.steps() == [9, 14, 19, 24, 29]  # the abandoned stretch saved nothing after 9
    events = _events(events_path)
    ack = next(e for e in events if e["kind"] == "command_acknowledged")
    assert ack["step"] == 13 and ack["data"]["status"] == "applied" and ack["data"]["resume_step"] == 10
    assert [e["step"] for e in events if e["kind"] == "checkpoint_saved"] == [4, 9, 14, 19, 24, 29]


def test_a_missing_checkpoint_fails_the_command_and_training_goes_on(tmp_path: Path) -> None:
    model, opt, sched, data, monitor, events_path = _setup(tmp_path)
    rollback = {"id": 1, "kind": "rollback", "reason": "r", "checkpoint_step": 7, "skip_batches": 0}
    seen = _train(model, opt, sched, data, monitor, steps=20, inject={12: rollback})
    monitor.close()
    assert [s for s, _, _ in seen] == list(range(20))
    ack = next(e for e in _events(events_path) if e["kind"] == "command_acknowledged")
    assert ack["data"]["status"] == "failed" and "no checkpoint of step 7" in ack["data"]["error"]


def test_skipping_batches_needs_monitor_batches(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model, opt, _, data, monitor, events_path = _setup(tmp_path)
    monitor.receive_commands([{"id": 1, "kind": "rollback", "reason": "r", "checkpoint_step": 0, "skip_batches": 3}])
    for i, (x, y) in enumerate(data[:6]):  # a loop that iterates the data itself
        F.mse_loss(model(x), y).backward()
        monitor.step()
        opt.step()
        opt.zero_grad()
        assert monitor.next_step == i + 1
    monitor.close()
    ack = next(e for e in _events(events_path) if e["kind"] == "command_acknowledged")
    assert ack["data"]["status"] == "failed" and "monitor.batches(data)" in ack["data"]["error"]
    assert "does not use" in caplog.text  # heal= without monitor.batches says what to write


def test_resume_continues_a_restarted_job_from_the_newest_checkpoint(tmp_path: Path) -> None:
    model, opt, sched, data, monitor, _ = _setup(tmp_path)
    first = _train(model, opt, sched, data, monitor, steps=22)  # "crashes" after step 21
    monitor.close()
    at_19 = torch.load(tmp_path / "ckpt" / "ckpt-rank0-step000000019.pt", weights_only=True)["model"]
    # the process that follows: a fresh model (another seed) and resume=True
    model2, opt2, sched2, _, monitor2, events_path = _setup(tmp_path, seed=5, resume=True)
    first_params: dict[str, torch.Tensor] = {}

    def record(module: nn.Module, args: Any) -> None:
        if not first_params:
            first_params.update({k: v.clone() for k, v in module.state_dict().items()})

    model2.register_forward_pre_hook(record)
    second = _train(model2, opt2, sched2, data, monitor2, steps=25)
    monitor2.close()
    assert [s for s, _, _ in first] == list(range(22))
    assert [(s, b) for s, b, _ in second] == [(s, s) for s in range(20, 25)]  # after the checkpoint of step 19
    assert second[0][2] == pytest.approx(1e-2 / (1 + 0.1 * 20))  # the scheduler came back too
    resumed = [e for e in _events(events_path) if e["kind"] == "run_resumed"]
    assert resumed and resumed[0]["data"]["checkpoint_step"] == 19 and monitor2.segment == 1
    for k, v in at_19.items():  # the first resumed forward ran on the checkpoint's weights and FP8 state
        assert torch.equal(first_params[k], v), k


def test_heal_config_and_attach_errors_are_one_line_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="every_n_steps must be an int >= 1"):
        HealConfig(tmp_path, every_n_steps=0)
    with pytest.raises(ConfigError, match="directory"):
        HealConfig("")
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ConfigError, match="not both"):
        Monitor(MonitorConfig(run_id="x"), transport=NullTransport()).attach(
            model, heal=HealConfig(tmp_path), handler=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"nn\.Module"):
        watch("not a model", run_id="x")
    with pytest.raises(ConfigError, match="MonitorConfig fields are"):
        watch(model, run_id="x", flush_every=3)


def test_a_truncated_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    ckpts = CheckpointManager(tmp_path, model=model, rank=0)
    path = ckpts.save(4)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="not a readable torch checkpoint"):
        ckpts.load(4)
    with pytest.raises(CheckpointError, match="no checkpoint of step 5"):
        ckpts.load(5)


# -- no silent zeros -----------------------------------------------------------------------------------


def _emulated_run(*, user_update: bool, steps: int = 6) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 1))
    fp8 = emulate_fp8(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monitor = Monitor(MonitorConfig(run_id="emu", harm_interval_steps=2), transport=NullTransport()).attach(model, opt)
    for _ in range(steps):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        loss.backward()
        if user_update:
            fp8.update()  # before monitor.step: the monitor then leaves the step alone
        monitor.step(loss, loss_fn=lambda x=x: model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()
    monitor.close()
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_monitor_closes_the_emulations_step_when_the_loop_does_not() -> None:
    driven = _emulated_run(user_update=False)
    assert float(driven["0.fp8_amax_history_fwd"][-1, 0]) > 0  # amaxes rolled into the history
    assert float(driven["0.fp8_scale_fwd"][0]) != 1.0  # and scales updated from them
    by_hand = _emulated_run(user_update=True)
    for k in driven:  # the same run bit for bit: one update per step either way, never two
        assert torch.equal(driven[k], by_hand[k]), k


def test_a_source_whose_state_never_changes_warns_once_naming_the_fix() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    emulate_fp8(model)
    monitor = Monitor(MonitorConfig(run_id="stale"), transport=NullTransport()).attach(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(30):
            monitor.step(1.0)  # the loop trains another model: no FP8 forward on this one
    monitor.close()
    stale = [w for w in caught if "no emulated FP8 layer has run" in str(w.message)]
    assert len(stale) == 1 and "pass attach() the model your loop trains" in str(stale[0].message)
