"""The Remediator's precision switches on the CPU: BF16 fallback of the whole model or of named
modules and re-promotion to FP8 (emulated FP8, the torchao source's switch, real torchao in
emulation), unknown modules, and a failing source.

CheckpointManager is tested in test_checkpoint.py, rollback through the Monitor's command path in
test_rollback.py; their shared run and helpers in remediation_helpers.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch import nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from fp8guard.agent import Monitor, MonitorConfig, NullTransport, emulate_fp8  # noqa: E402
from fp8guard.agent.emulation import Fp8Emulation  # noqa: E402
from fp8guard.agent.remediation import Remediator  # noqa: E402
from fp8guard.nanogpt import GPT, TextBatches  # noqa: E402
from tests.agent.remediation_helpers import TEXT, TINY, _cmd  # noqa: E402

# -- fallback and promotion ------------------------------------------------------------------------


def _models() -> tuple[nn.Module, nn.Module, Fp8Emulation]:
    torch.manual_seed(0)
    plain = GPT(TINY)
    torch.manual_seed(0)
    model = GPT(TINY)
    return plain, model, emulate_fp8(model)


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
