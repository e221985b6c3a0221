"""The harm probe built by each framework integration (#12 item 1) and HF's grad norm every step
(#13 item 7), on the CPU with the real packages: a tiny GPT in emulated FP8, a few steps with
gradient accumulation, telemetry captured by ``JsonlFileTransport``.

What every integration must show: ``loss_fp8``, ``loss_bf16`` and ``fp8_loss_gap`` at the probe
steps only; ``loss_fp8``/``loss_bf16`` equal to a recomputation on the step's *last* micro-batch
with the weights before the optimizer step (so the closure saw the batch the step trained on,
and ran before the update); nothing when the integration's ``harm_probe=False``."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from fp8guard.agent import MonitorConfig  # noqa: E402
from fp8guard.agent.sources.emulation import EmulationSource  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from tests.integration_helpers import TinyGPT, batches, lightning_tiny_gpt, pl_warnings, tiny_gpt  # noqa: E402

STEPS = 5
ACCUMULATE = 2
INTERVAL = 2
PROBED = [s for s in range(1, STEPS) if s % INTERVAL == 0]  # [2, 4]: the probe skips step 0


def _config(run_id: str) -> MonitorConfig:
    return MonitorConfig(run_id=run_id, harm_interval_steps=INTERVAL, flush_interval_steps=2, tripwire=False)


def _steps(path: Path) -> dict[int, dict[str, Any]]:
    out: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        for record in json.loads(line)["steps"]:
            out[record["step"]] = record
    return out


def _recompute(model: torch.nn.Module, loss_of: Callable[[], torch.Tensor]) -> tuple[float, float]:
    """The probe's two forwards, again: FP8 as in training and everything in high precision,
    from the current RNG state, leaving the FP8 state and the RNG as they were."""
    source = EmulationSource.discover(model)
    assert source is not None
    rng = torch.get_rng_state()
    out = []
    with torch.no_grad():
        for plan in ({}, dict.fromkeys(source.precision(), False)):
            torch.set_rng_state(rng)
            with source.probe(plan):
                out.append(float(loss_of()))
    torch.set_rng_state(rng)
    return out[0], out[1]


def _check_probes(steps: dict[int, dict[str, Any]], expected: dict[int, tuple[float, float]]) -> None:
    assert sorted(steps) == list(range(STEPS))
    assert sorted(s for s, r in steps.items() if "fp8_loss_gap" in r) == PROBED
    for s in PROBED:
        r = steps[s]
        assert (r["loss_fp8"], r["loss_bf16"]) == pytest.approx(expected[s], rel=1e-6), s
        assert r["fp8_loss_gap"] == pytest.approx((r["loss_fp8"] - r["loss_bf16"]) / r["loss_bf16"], rel=1e-5)
        assert r["loss_fp8"] != r["loss_bf16"]  # emulated FP8 does change the loss


# ---------------------------------------------------------------------------------- Lightning

def _lightning_fit(tmp_path: Path, harm_probe: Any = True) -> tuple[Any, Any, Path]:
    base = lightning_tiny_gpt()
    from lightning.pytorch import Trainer

    from fp8guard.agent.integrations.lightning import FP8GuardCallback

    class Module(base):  # type: ignore[misc,valid-type]
        """Logs in training_step, as ordinary modules do; records what the test compares with."""

        def __init__(self) -> None:
            super().__init__()
            self.log_calls = 0
            self.step_calls = 0
            self.backward_losses: list[float] = []
            self.last_batch: Any = None
            self.first_batch_of_step: Any = None
            self.expected: dict[int, tuple[float, float]] = {}
            self.first_micro: dict[int, float] = {}

        def log(self, *args: Any, **kwargs: Any) -> None:
            self.log_calls += 1
            super().log(*args, **kwargs)

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            self.step_calls += 1  # counts the probe's extra calls too (observation only)
            _, loss = self.gpt(*batch)
            assert loss is not None
            self.log("train_loss", loss, on_step=True)
            return loss

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            if batch_idx % ACCUMULATE == 0:
                self.first_batch_of_step = batch
            self.last_batch = batch

        def on_before_backward(self, loss: torch.Tensor) -> None:
            self.backward_losses.append(loss.item())

        def on_after_backward(self) -> None:
            self.fp8.update()

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            # after the callback's hook (and its probe), before the weights move
            step = self.trainer.global_step
            if step in PROBED:
                self.expected[step] = _recompute(self.gpt, lambda: self.gpt(*self.last_batch)[1])
                self.first_micro[step] = _recompute(self.gpt, lambda: self.gpt(*self.first_batch_of_step)[1])[0]

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(batches(STEPS * ACCUMULATE), batch_size=None)

    path = tmp_path / "pl.jsonl"
    cb = FP8GuardCallback(_config("pl-harm"), transport=JsonlFileTransport(path), harm_probe=harm_probe)
    module = Module()
    trainer = Trainer(max_steps=STEPS, accumulate_grad_batches=ACCUMULATE, accelerator="cpu", devices=1,
                      logger=False, enable_checkpointing=False, default_root_dir=tmp_path, enable_progress_bar=False,
                      enable_model_summary=False, log_every_n_steps=1, callbacks=[cb])
    trainer.fit(module)
    return module, trainer, path


@pl_warnings
def test_lightning_probe_reruns_training_step_on_the_last_micro_batch_without_logging(tmp_path: Path) -> None:
    module, _, path = _lightning_fit(tmp_path)
    steps = _steps(path)
    _check_probes(steps, module.expected)
    # the last micro-batch, not the first one
    assert all(steps[s]["loss_fp8"] != pytest.approx(module.first_micro[s], rel=1e-6) for s in PROBED)
    n_batches = STEPS * ACCUMULATE
    assert module.step_calls >= n_batches + 2 * len(PROBED)  # the probe did re-run training_step ...
    assert module.log_calls == n_batches  # ... and nothing it logged got through
    assert "log" not in module.__dict__ and "log_dict" not in module.__dict__  # silencing undone
    # the step's loss: the mean of its micro-batches' (Lightning divided each by ACCUMULATE)
    per_step = [sum(module.backward_losses[i:i + ACCUMULATE]) for i in range(0, n_batches, ACCUMULATE)]
    assert [steps[s]["loss"] for s in range(STEPS)] == pytest.approx(per_step, rel=1e-6)


@pl_warnings
def test_lightning_probe_opt_out_and_own_loss(tmp_path: Path) -> None:
    _, _, path = _lightning_fit(tmp_path / "off", harm_probe=False)
    assert not any("fp8_loss_gap" in r for r in _steps(path).values())

    calls: list[int] = []

    def own(module: Any, batch: Any) -> torch.Tensor:
        calls.append(1)
        return module.gpt(*batch)[1]

    module, _, path = _lightning_fit(tmp_path / "own", harm_probe=own)
    _check_probes(_steps(path), module.expected)
    assert calls and module.step_calls == STEPS * ACCUMULATE  # training_step itself never re-ran


# ---------------------------------------------------------------------------- transformers


class _HFGPT(TinyGPT):
    """The tiny GPT in emulated FP8 as the Trainer wants it (keyword inputs, a loss out)."""

    def __init__(self, *, as_tuple: bool = False) -> None:
        super().__init__()
        self.as_tuple = as_tuple
        self.last_inputs: dict[str, torch.Tensor] = {}

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        logits, loss = self.gpt(input_ids, labels)
        if self.training and torch.is_grad_enabled():
            self.last_inputs = {"input_ids": input_ids} if labels is None else {"input_ids": input_ids, "labels": labels}
        return (loss, logits) if self.as_tuple else {"loss": loss, "logits": logits}


def _hf_train(tmp_path: Path, model: _HFGPT, callbacks: list[Any], **kw: Any) -> Any:
    pytest.importorskip("transformers")
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=3e-3, disable_tqdm=True,
                             dataloader_num_workers=0, seed=0, gradient_accumulation_steps=ACCUMULATE, **kw)
    data = [{"input_ids": x[i], "labels": y[i]} for x, y in batches(STEPS * ACCUMULATE) for i in range(2)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


def _hf_checker(model: _HFGPT, loss_of: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> Any:
    from transformers import TrainerCallback

    class Checker(TrainerCallback):  # type: ignore[misc]
        """Runs after fp8guard's callback in on_pre_optimizer_step: recomputes the last micro-batch."""

        def __init__(self) -> None:
            self.expected: dict[int, tuple[float, float]] = {}

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in PROBED:
                inputs = dict(model.last_inputs)
                self.expected[state.global_step] = _recompute(model, lambda: loss_of(inputs))

    return Checker()


