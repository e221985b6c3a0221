"""CheckpointManager and Remediator on the CPU: bit-exact checkpoint round trips, atomic writes,
pruning, BF16 fallback and re-promotion, and rollback through the Monitor's command path."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from fp8guard.agent import Monitor, MonitorConfig, NullTransport, emulate_fp8  # noqa: E402
from fp8guard.agent.checkpoint import CheckpointManager  # noqa: E402
from fp8guard.agent.commands import Command, parse_command  # noqa: E402
from fp8guard.agent.emulation import Fp8Emulation  # noqa: E402
from fp8guard.agent.errors import CheckpointError  # noqa: E402
from fp8guard.agent.remediation import Remediator  # noqa: E402
from fp8guard.agent.transport import JsonlFileTransport  # noqa: E402
from fp8guard.nanogpt import GPT, GPTConfig, TextBatches, stdlib_text  # noqa: E402

TINY = GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16)
TEXT = stdlib_text(60_000)


@dataclass
class Run:
    model: nn.Module
    fp8: Fp8Emulation
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    data: TextBatches
    ckpts: CheckpointManager


def _run(tmp_path: Path, *, every: int = 5, keep_last: int = 5, seed: int = 0) -> Run:
    torch.manual_seed(seed)
    model = GPT(TINY)
    fp8 = emulate_fp8(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    data = TextBatches(TEXT, block_size=TINY.block_size, batch_size=2, seed=seed)
    ckpts = CheckpointManager(tmp_path / "ckpt", model=model, optimizer=opt, scheduler=sched,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", s["position"]),
                              every_n_steps=every, keep_last=keep_last, rank=0)
    return Run(model, fp8, opt, sched, data, ckpts)


def _train_step(r: Run) -> torch.Tensor:
    x, y = r.data.next()
    _, loss = r.model(x, y)
    assert loss is not None
    loss.backward()
    r.fp8.update()
    r.opt.step()
    r.sched.step()
    r.opt.zero_grad()
    return loss.detach()


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{k} differs"


def _flat_optimizer_state(opt: torch.optim.Optimizer) -> list[Any]:
    out: list[Any] = []
    for pid, st in sorted(opt.state_dict()["state"].items()):
        for key, v in sorted(st.items()):
            out.append((pid, key, v.clone() if isinstance(v, torch.Tensor) else v))
    return out


def _assert_same_optimizer_state(a: list[Any], b: list[Any]) -> None:
    assert len(a) == len(b) and a
    for (pa, ka, va), (pb, kb, vb) in zip(a, b, strict=True):
        assert (pa, ka) == (pb, kb)
        if isinstance(va, torch.Tensor):
            assert torch.equal(va, vb), f"optimizer state {pa}/{ka} differs"
        else:
            assert va == vb


# -- CheckpointManager -----------------------------------------------------------------------------


def test_round_trip_restores_params_optimizer_rng_and_data_bit_exactly(tmp_path: Path) -> None:
    r = _run(tmp_path)
    for _ in range(3):
        _train_step(r)
    params, opt_state = _snapshot(r.model), _flat_optimizer_state(r.opt)
    sched_state, position = r.sched.state_dict(), r.data.position
    path = r.ckpts.save(2, extra={"monitor": {"next_step": 3, "segment": 0}})
    assert path.name == "ckpt-rank0-step000000002.pt" and r.ckpts.steps() == [2]
    # the draws that should follow the checkpoint
    draws = (torch.rand(4), random.random(), np.random.rand(3))
    next_loss = _train_step(r)
    for _ in range(3):
        _train_step(r)
    assert not torch.equal(next(iter(r.model.parameters())), next(iter(params.values())))

    extra = r.ckpts.load(2)

    assert extra == {"monitor": {"next_step": 3, "segment": 0}}
    _assert_same_state(_snapshot(r.model), params)  # weights and the FP8 amax histories and scales
    assert any(k.endswith("fp8_amax_history_fwd") for k in params)
    _assert_same_optimizer_state(_flat_optimizer_state(r.opt), opt_state)
    assert r.sched.state_dict() == sched_state and r.opt.param_groups[0]["lr"] == r.sched.get_last_lr()[0]
    assert r.data.position == position
    assert torch.equal(torch.rand(4), draws[0])
    assert random.random() == draws[1]
    assert np.array_equal(np.random.rand(3), draws[2])
    # the whole training state is back: replaying the next step gives the same loss to the bit
    torch.manual_seed(123)  # disturb the RNG, then restore it once more
    random.seed(5)
    r.ckpts.load(2)
    assert torch.equal(_train_step(r), next_loss)


def test_maybe_save_every_n_completed_steps(tmp_path: Path) -> None:
    r = _run(tmp_path, every=5)
    saved = [s for s in range(12) if r.ckpts.maybe_save(s) is not None]
    assert saved == [4, 9] and r.ckpts.steps() == [4, 9]
    assert r.ckpts.latest_at_or_before(8) == 4 and r.ckpts.latest_at_or_before(9) == 9
    assert r.ckpts.latest_at_or_before(3) is None


def test_a_crash_mid_write_leaves_the_previous_checkpoints_intact(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    r = _run(tmp_path)
    _train_step(r)
    good = r.ckpts.save(4)
    before = good.read_bytes()

    def crash(obj: object, f: Any, *a: Any, **k: Any) -> None:
        f.write(b"half a checkpoint")
        raise OSError("No space left on device")

    _train_step(r)
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError, match="No space left"):
        r.ckpts.save(9)
    with pytest.raises(OSError, match="No space left"):
        r.ckpts.save(4)  # overwriting an existing checkpoint fails too: the old one stays
    monkeypatch.undo()
    assert sorted(os.listdir(r.ckpts.directory)) == [good.name]  # no torn file, no temp file left
    assert good.read_bytes() == before and r.ckpts.steps() == [4]
    r.ckpts.load(4)


def test_stale_temp_files_of_a_killed_writer_are_removed(tmp_path: Path) -> None:
    r = _run(tmp_path)
    stale = r.ckpts.directory / ".ckpt-rank0-step000000009.pt.abc123.tmp"
    stale.write_bytes(b"torn")
    other_rank = r.ckpts.directory / ".ckpt-rank1-step000000009.pt.abc123.tmp"
    other_rank.write_bytes(b"rank 1 may be writing this right now")
    CheckpointManager(r.ckpts.directory, model=r.model, rank=0)
    assert not stale.exists() and other_rank.exists()


def test_keep_last_never_prunes_the_newest_known_good(tmp_path: Path) -> None:
    r = _run(tmp_path, every=1, keep_last=2)
    for s in range(3):
        r.ckpts.save(s)
    assert r.ckpts.steps() == [1, 2]
    r.ckpts.mark_known_good(1)
    for s in range(3, 6):
        r.ckpts.save(s)
    assert r.ckpts.steps() == [1, 4, 5] and r.ckpts.known_good() == [1]
    r.ckpts.mark_known_good(4)  # 1 is no longer the newest known-good one: it may go
    assert r.ckpts.steps() == [4, 5] and r.ckpts.known_good() == [4]
    r.ckpts.save(6)
    r.ckpts.save(7)
    assert r.ckpts.steps() == [4, 6, 7] and r.ckpts.known_good() == [4]
    index = json.loads((r.ckpts.directory / "index-rank0.json").read_text())
    assert index["known_good"] == [4] and index["rank"] == 0
    # a second manager (a restarted job) sees the same marks
    again = CheckpointManager(r.ckpts.directory, model=r.model, every_n_steps=1, keep_last=2, rank=0)
    assert again.known_good() == [4]


def test_validation_errors_say_what_to_change(tmp_path: Path) -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="every_n_steps must be an int >= 1"):
        CheckpointManager(tmp_path, model=model, every_n_steps=0)
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(tmp_path, model=model, keep_last=0)
    with pytest.raises(ValueError, match="together"):
        CheckpointManager(tmp_path, model=model, data_state=dict)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="not a folder"):
        CheckpointManager(a_file, model=model)
    if os.geteuid() != 0:  # root writes anywhere
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            CheckpointManager(locked, model=model)
    ckpts = CheckpointManager(tmp_path / "ok", model=model, rank=0)
    ckpts.save(3)
    with pytest.raises(CheckpointError, match=r"no checkpoint of step 7 .*steps: \[3\]"):
        ckpts.load(7)
    with pytest.raises(CheckpointError, match="cannot mark step 7"):
        ckpts.mark_known_good(7)
    with pytest.raises(ValueError, match="step must be an int >= 0"):
        ckpts.save(-1)
    other = CheckpointManager(tmp_path / "ok", model=nn.Sequential(nn.Linear(2, 3)), rank=0)
    with pytest.raises(CheckpointError, match="differ in shape"):
        other.load(3)
    with pytest.raises(ValueError, match="skipping batches needs"):
        ckpts.skip_batches(2)


# -- fallback and promotion ------------------------------------------------------------------------


def _models() -> tuple[nn.Module, nn.Module, Fp8Emulation]:
    torch.manual_seed(0)
    plain = GPT(TINY)
    torch.manual_seed(0)
    model = GPT(TINY)
    return plain, model, emulate_fp8(model)


def _cmd(kind: str, cid: int = 1, **kw: Any) -> Command:
    return parse_command({"id": cid, "kind": kind, **kw})


@pytest.mark.parametrize("via", ["monitor_sources", "model"])
def test_whole_model_fallback_matches_the_plain_model(via: str) -> None:
    plain, model, _ = _models()
    x, _ = TextBatches(TEXT, block_size=TINY.block_size, batch_size=2).next()
    assert not torch.equal(model(x)[0], plain(x)[0])  # emulated FP8 differs
    if via == "monitor_sources":
        monitor = Monitor(MonitorConfig(), transport=NullTransport()).attach(model)
        remediator = Remediator(sources=monitor.sources)
    else:
        remediator = Remediator(model=model)
    outcome = remediator.apply(_cmd("fallback"), step=0)
    assert outcome.status == "applied", outcome.error
    assert outcome.details["precision"] == "bf16" and outcome.details["switched_modules"] == 5
    assert torch.equal(model(x)[0], plain(x)[0])


def test_fallback_of_named_modules_only_changes_those() -> None:
    _, model, fp8 = _models()
    remediator = Remediator(model=model)
    outcome = remediator.apply(_cmd("fallback", modules=["blocks.0.mlp_fc", "lm_head"]), step=3)
    assert outcome.status == "applied", outcome.error
    assert outcome.details["modules"] == ["blocks.0.mlp_fc", "lm_head"]
    seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for name, m in fp8.modules():
        m.register_forward_hook(lambda mod, a, out, name=name: seen.__setitem__(name, (a[0], out)))
    x, _ = TextBatches(TEXT, block_size=TINY.block_size, batch_size=2).next()
    model(x)
    for name, m in fp8.modules():
        inp, out = seen[name]
        exact = torch.equal(out, F.linear(inp, m.weight, m.bias))
        assert exact == (name in {"blocks.0.mlp_fc", "lm_head"}), name
    # a parent name means every FP8 module under it
    outcome = remediator.apply(_cmd("fallback", cid=2, modules=["blocks.0"]), step=4)
    assert outcome.details["modules"] == ["blocks.0.attn_proj", "blocks.0.attn_qkv", "blocks.0.mlp_fc",
                                          "blocks.0.mlp_proj"]
    assert [m.fp8_enabled for _, m in fp8.modules()] == [False] * 5


def test_unknown_modules_fail_naming_them() -> None:
    _, model, fp8 = _models()
    outcome = Remediator(model=model).apply(_cmd("fallback", modules=["lm_head", "blocks.7.mlp_fc", "nope"]),
                                            step=0)
    assert outcome.status == "failed"
    assert outcome.error is not None and "['blocks.7.mlp_fc', 'nope']" in outcome.error
    assert all(m.fp8_enabled for _, m in fp8.modules())  # nothing switched
    no_fp8 = Remediator(model=nn.Sequential(nn.Linear(2, 2))).apply(_cmd("fallback"), step=0)
    assert no_fp8.status == "failed" and no_fp8.error is not None and "no FP8 module" in no_fp8.error


def test_promote_resets_the_stale_amax_history_and_scale() -> None:
    _, model, fp8 = _models()
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    data = TextBatches(TEXT, block_size=TINY.block_size, batch_size=2)
    remediator = Remediator(model=model)

    def step() -> None:
        x, y = data.next()
        model(x, y)[1].backward()  # type: ignore[union-attr]
        fp8.update()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        step()
    head = dict(fp8.modules())["lm_head"]
    assert head.fp8_amax_history_fwd.abs().sum() > 0 and not torch.all(head.fp8_scale_fwd[:2] == 1)
    assert remediator.apply(_cmd("fallback", modules=["lm_head"]), step=2).status == "applied"
    step()  # in BF16: its FP8 state is frozen, the stale values stay
    assert head.fp8_amax_history_fwd.abs().sum() > 0
    outcome = remediator.apply(_cmd("promote", cid=2, modules=["lm_head"]), step=3)
    assert outcome.status == "applied" and outcome.details["precision"] == "fp8"
    assert head.fp8_enabled
    for buf in (head.fp8_amax_history_fwd, head.fp8_amax_history_bwd):
        assert torch.count_nonzero(buf) == 0
    assert torch.all(head.fp8_scale_fwd == 1) and torch.all(head.fp8_scale_bwd == 1)
    other = dict(fp8.modules())["blocks.0.mlp_fc"]
    assert other.fp8_amax_history_fwd.abs().sum() > 0  # untouched


class Float8Linear(nn.Linear):
    """Stands in for torchao's class: a forward that is visibly not plain."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 1000.0


