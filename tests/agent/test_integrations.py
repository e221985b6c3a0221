"""Framework integrations end to end on the CPU: a tiny GPT in emulated FP8 trained by Lightning,
the transformers Trainer and an Accelerate loop streams to the real service app; what arrived is
read back through the HTTP API. Each framework is optional: its tests skip without it."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from fp8guard.agent import ConfigError, MonitorConfig
from fp8guard.agent.transport import HttpTransport, RunInfo
from tests.integration_helpers import TinyGPT, batches, lightning_tiny_gpt, pl_warnings, tiny_gpt

N_TENSORS = 3 * 5  # 4 linears of the block + lm_head, 3 operands each


def _transport(client: Any, run_id: str, tmp_path: Path) -> HttpTransport:
    # A spool of its own: batches a failed earlier run left in the default one must not leak in.
    return HttpTransport("http://testserver", RunInfo(run_id=run_id, model="tiny-gpt"), client=client,
                         spool_dir=tmp_path / "spool")


def _check_run(client: Any, run_id: str, steps: list[int], *, loss_steps: list[int] | None = None,
               norm_steps: list[int] | None = None) -> list[dict[str, Any]]:
    """Asserts what every integration must deliver; returns the run's events."""
    detail = client.get(f"/v1/runs/{run_id}").json()
    assert detail["status"] == "finished", detail
    assert detail["last_step"] == steps[-1] and detail["num_tensors"] == N_TENSORS
    s = client.get(f"/v1/runs/{run_id}/scalars", params={"fields": "loss,grad_norm,lr"}).json()
    assert s["steps"] == steps

    def present(field: str) -> list[int]:
        return [st for st, v in zip(s["steps"], s["min"][field], strict=True) if v is not None]

    assert present("loss") == (steps if loss_steps is None else loss_steps)
    assert present("grad_norm") == (steps if norm_steps is None else norm_steps)
    assert all(math.isfinite(v) and v > 0 for v in s["min"]["loss"] + s["min"]["grad_norm"] if v is not None)
    assert all(v is not None and v >= 0 for v in s["min"]["lr"]), s["min"]["lr"]
    amax = client.get(f"/v1/runs/{run_id}/matrix", params={"stat": "amax", "encoding": "json"}).json()
    assert amax["steps"] == steps and len(amax["tensors"]) == N_TENSORS
    events: list[dict[str, Any]] = client.get(f"/v1/runs/{run_id}/events").json()
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and "checkpoint_saved" in kinds
    return events


# ---------------------------------------------------------------------------------- Lightning


def _lightning_module() -> Any:
    class Module(lightning_tiny_gpt()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.losses: list[float] = []
            self.norms: list[float] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            _, loss = self.gpt(*batch)
            assert loss is not None
            self.losses.append(loss.item())
            return loss

        def on_after_backward(self) -> None:
            self.fp8.update()  # once per forward/backward pair, before the callback reads the stats

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # runs right after the callback's hook, before Lightning clips
            grads = [p.grad for p in self.parameters() if p.grad is not None]
            self.norms.append(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])).item())

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches(4), batch_size=None)  # an epoch is 4 steps

    return Module()


def _lightning_trainer(tmp_path: Path, max_steps: int, callback: Any, **kw: Any) -> Any:
    pytest.importorskip("lightning")
    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=2, save_top_k=-1)
    return Trainer(max_steps=max_steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=True,
                   default_root_dir=tmp_path, enable_progress_bar=False, enable_model_summary=False,
                   log_every_n_steps=1, callbacks=[callback, ckpt], **kw)


