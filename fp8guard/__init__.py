"""fp8guard: watch and heal FP8 training runs.

Subpackages:
- ``fp8guard.agent``: in-process telemetry agent (torch + httpx only).
- ``fp8guard.service``: FastAPI service that stores telemetry and answers queries.
- ``fp8guard.wire``: the wire protocol both sides share (standard library only).
"""

from __future__ import annotations

__all__ = ["__version__"]

__version__ = "0.1.0"
