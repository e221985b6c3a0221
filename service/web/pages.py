"""Web dashboards: server-rendered HTML shells (Jinja2 templates on one base layout, see
:mod:`fp8guard.service.web.templates`) plus small vanilla JS that fetch the JSON query
API (``/v1/runs/...``) and draw it with plotly. No build step; plotly.js is vendored as a pinned file
(``dashboards/web/static/vendor/plotly-<version>.min.js``, with its licence) and served offline at
``/static/plotly.min.js``.

Pages: ``/`` (runs), ``/runs/{run_id}`` (one run), ``/compare?run=A&baseline=B``, ``/docs`` (the
API, with ``/openapi.json``), ``/login``. Run names,
tensor and module names are user data: the shells only place them in escaped attributes, and
the scripts build the DOM with ``textContent``. An unknown run (or run id) under the pages
answers an HTML 404 page; :func:`install_page_errors` does the same for any unknown path a
browser asks for outside the JSON API (which keeps its JSON errors).

Every page needs a ``read`` principal (``service/auth``): a browser without one is sent to
``/login``, which trades a token for an HttpOnly, SameSite=Strict session cookie that the
pages' own fetches then carry. Static files are public (they are the service's code, not data).

Wiring: ``app.include_router(web_router())`` after ``create_app``.
"""

from __future__ import annotations

import gzip
import hashlib
import re
import threading
from datetime import UTC, datetime, timedelta
from importlib import resources
from typing import Annotated
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.exception_handlers import http_exception_handler
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from fp8guard import wire
from fp8guard.service.auth import SESSION_COOKIE, Authenticator, Principal, require
from fp8guard.service.auth import tokens as auth_tokens
from fp8guard.service.errors import NotFound
from fp8guard.service.kinds import Role
from fp8guard.service.web.templates import PageTemplates

__all__ = ["install_page_errors", "web_router"]

