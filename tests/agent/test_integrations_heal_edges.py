"""The integrations' healing at its edges, fast (no service: the commands are handed to the
monitor as the service would, the acknowledgements read back from a ``JsonlFileTransport``):
when a rollback cannot be done, the failed acknowledgement says why and training goes on
untouched; the checkpoint a Lightning ``fit`` resumed from is a rollback target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import MonitorConfig  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from tests.integration_helpers import TinyGPT, batches, lightning_tiny_gpt, pl_warnings  # noqa: E402


def _config(run_id: str) -> MonitorConfig:
    return MonitorConfig(run_id=run_id, flush_interval_steps=2, command_check_interval_steps=1,
                         harm_interval_steps=0, tripwire=False)


def _acks(path: Path) -> dict[int, dict[str, Any]]:
    return {e["data"]["command_id"]: {**e["data"], "step": e["step"]}
            for line in path.read_text().splitlines() for e in json.loads(line)["events"]
            if e["kind"] == "command_acknowledged"}


class _HFGPT(TinyGPT):
    """The tiny GPT in emulated FP8 as the Trainer wants it; ``on_train_forward`` runs before each
    training forward (where a test hands the monitor its command)."""

    def __init__(self, on_train_forward: Any = None) -> None:
        super().__init__(update_after_backward=False)
        self.on_train_forward = on_train_forward

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        if self.training and torch.is_grad_enabled() and self.on_train_forward is not None:
            self.on_train_forward()
        return {"loss": self.gpt(input_ids, labels)[1]}


@pl_warnings
def test_lightning_refuses_weights_only_checkpoints_and_trains_on(tmp_path: Path) -> None:
    base = lightning_tiny_gpt()
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    class Module(base):  # type: ignore[misc,valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.steps: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.steps.append(self.trainer.global_step)
            if batch_idx == 3:  # the file of global step 2 exists, but holds no optimizer state
                cb.monitor.receive_commands([{"id": 1, "kind": "rollback", "checkpoint_step": 1, "skip_batches": 1}])
            return self.gpt(*batch)[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches(8), batch_size=None)

    out = tmp_path / "telemetry.jsonl"
    cb = FP8GuardCallback(_config("pl-fail"), transport=JsonlFileTransport(out), heal=True)
    module = Module()
    Trainer(max_steps=6, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
            enable_model_summary=False, callbacks=[cb, ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2,
                                                                       save_top_k=-1, save_weights_only=True)],
            ).fit(module)
    ack = _acks(out)[1]
    assert ack["status"] == "failed" and ack["step"] == 3
    assert "no Lightning checkpoint of step 1" in ack["error"] and "checkpoints of steps [] are" in ack["error"]
    assert module.steps == [0, 1, 2, 3, 4, 5]  # nothing went back


def test_hf_trainer_fails_a_rollback_whose_folder_is_gone(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    steps: list[int] = []

    def forward() -> None:
        step = trainer.state.global_step
        steps.append(step)
        if step == 3:
            shutil.rmtree(tmp_path / "out" / "checkpoint-2")
            cb.monitor.receive_commands([{"id": 1, "kind": "rollback", "checkpoint_step": 1}])

    out = tmp_path / "telemetry.jsonl"
    cb = FP8GuardTrainerCallback(_config("hf-fail"), transport=JsonlFileTransport(out), heal=True)
    data = [{"input_ids": x[0], "labels": y[0]} for x, y in batches(8)]
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=6, per_device_train_batch_size=1,
                             save_steps=2, report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0)
    trainer = Trainer(model=_HFGPT(forward), args=args, train_dataset=data, callbacks=[cb])
    trainer.train()
    ack = _acks(out)[1]
    assert ack["status"] == "failed" and ack["step"] == 3 and "is gone" in ack["error"]
    assert steps == [0, 1, 2, 3, 4, 5] and trainer.state.global_step == 6


def test_hf_heal_without_its_trainer_says_so(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            caplog: pytest.LogCaptureFixture) -> None:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from fp8guard.agent.integrations import hf

    monkeypatch.setattr(hf, "_calling_trainer", lambda callback: None)
    cb = hf.FP8GuardTrainerCallback(_config("hf-unbound"), transport=JsonlFileTransport(tmp_path / "t.jsonl"),
                                    heal=True)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, per_device_train_batch_size=1,
                             report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    Trainer(model=_HFGPT(), args=args, train_dataset=[{"input_ids": x[0], "labels": y[0]} for x, y in batches(2)],
            callbacks=[cb]).train()
    assert cb.healer is None and "heal=True needs the Trainer (callback.bind(trainer))" in caplog.text


@pl_warnings
@pytest.mark.filterwarnings("ignore:The dirpath has changed:UserWarning")  # the resumed fit saves elsewhere
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch ended")
def test_lightning_rolls_back_to_the_checkpoint_fit_resumed_from(tmp_path: Path) -> None:
    """After ``fit(ckpt_path=...)`` the file it resumed from is a rollback target: a rollback to it
    in the resumed fit restores its weights and step (and the step counter goes back)."""
    base = lightning_tiny_gpt()
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    class Module(base):  # type: ignore[misc,valid-type]
        def __init__(self, command_at: int | None = None) -> None:
            super().__init__()
            self.command_at = command_at
            self.seen: list[tuple[int, dict[str, torch.Tensor]]] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append((self.trainer.global_step, {k: v.clone() for k, v in self.gpt.state_dict().items()}))
            if self.trainer.global_step == self.command_at and len(self.seen) == 2:
                callback.monitor.receive_commands([{"id": 7, "kind": "rollback", "checkpoint_step": 3}])
            return self.gpt(*batch)[1]

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches(16), batch_size=None)

    def fit(module: Module, steps: int, folder: str, ckpt_path: Path | None = None) -> None:
        Trainer(max_steps=steps, accelerator="cpu", logger=False, default_root_dir=tmp_path, enable_progress_bar=False,
                enable_model_summary=False, callbacks=[callback, ModelCheckpoint(
                    dirpath=tmp_path / folder, every_n_train_steps=4, save_top_k=-1)]).fit(module, ckpt_path=ckpt_path)

    out = tmp_path / "telemetry.jsonl"
    callback = FP8GuardCallback(_config("pl-resume"), transport=JsonlFileTransport(out), heal=True)
    fit(Module(), 4, "first")
    resumed = tmp_path / "first" / "epoch=0-step=4.ckpt"
    callback = FP8GuardCallback(_config("pl-resume"), transport=JsonlFileTransport(out), heal=True)
    module = Module(command_at=5)
    fit(module, 8, "second", ckpt_path=resumed)
    ack = _acks(out)[7]
    assert ack["status"] == "applied" and ack["path"] == str(resumed) and ack["step"] == 5
    steps = [s for s, _ in module.seen]
    assert steps == [4, 5, 4, 5, 6, 7]  # back to the resumed checkpoint's step, then on to max_steps
    saved = torch.load(resumed, weights_only=False)["state_dict"]
    assert all(torch.equal(module.seen[2][1][k], saved[f"gpt.{k}"]) for k in module.seen[2][1])


def test_hf_trainer_rolls_back_to_the_checkpoint_train_resumed_from(tmp_path: Path) -> None:
    """After ``train(resume_from_checkpoint=...)`` that folder is a rollback target."""
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    seen: list[int] = []

    def forward() -> None:
        seen.append(trainer.state.global_step)
        if seen == [4, 5]:
            callback.monitor.receive_commands([{"id": 7, "kind": "rollback", "checkpoint_step": 3}])

    def train(steps: int) -> Trainer:
        args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=1,
                                 save_steps=4, report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
                                 train_sampling_strategy="sequential")
        data = [{"input_ids": x[0], "labels": y[0]} for x, y in batches(16)]
        return Trainer(model=_HFGPT(forward), args=args, train_dataset=data, callbacks=[callback])

    out = tmp_path / "telemetry.jsonl"
    callback = FP8GuardTrainerCallback(_config("hf-resume"), transport=JsonlFileTransport(out), heal=True)
    trainer = train(4)
    trainer.train()
    seen.clear()
    callback = FP8GuardTrainerCallback(_config("hf-resume"), transport=JsonlFileTransport(out), heal=True)
    trainer = train(8)
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-4"))
    ack = _acks(out)[7]
    assert ack["status"] == "applied" and ack["path"].endswith("checkpoint-4") and ack["step"] == 5
    assert seen == [4, 5, 4, 5, 6, 7] and trainer.state.global_step == 8
