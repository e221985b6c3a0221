"""Each framework integration heals an injected incident through the framework's own checkpoints
(#13 item 1), end to end on the CPU: a tiny GPT in emulated FP8, the real service under uvicorn
in a thread (SQLite), the integration given only ``heal=True`` and the service URL.

The incident: three poisoned batches multiply the loss by 30 (a loss and gradient spike). The
service finds it and orders a rollback to a known-good checkpoint, skipping the bad window's
batches and halving the learning rate for a few steps; the integration restores the framework's
checkpoint in place and acknowledges. What each test checks: the action is applied; training
after it starts from the checkpoint's weights, at its step, on the batch the command's skip
leads to (never a poisoned one again), with the learning rate halved for the window and then
restored; the abandoned checkpoints are gone; the run ends at ``max_steps``. A fallback command
(as the service sends it) switches the named module to BF16 and its ack reaches the service."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import MonitorConfig  # noqa: E402
from tests.integration_helpers import TinyGPT, batches, lightning_tiny_gpt, pl_warnings, tiny_gpt  # noqa: E402

LR = 3e-3
POISONED = range(20, 23)
STEPS = 36
EVERY = 5
GUARD = {"warmup_steps": 8, "rollback_margin_steps": 2, "known_good_after_steps": 2, "skip_batches": 2,
         "rollback_lr_scale": 0.5, "rollback_lr_steps": 4}


@pytest.fixture
def service(tmp_path: Path) -> Iterator[Any]:
    import httpx

    from fp8guard.service import Settings, create_app
    from fp8guard.service.store import make_engine, upgrade
    from tests.helpers import app_in_thread

    url = f"sqlite:///{tmp_path / 'fp8guard.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    with app_in_thread(create_app(Settings(database_url=url, auth="off"))) as base, \
            httpx.Client(base_url=base, timeout=30) as api:
        yield api


def _config(api: Any, run_id: str, tmp_path: Path) -> MonitorConfig:
    assert api.put(f"/v1/runs/{run_id}", json={"guard": GUARD}).status_code == 201
    return MonitorConfig(url=str(api.base_url), run_id=run_id, flush_interval_steps=2, command_check_interval_steps=1,
                         harm_interval_steps=0, spool_dir=str(tmp_path / "spool"))


def _data(n: int = 64) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """The shared batches, each with its index (the loss poisons some; the tests follow them)."""
    return [(x, y, i) for i, (x, y) in enumerate(batches(n))]


class Record:
    """What the training loop saw at each optimizer step, in order: (step, batch index, the lr
    the optimizer stepped with, the weights the forward saw); whether ``blocks.0.mlp_fc``
    computed in FP8. It also plays the service's operator: at the 30th batch it hands the monitor
    a fallback of that module and one of a module that does not exist, at the 33rd a promotion
    (as the service would deliver them; they apply at that step's command boundary)."""

    def __init__(self, monitor: Any, prefix: str = "gpt.") -> None:
        self.monitor = monitor
        self.module = f"{prefix}blocks.0.mlp_fc"
        self.steps: list[tuple[int, int, float, dict[str, torch.Tensor]]] = []
        self.fp8: list[bool] = []

    def batch(self, step: int, index: int, model: torch.nn.Module) -> None:
        self.steps.append((step, index, float("nan"), {k: v.detach().clone() for k, v in model.state_dict().items()}))
        self.fp8.append(bool(model.get_submodule("blocks.0.mlp_fc").fp8_enabled))
        commands = {30: [{"id": 9001, "kind": "fallback", "modules": [self.module]},
                         {"id": 9002, "kind": "fallback", "modules": ["no.such.module"]}],
                    33: [{"id": 9003, "kind": "promote", "modules": [self.module]}]}.get(len(self.steps))
        if commands:
            self.monitor().receive_commands(commands)

    def lr(self, lr: float) -> None:
        """Right before the optimizer steps (after the integration's hook: a rollback's window
        starts and ends there)."""
        step, index, _, weights = self.steps[-1]
        self.steps[-1] = (step, index, lr, weights)


def _check_healed(api: Any, run_id: str, record: Record, checkpoint_weights: Any) -> dict[str, Any]:
    """The checks every framework shares (module docstring); returns the rollback's ack data."""
    actions = api.get(f"/v1/runs/{run_id}/actions").json()
    rollbacks = [a for a in actions if a["kind"] == "rollback"]
    findings = api.get(f"/v1/runs/{run_id}/findings").json()
    events = api.get(f"/v1/runs/{run_id}/events").json()
    assert [a["status"] for a in rollbacks] == ["applied"], (actions, findings, [(e["kind"], e["step"]) for e in events])
    acks = [e for e in events if e["kind"] == "command_acknowledged" and e["data"]["kind"] == "rollback"]
    assert len(acks) == 1 and acks[0]["data"]["status"] == "applied"
    ack = acks[0]["data"]
    target, applied_at = ack["checkpoint_step"], ack["applied_step"]
    assert target % EVERY == EVERY - 1 and target < POISONED[0] <= applied_at
    # where training went on: the checkpoint's step, its weights, the batch the skip leads to
    i = next(i for i, (step, *_) in enumerate(record.steps) if i > 0 and step <= record.steps[i - 1][0])
    step, index, _, weights = record.steps[i]
    assert step == target + 1 == ack["resume_step"]
    assert index == ack["data_position"] >= target + 1 + ack["skip_batches"]
    saved = checkpoint_weights(target + 1)
    assert weights.keys() == saved.keys() and all(torch.equal(weights[k], saved[k]) for k in saved)
    assert not any(idx in POISONED for _, idx, _, _ in record.steps[i:])
    lrs = {s: lr for s, _, lr, _ in record.steps[i:]}
    window = range(step, step + GUARD["rollback_lr_steps"])
    assert all(lrs[s] == pytest.approx(LR * 0.5) for s in window), (lrs, ack)
    assert all(lrs[s] == pytest.approx(LR) for s in lrs if s not in window)
    assert record.steps[-1][0] == STEPS - 1
    assert ack["discarded_checkpoints"] == [s for s in range(EVERY - 1, applied_at, EVERY) if s > target]
    detail = api.get(f"/v1/runs/{run_id}").json()
    assert detail["status"] == "finished" and detail["last_step"] == STEPS - 1
    # the operator's commands: the module in BF16 from the batch after the fallback to the promotion
    assert record.fp8[:30] == [True] * 30 and record.fp8[30:33] == [False] * 3 and all(record.fp8[33:])
    acks = {e["data"]["command_id"]: e["data"] for e in events if e["kind"] == "command_acknowledged"}
    assert (acks[9001]["status"], acks[9001]["modules"], acks[9003]["status"]) == ("applied", [record.module], "applied")
    assert acks[9002]["status"] == "failed" and "no.such.module" in acks[9002]["error"]
    switched = [(e["kind"], e["data"]["modules"]) for e in events if e["kind"].endswith(("fallback_applied",
                                                                                        "promotion_applied"))]
    assert switched == [("fallback_applied", [record.module]), ("promotion_applied", [record.module])]
    return ack


# ---------------------------------------------------------------------------------- Lightning

@pl_warnings
@pytest.mark.slow
def test_lightning_heals_through_its_checkpoints(service: Any, tmp_path: Path) -> None:
    base = lightning_tiny_gpt()
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    record = Record(lambda: cb.monitor)

    class Module(base):  # type: ignore[misc,valid-type]
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, index = batch
            if torch.is_grad_enabled():
                record.batch(self.trainer.global_step, int(index), self.gpt)
            _, loss = self.gpt(x, y)
            return loss * 30 if int(index) in POISONED else loss

        def on_after_backward(self) -> None:
            self.fp8.update()

        def on_before_optimizer_step(self, optimizer: Any) -> None:  # after the callback's
            record.lr(optimizer.param_groups[0]["lr"])

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=LR)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(_data(), batch_size=None)

    cb = FP8GuardCallback(_config(service, "pl-heal", tmp_path), heal=True)
    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=EVERY, save_top_k=-1)
    trainer = Trainer(max_steps=STEPS, accelerator="cpu", devices=1, logger=False, default_root_dir=tmp_path,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=[cb, ckpt])
    trainer.fit(Module())

    def weights(global_step: int) -> dict[str, torch.Tensor]:
        state = torch.load(tmp_path / "ckpt" / f"epoch=0-step={global_step}.ckpt", weights_only=False)["state_dict"]
        return {k.removeprefix("gpt."): v for k, v in state.items() if k.startswith("gpt.")}

    _check_healed(service, "pl-heal", record, weights)
    assert trainer.global_step == STEPS
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert files == sorted(f"epoch=0-step={s}.ckpt" for s in range(EVERY, STEPS + 1, EVERY))


