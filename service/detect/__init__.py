"""Detection (pure rules + a checkpointable detector) and policy (pure decisions)."""

from fp8guard.service.detect.config import GuardConfig
from fp8guard.service.detect.detector import Detector, TensorMeta
from fp8guard.service.detect.policy import Decision, RunView, decide, promotions
from fp8guard.service.detect.types import Finding, Severity

__all__ = ["Decision", "Detector", "Finding", "GuardConfig", "RunView", "Severity", "TensorMeta", "decide", "promotions"]
