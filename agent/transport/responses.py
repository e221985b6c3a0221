"""Reading the service's answers (and failures) into one-line reasons for logs and retries."""

from __future__ import annotations

import math
from collections.abc import Mapping

import httpx

__all__ = ["describe_exception", "error_detail", "retry_after_s"]


def describe_exception(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def retry_after_s(response: httpx.Response) -> float | None:
    """A numeric ``Retry-After`` (seconds); HTTP dates are ignored in favour of our own backoff."""
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def error_detail(response: httpx.Response) -> str:
    """The service's error ``detail`` as one line: ``body.tensor_stats.0.data: msg``."""
    try:
        detail = response.json().get("detail")
    except Exception:
        return response.text[:500]
    if isinstance(detail, list):
        parts = []
        for item in detail:
            if isinstance(item, Mapping):
                loc = ".".join(str(p) for p in item.get("loc") or ())
                parts.append(f"{loc}: {item.get('msg', '')}" if loc else str(item.get("msg", "")))
            else:
                parts.append(str(item))
        return "; ".join(parts)[:1000]
    return str(detail)[:1000]
