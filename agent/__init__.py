"""fp8guard.agent: the in-process half of fp8guard.

Imports only torch (and httpx for transport); never the service, fastapi, sqlalchemy or pydantic.
"""

from __future__ import annotations

__all__: list[str] = []
