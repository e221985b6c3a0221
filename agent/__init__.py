"""fp8guard.agent: the in-process half of fp8guard.

Four lines in a training loop::

    from fp8guard.agent import Monitor, MonitorConfig
    monitor = Monitor(MonitorConfig(url="http://127.0.0.1:8000", run_id="gpt-fp8")).attach(model, optimizer)
    monitor.step(loss)        # each step, after backward; no host sync
    monitor.close()

Imports only torch and httpx: never the service, fastapi, sqlalchemy or pydantic.
"""

from __future__ import annotations

from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.emulation import EmulationConfig, Fp8Emulation, emulate_fp8
from fp8guard.agent.errors import AgentError, ConfigError, SourceUnavailable
from fp8guard.agent.monitor import Monitor
from fp8guard.agent.sources.base import Source, TensorSpec
from fp8guard.agent.transport import HttpTransport, JsonlFileTransport, NullTransport, RunInfo, Transport

__all__ = [
    "AgentError",
    "ConfigError",
    "EmulationConfig",
    "Fp8Emulation",
    "HttpTransport",
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


def watch(model: object, optimizer: object = None, **config: object) -> Monitor:
    """Context-manager form: ``with watch(model, opt, url=..., run_id=...) as monitor: ...``."""
    import torch

    assert isinstance(model, torch.nn.Module), "watch() needs the nn.Module to monitor"
    opt = optimizer if isinstance(optimizer, torch.optim.Optimizer) else None
    return Monitor(MonitorConfig(**config)).attach(model, opt)  # type: ignore[arg-type]
