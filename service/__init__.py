"""fp8guard.service: stores FP8 training telemetry and answers queries (never imports torch)."""

from fp8guard.service.app import create_app
from fp8guard.service.settings import Settings

__all__ = ["Settings", "create_app"]
