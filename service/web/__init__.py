"""Web dashboards: the last stage, server-rendered pages over the query API."""

from fp8guard.service.web.pages import web_router

__all__ = ["web_router"]