# ---------------------------------------------------------------------------- transformers


@pytest.mark.slow
def test_hf_trainer_heals_through_its_checkpoint_folders(service: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from safetensors.torch import load_file
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    record = Record(lambda: cb.monitor)
    at: dict[str, Any] = {}

    class HFGPT(TinyGPT):
        def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, index: torch.Tensor) -> Any:
            i = int(index[0])
            if self.training and torch.is_grad_enabled():
                record.batch(at["trainer"].state.global_step, i, self.gpt)
            _, loss = self.gpt(input_ids, labels)
            return {"loss": loss * 30 if i in POISONED else loss}

    class LrRecorder(TrainerCallback):  # type: ignore[misc]
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                                  **kwargs: Any) -> None:
            record.lr(optimizer.param_groups[0]["lr"])

    data = [{"input_ids": x[0], "labels": y[0], "index": i} for x, y, i in _data()]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=STEPS, per_device_train_batch_size=1,
                             learning_rate=LR, lr_scheduler_type="constant", save_steps=EVERY, report_to=[],
                             use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, seed=0, max_grad_norm=0.0,
                             train_sampling_strategy="sequential", logging_steps=4)
    cb = FP8GuardTrainerCallback(_config(service, "hf-heal", tmp_path), heal=True)
    trainer = at["trainer"] = Trainer(model=HFGPT(), args=args, train_dataset=data, callbacks=[cb, LrRecorder()])
    trainer.train()

    def weights(global_step: int) -> dict[str, torch.Tensor]:
        fresh = HFGPT()
        fresh.load_state_dict(load_file(tmp_path / "out" / f"checkpoint-{global_step}" / "model.safetensors"),
                              strict=False)
        return fresh.gpt.state_dict()

    _check_healed(service, "hf-heal", record, weights)
    assert trainer.state.global_step == STEPS
    folders = {p.name for p in (tmp_path / "out").iterdir()}
    assert folders == {f"checkpoint-{s}" for s in [*range(EVERY, STEPS + 1, EVERY), STEPS]}  # and the final one


