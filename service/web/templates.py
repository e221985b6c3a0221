"""The pages' HTML: Jinja2 templates shipped in ``fp8guard.dashboards`` (``web/templates``), one
base layout (``base.html``: head, header, body data attributes) that each page extends.

Autoescaping is on for every template: run ids, tensor and module names are user data. The only
module that imports jinja2 (it comes with the ``service`` extra).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jinja2

__all__ = ["PageTemplates"]


class PageTemplates:
    """Renders a page by name (``runs`` renders ``runs.html``) with the site-wide helpers:
    ``static(name)`` (a versioned ``/static/`` URL) and ``plotly`` (its URL)."""

    def __init__(self, *, static: Callable[[str], str], plotly: str) -> None:
        self._env = jinja2.Environment(
            loader=jinja2.PackageLoader("fp8guard.dashboards", "web/templates"),
            autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True,
            auto_reload=False, keep_trailing_newline=True,
        )
        self._env.globals.update(static=static, plotly=plotly)

    def render(self, page: str, *, title: str, data: Mapping[str, str] | None = None, **context: object) -> str:
        """The page's HTML; ``data`` becomes ``data-*`` attributes of ``<body>`` for its script."""
        return self._env.get_template(f"{page}.html").render(title=title, data=dict(data or {}), **context)
