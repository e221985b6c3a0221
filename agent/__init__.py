"""fp8guard.agent: the in-process half of fp8guard.

A training loop that the service can heal (checkpoints, BF16 fallback, rollback with batch
skipping and a lowered learning rate)::

    from fp8guard.agent import HealConfig, Monitor, MonitorConfig
    monitor = Monitor(MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt-fp8")).attach(
        model, optimizer, scheduler=scheduler, heal=HealConfig("ckpt/", every_n_steps=100))
    for x, y in monitor.batches(data):
        loss = loss_fn(model(x), y); loss.backward()
        monitor.step(loss)    # after backward, before optimizer.step; no host sync
        optimizer.step(); scheduler.step(); optimizer.zero_grad()
    monitor.close()

Imports only torch and httpx: never the service, fastapi, sqlalchemy or pydantic.
"""

from __future__ import annotations

from typing import Any

from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.emulation import EmulationConfig, Fp8Emulation, emulate_fp8
from fp8guard.agent.errors import (
    AgentError,
    CheckpointError,
    ConfigError,
    IntegrationUnavailable,
    SourceUnavailable,
)
from fp8guard.agent.healing import HealConfig
from fp8guard.agent.monitor import Monitor
from fp8guard.agent.sources.base import Source, TensorSpec
from fp8guard.agent.transport import HttpTransport, JsonlFileTransport, NullTransport, RunInfo, Transport

__all__ = [
    "AgentError",
    "CheckpointError",
    "ConfigError",
    "EmulationConfig",
    "Fp8Emulation",
    "HealConfig",
    "HttpTransport",
    "IntegrationUnavailable",
    "JsonlFileTransport",
    "Monitor",
    "MonitorConfig",
    "NullTransport",
    "RunInfo",
    "Source",
    "SourceUnavailable",
    "TensorSpec",
    "Transport",
    "emulate_fp8",
    "watch",
]


def watch(model: object, optimizer: object = None, *, heal: HealConfig | None = None, **config: Any) -> Monitor:
    """Context-manager form: ``with watch(model, opt, url=..., run_id=...) as monitor: ...``;
    ``config`` are :class:`MonitorConfig` fields. Raises ConfigError for anything else."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise ConfigError(f"watch() needs the torch.nn.Module to monitor, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"watch()'s optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
    try:
        cfg = MonitorConfig(**config)
    except TypeError as exc:  # an unknown keyword: name the fields there are
        raise ConfigError(f"watch(): {exc}; MonitorConfig fields are {sorted(MonitorConfig.__dataclass_fields__)}") \
            from None
    return Monitor(cfg).attach(model, optimizer, heal=heal)
