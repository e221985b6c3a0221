"""The pages' Jinja2 templates: one base layout, autoescaped, found as package data."""

from __future__ import annotations

from importlib import resources

import pytest

from fp8guard.service.web.templates import PageTemplates

PAGES = ("runs", "run", "compare", "login", "notfound")
HOSTILE = "<script>x</script>\"'&"


@pytest.fixture
def templates() -> PageTemplates:
    return PageTemplates(static=lambda name: f"/static/{name}?v=1", plotly="/static/plotly.min.js?v=0")


def test_every_page_extends_the_base_layout() -> None:
    folder = resources.files("fp8guard.dashboards").joinpath("web", "templates")
    for page in PAGES:
        source = folder.joinpath(f"{page}.html").read_text(encoding="utf-8")
        assert source.startswith('{% extends "base.html" %}') and "<head>" not in source, page


@pytest.mark.parametrize("page", PAGES)
def test_pages_render_one_layout_and_escape_user_data(templates: PageTemplates, page: str) -> None:
    html = templates.render(page, title=HOSTILE, data={"run-id": HOSTILE}, message=HOSTILE, next=HOSTILE,
                            error=HOSTILE)
    assert html.count("<head>") == 1 and html.count("<header>") == 1 and html.endswith("</html>\n")
    assert '<link rel="stylesheet" href="/static/style.css?v=1">' in html
    assert "<script>x</script>" not in html and "&lt;script&gt;x&lt;/script&gt;&#34;&#39;&amp;" in html


def test_a_missing_variable_fails_instead_of_rendering_empty(templates: PageTemplates) -> None:
    with pytest.raises(Exception, match="message"):
        templates.render("notfound", title="t")