def test_torchao_fallback_through_its_source_switch() -> None:
    """The torchao switch (owned by the torchao source, torchao not needed) through the remediator."""
    from fp8guard.agent.sources.torchao import TorchaoSwitch, in_fp8

    class Cfg:  # the parts of a Float8LinearConfig the switch reads
        cast_config_input = cast_config_weight = type("C", (), {"target_dtype": torch.float8_e4m3fn})()
        cast_config_grad_output = type("C", (), {"target_dtype": torch.float8_e5m2})()

    torch.manual_seed(0)
    model = nn.Sequential(Float8Linear(4, 4), nn.ReLU(), Float8Linear(4, 2))
    for m in (model[0], model[2]):
        m.config = Cfg()  # type: ignore[assignment]
    x = torch.randn(3, 4)
    fp8_out = model(x)
    remediator = Remediator(sources=[TorchaoSwitch([("0", model[0]), ("2", model[2])])])
    assert remediator.apply(_cmd("fallback", modules=["0"]), step=0).status == "applied"
    assert not in_fp8(model[0]) and in_fp8(model[2])
    plain_first = F.linear(x, model[0].weight, model[0].bias)
    assert torch.equal(model[0](x), plain_first)
    assert torch.equal(model(x), model[2].__class__.forward(model[2], F.relu(plain_first)))
    assert remediator.apply(_cmd("promote", cid=2, modules=["0"]), step=1).status == "applied"
    assert torch.equal(model(x), fp8_out) and "forward" not in model[0].__dict__ and in_fp8(model[0])