_STATIC_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.(js|css)$")
_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
_LONG_CACHE = "public, max-age=31536000, immutable"
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PLOTLY_FILE = "plotly.min.js"
_VENDORED_PLOTLY = re.compile(r"^plotly-(\d+\.\d+\.\d+)\.min\.js$")
_HEADERS = {"Content-Security-Policy": _CSP, "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}
_API_PREFIXES = ("/v1/", "/static/", "/metrics", "/healthz", "/openapi.json")


class _Asset:
    """One static file, kept in memory with its gzip form (made on first use) and a version tag."""

    def __init__(self, body: bytes, media_type: str) -> None:
        self.body = body
        self.media_type = media_type
        self.etag = hashlib.sha256(body).hexdigest()[:16]
        self._gz: bytes | None = None
        self._lock = threading.Lock()

    def gzipped(self) -> bytes:
        with self._lock:
            if self._gz is None:
                self._gz = gzip.compress(self.body, compresslevel=6, mtime=0)
            return self._gz


class _Assets:
    def __init__(self) -> None:
        root = resources.files("fp8guard.dashboards").joinpath("web")
        self.files: dict[str, _Asset] = {}
        for item in root.joinpath("static").iterdir():
            match = _STATIC_NAME.match(item.name)
            if match:
                self.files[item.name] = _Asset(item.read_bytes(), _TYPES[match.group(1)])
        vendored = [(m.group(1), item) for item in root.joinpath("static", "vendor").iterdir()
                    if (m := _VENDORED_PLOTLY.match(item.name))]
        if len(vendored) != 1:
            raise RuntimeError(f"expected one vendored plotly-<version>.min.js, found {[v for v, _ in vendored]}")
        self.plotly_version, self._plotly_file = vendored[0]
        self._plotly: _Asset | None = None
        self._lock = threading.Lock()
        self.pages = PageTemplates(static=self.url, plotly=f"/static/{PLOTLY_FILE}?v={self.plotly_version}")

    def get(self, name: str) -> _Asset | None:
        if name == PLOTLY_FILE:
            with self._lock:  # 4.8 MB: read on first use
                if self._plotly is None:
                    self._plotly = _Asset(self._plotly_file.read_bytes(), _TYPES["js"])
                return self._plotly
        return self.files.get(name)

    def url(self, name: str) -> str:
        """``/static/NAME?v=HASH``: the hash changes with the content, so caching forever is safe."""
        asset = self.files[name]
        return f"/static/{name}?v={asset.etag}"


def _page(assets: _Assets, template: str, *, title: str, data: dict[str, str]) -> HTMLResponse:
    body = assets.pages.render(template, title=title, data=data)
    return HTMLResponse(body, headers={**_HEADERS, "Cache-Control": "no-cache"})


def _not_found_page(assets: _Assets, message: str) -> HTMLResponse:
    body = assets.pages.render("notfound", title="fp8guard: not found", message=message)
    return HTMLResponse(body, status_code=404, headers={**_HEADERS, "Cache-Control": "no-store"})


def _login_page(assets: _Assets, *, next_url: str, error: str = "", status_code: int = 200) -> HTMLResponse:
    body = assets.pages.render("login", title="fp8guard: sign in", next=next_url, error=error)
    return HTMLResponse(body, status_code=status_code, headers={**_HEADERS, "Cache-Control": "no-store"})


def _local(next_url: str | None) -> str:
    """Only a path of this site may follow a login (never ``//host`` or ``https://...``)."""
    if not next_url or not next_url.startswith("/") or next_url.startswith("//") or "\\" in next_url:
        return "/"
    return next_url


def _auth(request: Request) -> Authenticator:
    auth: Authenticator = request.app.state.auth
    return auth


def _reader(request: Request) -> Principal:
    """A page's reader; anonymous browsers go to the login page, and come back after it."""
    principal = _auth(request).principal(request)
    if principal is None:
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        raise HTTPException(status_code=303, headers={"Location": f"/login?next={quote(target, safe='')}"})
    if not principal.has(Role.READ):
        raise HTTPException(status_code=403, detail=f"token {principal.name!r} cannot read dashboards")
    return principal


_MAX_LOGIN_BODY = 4096


_RUN_ID = re.compile(wire.RUN_ID_PATTERN)
PageRunQuery = Annotated[str | None, Query(max_length=1024)]
"""Validated by the page itself, so that a bad one gets the HTML 404 page rather than a JSON 422."""


def web_router(*, poll_seconds: float = 5.0) -> APIRouter:
    """The dashboard pages and their static files. ``poll_seconds``: how often pages refresh."""
    assets = _Assets()
    poll = str(max(0.5, float(poll_seconds)))
    router = APIRouter(tags=["dashboards"], include_in_schema=False)
    pages = APIRouter(dependencies=[Depends(_reader)])

    @router.get("/login", response_class=HTMLResponse)
    def login_page(next: str | None = None) -> HTMLResponse:
        return _login_page(assets, next_url=_local(next))

    @router.post("/login", response_class=HTMLResponse)
    async def login(request: Request) -> Response:
        """Trade a token (form field ``token``) for a session cookie; refuse ingest-only tokens."""
        body = await request.body()
        form = parse_qs(body[:_MAX_LOGIN_BODY].decode("utf-8", "replace"))
        next_url = _local((form.get("next") or ["/"])[0])
        token = (form.get("token") or [""])[0].strip()
        auth = _auth(request)
        if not auth.enabled:
            return RedirectResponse(next_url, status_code=303)
        record = auth.token(token) if token else None
        if record is None:
            return _login_page(assets, next_url=next_url, error="Unknown or revoked token.", status_code=401)
        if not Principal.of(record).has(Role.READ):
            return _login_page(assets, next_url=next_url, status_code=403,
                               error=f"Token {record.name!r} has role {record.role}: it cannot read dashboards.")
        secret = auth_tokens.new_secret()
        expires = datetime.now(UTC) + timedelta(seconds=auth.session_max_age_s)
        auth.store.open_session(auth_tokens.digest(secret), record.id, expires)
        response = RedirectResponse(next_url, status_code=303)
        response.set_cookie(SESSION_COOKIE, secret, max_age=auth.session_max_age_s, path="/", httponly=True,
                            samesite="strict", secure=auth.secure_cookies or request.url.scheme == "https")
        return response

    @router.post("/logout")
    def logout(request: Request) -> Response:
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie:
            _auth(request).store.close_session(auth_tokens.digest(cookie))
            _auth(request).forget()
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
        return response

    @pages.get("/", response_class=HTMLResponse)
    def runs_page() -> HTMLResponse:
        return _page(assets, "runs", title="fp8guard: runs", data={"poll": poll})

    def unknown_run(request: Request, *run_ids: str | None) -> HTMLResponse | None:
        """The HTML 404 page for the first given run id that is malformed or names no run."""
        for run_id in run_ids:
            if run_id is None:
                continue
            if not _RUN_ID.match(run_id):
                return _not_found_page(assets, f"{run_id!r} is not a run id.")
            try:
                request.app.state.store.run(run_id)
            except NotFound:
                return _not_found_page(assets, f"No run {run_id!r} here.")
        return None

    @pages.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(run_id: Annotated[str, PathParam(max_length=1024)], request: Request) -> HTMLResponse:
        return unknown_run(request, run_id) or _page(
            assets, "run", title=f"fp8guard: {run_id}", data={"poll": poll, "run-id": run_id})

    @pages.get("/compare", response_class=HTMLResponse)
    def compare_page(request: Request, run: PageRunQuery = None, baseline: PageRunQuery = None) -> HTMLResponse:
        return unknown_run(request, run or None, baseline or None) or _page(
            assets, "compare", title="fp8guard: compare",
            data={"poll": poll, "run": run or "", "baseline": baseline or ""})

    @router.get("/static/{name}")
    def static(name: str, request: Request) -> Response:
        asset = assets.get(name)
        if asset is None:
            raise HTTPException(status_code=404, detail="no such file")
        headers = {"Cache-Control": _LONG_CACHE, "ETag": f'"{asset.etag}"', "Vary": "Accept-Encoding",
                   "X-Content-Type-Options": "nosniff"}
        if request.headers.get("if-none-match") == f'"{asset.etag}"':
            return Response(status_code=304, headers=headers)
        if "gzip" in request.headers.get("accept-encoding", "").lower():
            headers["Content-Encoding"] = "gzip"
            return Response(asset.gzipped(), media_type=asset.media_type, headers=headers)
        return Response(asset.body, media_type=asset.media_type, headers=headers)

    @pages.get("/docs", response_class=HTMLResponse)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="fp8guard API")

    @router.get("/openapi.json", dependencies=[Depends(require(Role.READ))])
    def openapi_json(request: Request) -> JSONResponse:
        return JSONResponse(request.app.openapi())

    router.include_router(pages)
    return router


def install_page_errors(app: FastAPI) -> None:
    """An HTML 404 page for a browser (``Accept: text/html``) that GETs an unknown path outside
    the JSON API; API paths, and clients that do not ask for HTML, keep the JSON error."""
    assets = _Assets()

    async def not_found(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        path = request.url.path
        if (exc.status_code == 404 and request.method in ("GET", "HEAD") and not path.startswith(_API_PREFIXES)
                and "text/html" in request.headers.get("accept", "")):
            return _not_found_page(assets, f"Nothing at {path[:200]!r}.")
        return await http_exception_handler(request, exc)

    app.add_exception_handler(StarletteHTTPException, not_found)
