"""Web dashboards: the last stage, server-rendered pages over the query API."""

from fp8guard.service.web.pages import install_page_errors, web_router

__all__ = ["install_page_errors", "web_router"]