def test_no_torchao_knowledge_in_the_remediator() -> None:
    """Each source owns its set_fp8: the remediator names no FP8 library's classes."""
    text = (Path(__file__).resolve().parents[2] / "agent" / "remediation.py").read_text()
    assert "Float8Linear" not in text and "import torchao" not in text


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")
def test_real_torchao_fallback_runs_the_plain_gemm() -> None:
    float8 = pytest.importorskip("torchao.float8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    cfg = float8.Float8LinearConfig.from_recipe_name("tensorwise")
    cfg = type(cfg)(**{**cfg.__dict__, "emulate": True})
    float8.convert_to_float8_training(model, config=cfg)
    assert type(model[0]).__name__ == "Float8Linear"
    x = torch.randn(8, 32) * 3
    fp8_out = model(x)
    remediator = Remediator(model=model)
    assert remediator.apply(_cmd("fallback"), step=0).status == "applied"
    plain = F.linear(F.relu(F.linear(x, model[0].weight, model[0].bias)), model[2].weight, model[2].bias)
    assert torch.equal(model(x), plain) and not torch.equal(plain, fp8_out)
    model(x).sum().backward()  # trains in BF16 too
    assert remediator.apply(_cmd("promote", cid=2), step=1).status == "applied"
    assert torch.equal(model(x), fp8_out)


def test_a_failing_source_gives_a_failed_outcome_not_an_exception() -> None:
    class Broken:
        kind = "broken"

        def tensors(self) -> list[Any]:
            from fp8guard.agent.sources.base import TensorSpec
            return [TensorSpec(module="m", role="fwd_input", fp8_format="e4m3", fp8_max=448.0)]

        def set_fp8(self, modules: Any, enabled: bool) -> None:
            raise RuntimeError("device lost")

    outcome = Remediator(sources=[Broken()]).apply(_cmd("fallback"), step=0)  # type: ignore[list-item]
    assert outcome.status == "failed" and outcome.error == "RuntimeError: device lost"


# -- rollback ---------------------------------------------------------------------------------------


def _monitor_run(tmp_path: Path, remediator_kw: dict[str, Any] | None = None,
                 ) -> tuple[Run, Monitor, Remediator, Path]:
    r = _run(tmp_path, every=5)
    events = tmp_path / "telemetry.jsonl"
    remediator = Remediator(checkpoints=r.ckpts, **(remediator_kw or {}))
    monitor = Monitor(MonitorConfig(run_id="rollback", command_check_interval_steps=5, flush_interval_steps=100),
                      transport=JsonlFileTransport(events)).attach(r.model, r.opt, handler=remediator)
    return r, monitor, remediator, events


def _loop(r: Run, monitor: Monitor, remediator: Remediator, steps: Iterator[int] | range, *,
          inject: dict[int, list[dict[str, Any]]] | None = None,
          on_resume: Any = None) -> list[tuple[int, float]]:
    """The documented loop; returns (step, loss) of every step that completed."""
    done: list[tuple[int, float]] = []
    step, end = steps.start, steps.stop  # type: ignore[union-attr]
    while step < end:
        x, y = r.data.next()
        _, loss = r.model(x, y)
        assert loss is not None
        loss.backward()
        r.fp8.update()
        if inject and step in inject:
            monitor.receive_commands(inject[step])
        monitor.step(loss, step=step)  # also ends a lowered-LR window (the handler's on_step)
        if monitor.next_step != step + 1:  # rolled back: this iteration belongs to the abandoned stretch
            resume = monitor.next_step
            if on_resume is not None:
                on_resume(step, resume)
            step = resume
            continue
        r.opt.step()
        r.sched.step()
        r.opt.zero_grad()
        r.ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()})
        done.append((step, float(loss.detach())))
        step += 1
    return done