@pl_warnings
def test_lightning_callback_streams_checkpoints_and_resumes(client: Any, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    cb = FP8GuardCallback(MonitorConfig(run_id="pl-run", flush_interval_steps=2), transport=_transport(client, "pl-run", tmp_path))
    module = _lightning_module()
    _lightning_trainer(tmp_path, 4, cb, gradient_clip_val=1e-3).fit(module)
    events = _check_run(client, "pl-run", [0, 1, 2, 3])
    s = client.get("/v1/runs/pl-run/scalars", params={"fields": "loss,grad_norm"}).json()
    assert s["min"]["loss"] == pytest.approx(module.losses, rel=1e-6)
    # the norm before clipping (clipping at 1e-3 would flatten every value to 1e-3)
    assert s["min"]["grad_norm"] == pytest.approx(module.norms, rel=1e-5) and min(module.norms) > 0.1
    assert [(e["step"], e["data"]["global_step"]) for e in events if e["kind"] == "checkpoint_saved"] == [(1, 2), (3, 4)]

    ckpt = torch.load(tmp_path / "ckpt" / "epoch=0-step=4.ckpt", weights_only=False)
    state = ckpt["callbacks"]["FP8GuardCallback"]
    assert cb.monitor is not None and state == cb.monitor.state_dict()
    assert (state["run_id"], state["next_step"], state["segment"]) == ("pl-run", 4, 0)

    # Resume in a new callback that does not name the run: the checkpoint continues it.
    cb2 = FP8GuardCallback(MonitorConfig(flush_interval_steps=2), transport=_transport(client, "pl-run", tmp_path))
    # (the checkpoint folder must be empty again, or Lightning warns about overwriting it)
    resume = (tmp_path / "ckpt" / "epoch=0-step=4.ckpt").rename(tmp_path / "resume.ckpt")
    shutil.rmtree(tmp_path / "ckpt")
    _lightning_trainer(tmp_path, 6, cb2).fit(_lightning_module(), ckpt_path=resume)
    assert cb2.monitor is not None and cb2.monitor.run_id == "pl-run"
    events = _check_run(client, "pl-run", [0, 1, 2, 3, 4, 5])
    resumed = [e for e in events if e["kind"] == "run_resumed"]
    assert [e["data"]["global_step"] for e in resumed] == [4]


@pl_warnings
def test_lightning_exception_marks_run_failed(client: Any, tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    module = _lightning_module()

    def boom(batch: Any, batch_idx: int) -> torch.Tensor:
        if batch_idx == 2:
            raise RuntimeError("diverged")
        _, loss = module.gpt(*batch)
        return loss

    module.training_step = boom  # type: ignore[method-assign]
    cb = FP8GuardCallback(MonitorConfig(run_id="pl-fail"), transport=_transport(client, "pl-fail", tmp_path))
    with pytest.raises(RuntimeError, match="diverged"):
        _lightning_trainer(tmp_path, 4, cb).fit(module)
    assert client.get("/v1/runs/pl-fail").json()["status"] == "failed"
    s = client.get("/v1/runs/pl-fail/scalars", params={"fields": "loss"}).json()
    assert s["steps"] == [0, 1]


# ---------------------------------------------------------------------------- transformers


class _HFGPT(TinyGPT):
    """The tiny GPT in emulated FP8, speaking the Trainer's language (keyword inputs, a loss out)."""

    def __init__(self, *, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple
        self.losses: list[float] = []

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> Any:
        _, loss = self.gpt(input_ids, labels)
        assert loss is not None
        if self.training:
            self.losses.append(loss.item())
        return (loss,) if self.as_tuple else {"loss": loss}


def _hf_dataset(n: int) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": x[i], "labels": y[i]} for x, y in batches(n // 2) for i in range(2)]


def _hf_train(tmp_path: Path, model: torch.nn.Module, callback: Any, **kw: Any) -> Any:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_steps=2, learning_rate=3e-3, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=_hf_dataset(16), callbacks=[callback])
    trainer.train()
    return trainer


def test_hf_trainer_callback_refuses_the_gradient_buffer() -> None:
    """HF's Trainer sets the gradients to None every step: the buffer could never hold them."""
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    with pytest.raises(ConfigError, match="grad_buffer needs a loop that zeroes gradients in place"):
        FP8GuardTrainerCallback(MonitorConfig(grad_buffer=True))


def test_hf_trainer_callback_streams_every_step(client: Any, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations.hf import STATE_FILE, FP8GuardTrainerCallback

    cb = FP8GuardTrainerCallback(MonitorConfig(run_id="hf-run", flush_interval_steps=2),
                                 transport=_transport(client, "hf-run", tmp_path))
    model = _HFGPT()
    # No clipping: the norm read in on_pre_optimizer_step is the true one, every step.
    trainer = _hf_train(tmp_path, model, cb, max_grad_norm=0.0, logging_steps=3)
    events = _check_run(client, "hf-run", [0, 1, 2, 3])
    s = client.get("/v1/runs/hf-run/scalars", params={"fields": "loss,grad_norm"}).json()
    assert s["min"]["loss"] == pytest.approx(model.losses, rel=1e-6)  # every step, not only logging ones
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["step"] for h in logged] == [3]
    assert s["min"]["grad_norm"][2] == pytest.approx(logged[0]["grad_norm"], rel=1e-5)
    saved = [(e["step"], e["data"]["global_step"]) for e in events if e["kind"] == "checkpoint_saved"]
    assert saved == [(1, 2), (3, 4)]
    saved_state = json.loads((tmp_path / "checkpoint-4" / STATE_FILE).read_text())
    assert cb.monitor is not None and saved_state == cb.monitor.state_dict() and saved_state["run_id"] == "hf-run" and saved_state["next_step"] == 4


def test_hf_trainer_callback_falls_back_to_logs_and_resumes(client: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Without its Trainer (not found on the call stack), tuple outputs and clipping: loss and
    pre-clip grad norm only on logging steps; a resumed train() continues the run named in the
    checkpoint."""
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations import hf
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    monkeypatch.setattr(hf, "_calling_trainer", lambda callback: None)

    cb = FP8GuardTrainerCallback(MonitorConfig(run_id="hf-logs"), transport=_transport(client, "hf-logs", tmp_path))
    trainer = _hf_train(tmp_path, _HFGPT(as_tuple=True), cb, max_grad_norm=1e-3, logging_steps=2)
    _check_run(client, "hf-logs", [0, 1, 2, 3], loss_steps=[1, 3], norm_steps=[1, 3])
    s = client.get("/v1/runs/hf-logs/scalars", params={"fields": "loss,grad_norm"}).json()
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [s["min"]["grad_norm"][i] for i in (1, 3)] == pytest.approx([h["grad_norm"] for h in logged], rel=1e-6)
    assert [s["min"]["loss"][i] for i in (1, 3)] == pytest.approx([h["loss"] for h in logged], rel=1e-6)
    assert min(h["grad_norm"] for h in logged) > 0.1  # the norm before clipping at 1e-3

    cb2 = FP8GuardTrainerCallback(transport=_transport(client, "hf-logs", tmp_path))
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=6, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_steps=2, disable_tqdm=True, logging_steps=1, max_grad_norm=0.0)
    Trainer(model=_HFGPT(), args=args, train_dataset=_hf_dataset(16), callbacks=[cb2]).train(
        resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert cb2.monitor is not None and cb2.monitor.run_id == "hf-logs"
    events = _check_run(client, "hf-logs", [0, 1, 2, 3, 4, 5], loss_steps=[1, 3, 4, 5], norm_steps=[1, 3, 4, 5])
    assert [e["data"]["global_step"] for e in events if e["kind"] == "run_resumed"] == [4]


# ------------------------------------------------------------------------------ Accelerate


def test_accelerate_hooks_persist_and_restore_the_run(client: Any, tmp_path: Path) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from fp8guard.agent.integrations.accelerate import STATE_FILE, attach_accelerate

    def train(accelerator: Any, monitor_steps: int, *, run_id: str | None = None,
              resume: Path | None = None) -> tuple[Any, list[float]]:
        gpt, fp8 = tiny_gpt()
        model, opt = accelerator.prepare(gpt, torch.optim.AdamW(gpt.parameters(), lr=3e-3))
        monitor = attach_accelerate(accelerator, model, opt, MonitorConfig(run_id=run_id, flush_interval_steps=2),
                                    transport=_transport(client, "acc-run", tmp_path), resume_from=resume)
        if resume is not None:
            accelerator.load_state(str(resume))
        losses = []
        for x, y in batches(monitor_steps):
            _, loss = model(x, y)
            accelerator.backward(loss)
            fp8.update()
            monitor.step(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return monitor, losses

    accelerator = Accelerator(cpu=True)
    monitor, losses = train(accelerator, 4, run_id="acc-run")
    accelerator.save_state(str(tmp_path / "ckpt"))
    monitor.close()
    assert json.loads((tmp_path / "ckpt" / STATE_FILE).read_text())["next_step"] == 4
    _check_run(client, "acc-run", [0, 1, 2, 3])
    s = client.get("/v1/runs/acc-run/scalars", params={"fields": "loss"}).json()
    assert s["min"]["loss"] == pytest.approx(losses, rel=1e-6)

    # A new process resumes from the checkpoint without naming the run: the checkpoint names it.
    monitor2, _ = train(Accelerator(cpu=True), 2, resume=tmp_path / "ckpt")
    monitor2.close()
    assert monitor2.run_id == "acc-run"
    events = _check_run(client, "acc-run", [0, 1, 2, 3, 4, 5])
    assert [e["data"]["path"] for e in events if e["kind"] == "run_resumed"] == [str(tmp_path / "ckpt")] * 2