def test_hf_probe_uses_compute_loss_and_grad_norm_is_recorded_every_step(tmp_path: Path) -> None:
    """Default clipping (max_grad_norm 1.0) and default logging: the pre-clip norm every step."""
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    path = tmp_path / "hf.jsonl"
    model = _HFGPT()
    cb = FP8GuardTrainerCallback(_config("hf-harm"), transport=JsonlFileTransport(path))
    checker = _hf_checker(model, lambda inputs: model(**inputs)["loss"])
    trainer = _hf_train(tmp_path, model, [cb, checker])
    steps = _steps(path)
    _check_probes(steps, checker.expected)
    assert all("grad_norm" in steps[s] and "loss" in steps[s] for s in range(STEPS))
    assert trainer.state.log_history[-1]["train_loss"] == pytest.approx(
        sum(steps[s]["loss"] for s in range(STEPS)) / STEPS, rel=1e-5)
    assert "compute_loss" not in trainer.__dict__ and "clip_grad_norm_" not in trainer.accelerator.__dict__


def test_hf_grad_norm_is_the_trainers_pre_clip_norm(tmp_path: Path) -> None:
    """Clipping far below the norm; logged every step for comparison: the recorded norm is the
    Trainer's own, before clipping. The loss of a compute_loss_func (the forward returns only a
    tuple) is the Trainer's too, and so is the probe's."""
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    path = tmp_path / "hf.jsonl"
    model = _HFGPT(as_tuple=True)

    last_labels: list[torch.Tensor] = []

    def doubled(outputs: Any, labels: torch.Tensor, num_items_in_batch: Any = None) -> torch.Tensor:
        # the Trainer pops the labels before the forward and hands them here
        if torch.is_grad_enabled():
            last_labels[:] = [labels]
        logits = outputs[1]
        return 2 * torch.nn.functional.cross_entropy(logits.view(-1, logits.size(-1)), labels.view(-1))

    cb = FP8GuardTrainerCallback(_config("hf-norm"), transport=JsonlFileTransport(path))
    checker = _hf_checker(model, lambda inputs: doubled(model(**inputs), last_labels[0]))
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, report_to=[],
                             use_cpu=True, save_strategy="no", learning_rate=3e-3, disable_tqdm=True, seed=0,
                             dataloader_num_workers=0, gradient_accumulation_steps=ACCUMULATE, max_grad_norm=1e-3,
                             logging_steps=1)
    data = [{"input_ids": x[i], "labels": y[i]} for x, y in batches(STEPS * ACCUMULATE) for i in range(2)]
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[cb, checker], compute_loss_func=doubled)
    trainer.train()
    steps = _steps(path)
    _check_probes(steps, checker.expected)
    logged = [h for h in trainer.state.log_history if "grad_norm" in h]
    assert [h["step"] for h in logged] == list(range(1, STEPS + 1))
    assert [steps[s]["grad_norm"] for s in range(STEPS)] == pytest.approx([h["grad_norm"] for h in logged], rel=1e-5)
    assert min(h["grad_norm"] for h in logged) > 0.1  # before clipping at 1e-3
    # compute_loss_func's losses are normalised over the step already: the Trainer sums them
    assert [steps[s]["loss"] for s in range(STEPS)] == pytest.approx([h["loss"] for h in logged], rel=1e-5)