def _events(path: Path) -> list[dict[str, Any]]:
    return [e for line in path.read_text().splitlines() for e in json.loads(line)["events"]]


def test_rollback_through_the_monitor_restores_the_checkpoint_bit_exactly(tmp_path: Path) -> None:
    r, monitor, remediator, events_path = _monitor_run(tmp_path)
    saved: dict[int, dict[str, torch.Tensor]] = {}
    orig_save = r.ckpts.save

    def save(step: int, **kw: Any) -> Path:
        saved[step] = _snapshot(r.model)
        return orig_save(step, **kw)

    r.ckpts.save = save  # type: ignore[method-assign]
    at_resume: dict[str, Any] = {}

    def on_resume(step: int, resume: int) -> None:
        at_resume.update(step=step, resume=resume, params=_snapshot(r.model), segment=monitor.segment,
                         next_step=monitor.state_dict()["next_step"], position=r.data.position,
                         steps=r.ckpts.steps())

    rollback = {"id": 7, "kind": "rollback", "checkpoint_step": 4, "skip_batches": 3, "reason": "loss spike"}
    first = _loop(r, monitor, remediator, range(0, 17), inject={12: [rollback]}, on_resume=on_resume)

    # one process needs no broadcast: applied at the first step boundary after it arrived
    assert at_resume["step"] == 12 and at_resume["resume"] == 5
    _assert_same_state(at_resume["params"], saved[4])
    assert at_resume["segment"] == 1 and at_resume["next_step"] == 5
    assert at_resume["position"] == 5 + 3  # batches 5, 6, 7 skipped
    assert at_resume["steps"] == [4]  # the abandoned timeline's checkpoint of step 9 is gone
    assert [s for s, _ in first] == [*range(0, 12), *range(5, 17)]
    # the same id delivered again (a retried ingest answer) and a duplicate in one delivery: once
    again = _loop(r, monitor, remediator, range(17, 25), inject={17: [rollback, rollback]}, on_resume=on_resume)
    assert [s for s, _ in again] == list(range(17, 25)) and at_resume["step"] == 12
    monitor.close()
    events = _events(events_path)
    acks = [e for e in events if e["kind"] == "command_acknowledged"]
    assert len(acks) == 1 and acks[0]["step"] == 12
    assert acks[0]["data"]["status"] == "applied" and acks[0]["data"]["command_id"] == 7
    assert acks[0]["data"]["resume_step"] == 5 and acks[0]["data"]["data_position"] == 8
    assert acks[0]["data"]["discarded_checkpoints"] == [9]
    assert [e["step"] for e in events if e["kind"] == "rollback_applied"] == [12]


