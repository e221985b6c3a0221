"""The public API is what ``__all__`` says, and nothing drifts silently (after httpx's test)."""

from __future__ import annotations

import importlib

import pytest

PUBLIC = {
    "fp8guard": ["__version__"],
    "fp8guard.service": ["Settings", "create_app"],
    "fp8guard.wire": [
        "BATCH_ID_PATTERN", "MAX_BATCH_STEPS", "MAX_TENSORS", "NONFINITE_STRINGS", "PROTOCOL_VERSION",
        "RUN_ID_PATTERN", "STEP_FIELDS", "AckStatus", "Command", "CommandAck", "CommandKind", "EventKind", "decode_f32", "decode_float", "dumps", "encode_f32",
        "encode_float", "gzip_body", "make_batch", "new_batch_id", "tensor_stats_block",
    ],
    "fp8guard.service.auth": [
        "AUTH_RESPONSES", "OPENAPI_SECURITY", "SESSION_COOKIE", "AdminAccess", "Authenticator", "FollowAccess",
        "IngestAccess", "Principal", "ReadAccess", "authorize", "require",
    ],
    "fp8guard.service.store": ["Store", "Window", "make_engine", "upgrade", "verify_schema"],
    "fp8guard.agent": [
        "AgentError", "CheckpointError", "ConfigError", "EmulationConfig", "Fp8Emulation", "HealConfig",
        "HttpTransport", "IntegrationUnavailable", "JsonlFileTransport", "Monitor", "MonitorConfig", "NullTransport", "RunInfo", "Source", "SourceUnavailable", "TensorSpec",
        "Transport", "emulate_fp8", "watch",
    ],
    "fp8guard.agent.kernels": ["HistoryGather", "TableSumOfSquares", "count_cast_into", "triton_available"],
    "fp8guard.agent.kernels.count_batch": ["BATCH_SLOTS", "OPERANDS_PER_LAUNCH", "CountBatch"],
    "fp8guard.agent.sources.te_counts": ["InspectCounts"],
    "fp8guard.agent.sources.te_inspect": ["FEATURE_NAME", "TENSOR_NAMES", "register_feature"],
    "fp8guard.service.loop": [
        "Decision", "Detector", "Finding", "GuardConfig", "RunView", "Severity", "TensorMeta", "decide", "promotions",
    ],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_exports_are_pinned(module: str) -> None:
    mod = importlib.import_module(module)
    assert sorted(mod.__all__) == sorted(PUBLIC[module])
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is exported but missing"
