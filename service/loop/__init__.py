"""The closed loop: detection (pure rules and a checkpointable detector), policy (pure decisions),
and the worker that runs them off the request path, per run in order."""

from fp8guard.service.domain import Decision, Finding
from fp8guard.service.kinds import Severity
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.loop.detector import Detector, TensorMeta
from fp8guard.service.loop.policy import RunView, decide, promotions

__all__ = ["Decision", "Detector", "Finding", "GuardConfig", "RunView", "Severity", "TensorMeta", "decide", "promotions"]