def test_hf_probe_opt_out(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from fp8guard.agent.integrations.hf import FP8GuardTrainerCallback

    path = tmp_path / "hf.jsonl"
    cb = FP8GuardTrainerCallback(_config("hf-off"), transport=JsonlFileTransport(path), harm_probe=False)
    _hf_train(tmp_path, _HFGPT(), [cb])
    steps = _steps(path)
    assert all("grad_norm" in r for r in steps.values()) and not any("fp8_loss_gap" in r for r in steps.values())


# ------------------------------------------------------------------------------ Accelerate


@pytest.mark.parametrize("harm_probe", [True, False])
def test_accelerate_probe_replays_the_last_forward(tmp_path: Path, harm_probe: bool) -> None:
    pytest.importorskip("accelerate")
    from accelerate import Accelerator

    from fp8guard.agent.integrations.accelerate import attach_accelerate

    accelerator = Accelerator(cpu=True)
    gpt, fp8 = tiny_gpt()
    model, opt = accelerator.prepare(gpt, torch.optim.AdamW(gpt.parameters(), lr=3e-3))
    path = tmp_path / "acc.jsonl"
    monitor = attach_accelerate(accelerator, model, opt, _config("acc-harm"), transport=JsonlFileTransport(path),
                                harm_probe=harm_probe)
    data = batches(STEPS * ACCUMULATE)
    expected = {}
    for step in range(STEPS):
        for x, y in data[step * ACCUMULATE:(step + 1) * ACCUMULATE]:
            _, loss = model(x, y)
            accelerator.backward(loss / ACCUMULATE)
            fp8.update()
        monitor.step(loss)  # no loss_fn: the monitor replays the last forward
        if step in PROBED:
            expected[step] = _recompute(gpt, lambda: model(x, y)[1])  # noqa: B023 - the last micro-batch
        opt.step()
        opt.zero_grad()
    monitor.close()
    steps = _steps(path)
    if harm_probe:
        _check_probes(steps, expected)
    else:
        assert sorted(steps) == list(range(STEPS)) and not any("fp8_loss_gap" in r for r in steps.values())