def test_replay_after_rollback_without_skipping_is_bit_identical(tmp_path: Path) -> None:
    r, monitor, remediator, _ = _monitor_run(tmp_path)
    rollback = {"id": 1, "kind": "rollback", "checkpoint_step": 4}
    done = _loop(r, monitor, remediator, range(0, 12), inject={7: [rollback]})
    losses: dict[int, list[float]] = {}
    for s, loss in done:
        losses.setdefault(s, []).append(loss)
    assert [s for s, _ in done] == [*range(0, 7), *range(5, 12)]
    for s in range(5, 7):  # same weights, optimizer, scheduler, FP8 state and batches: same loss
        assert losses[s][0] == losses[s][1], s
    monitor.close()


def test_rollback_scales_the_learning_rate_for_n_steps(tmp_path: Path) -> None:
    r, monitor, remediator, _ = _monitor_run(tmp_path)
    seen: list[float] = []  # the lr each optimizer step used
    r.opt.register_step_pre_hook(lambda opt, args, kwargs: seen.append(opt.param_groups[0]["lr"]))
    rollback = {"id": 1, "kind": "rollback", "checkpoint_step": 4, "lr_scale": 0.25, "lr_scale_steps": 3}
    done = _loop(r, monitor, remediator, range(0, 12), inject={9: [rollback]})
    steps = [s for s, _ in done]
    assert steps == [*range(0, 9), *range(5, 12)]
    base = {s: 3e-3 / (1 + 0.1 * s) for s in range(12)}  # LambdaLR's value at each step
    for i, s in enumerate(steps):
        lr = seen[i]
        scaled = 5 <= s < 8 and i >= 9  # the three steps after resuming
        assert lr == pytest.approx(base[s] * (0.25 if scaled else 1.0), rel=1e-12), (s, i)
    assert remediator.lr_scaled_until is None
    monitor.close()