# ------------------------------------------------------------------------------ Accelerate


@pytest.mark.slow
def test_accelerate_heals_through_save_state_and_load_state(service: Any, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator
    from safetensors.torch import load_file

    from fp8guard.agent import HealConfig
    from fp8guard.agent.integrations.accelerate import attach_accelerate

    record = Record(lambda: monitor, prefix="")
    accelerator = Accelerator(cpu=True)
    gpt, _ = tiny_gpt()
    opt = torch.optim.AdamW(gpt.parameters(), lr=LR)
    model, opt, sched = accelerator.prepare(gpt, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0))
    monitor = attach_accelerate(accelerator, model, opt, _config(service, "acc-heal", tmp_path),
                                heal=HealConfig(tmp_path / "ckpt", every_n_steps=EVERY, keep_last=10))
    for x, y, index in monitor.batches(_data(), steps=STEPS):
        record.batch(monitor.next_step, index, gpt)
        _, loss = model(x, y)
        loss = loss * 30 if index in POISONED else loss
        accelerator.backward(loss)
        monitor.step(loss)
        record.lr(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
        opt.zero_grad()
    monitor.close()

    def weights(global_step: int) -> dict[str, torch.Tensor]:
        fresh, _ = tiny_gpt()
        fresh.load_state_dict(load_file(tmp_path / "ckpt" / f"step-{global_step - 1:09d}" / "model.safetensors"),
                              strict=False)
        return fresh.state_dict()

    _check_healed(service, "acc-heal", record, weights)
    folders = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert folders == {f"step-{s:09d}" for s in range(EVERY - 1, STEPS - 1, EVERY)}