def test_rollback_with_a_schedule_hook_leaves_the_optimizer_alone(tmp_path: Path) -> None:
    calls: list[tuple[float, int]] = []
    r, monitor, remediator, _ = _monitor_run(tmp_path, {"lr_schedule_hook": lambda s, n: calls.append((s, n))})
    _loop(r, monitor, remediator, range(0, 10))
    lr = r.opt.param_groups[0]["lr"]
    outcome = remediator.apply(_cmd("rollback", checkpoint_step=9, lr_scale=0.5, lr_scale_steps=20), step=9)
    assert outcome.status == "applied" and outcome.details["lr_scaled_by"] == "hook"
    assert calls == [(0.5, 20)] and r.opt.param_groups[0]["lr"] == lr
    monitor.close()


def test_rollback_failures_change_nothing(tmp_path: Path) -> None:
    r = _run(tmp_path)
    _train_step(r)
    r.ckpts.save(4)
    _train_step(r)
    before, position = _snapshot(r.model), r.data.position
    remediator = Remediator(checkpoints=r.ckpts)
    missing = remediator.apply(_cmd("rollback", checkpoint_step=3), step=9)
    assert missing.status == "failed" and missing.error is not None
    assert "no checkpoint of step 3" in missing.error and "steps: [4]" in missing.error
    ahead = remediator.apply(_cmd("rollback", cid=2, checkpoint_step=4), step=2)
    assert ahead.status == "failed" and "after the current step" in str(ahead.error)
    no_ckpts = Remediator().apply(_cmd("rollback", cid=3, checkpoint_step=4), step=9)
    assert no_ckpts.status == "failed" and "checkpoints=CheckpointManager" in str(no_ckpts.error)
    no_data = CheckpointManager(tmp_path / "ckpt", model=r.model, optimizer=r.opt, rank=0)
    skip = Remediator(checkpoints=no_data).apply(_cmd("rollback", cid=4, checkpoint_step=4, skip_batches=5), step=9)
    assert skip.status == "failed" and "cannot skip 5 batches" in str(skip.error)
    _assert_same_state(_snapshot(r.model), before)
    assert r.data.position == position
    x, y = r.data.batch(0)
    r.model(x, y)[1].backward()  # type: ignore[union-attr]  # gradients of the abandoned step
    ok = remediator.apply(_cmd("rollback", cid=5, checkpoint_step=4, skip_batches=2), step=9)
    assert ok.status == "applied" and ok.resume_step == 5
    assert r.data.position == 1 + 2 and all(p.grad is None for p in r.model.parameters())
