"""Web dashboards: server-rendered HTML shells plus small vanilla JS that fetch the JSON query
API (``/v1/runs/...``) and draw it with plotly. No build step; plotly is served offline from the
installed ``plotly`` package at ``/static/plotly.min.js``.

Pages: ``/`` (runs), ``/runs/{run_id}`` (one run), ``/compare?run=A&baseline=B``, ``/docs`` (the
API, with ``/openapi.json``), ``/login``. Run names,
tensor and module names are user data: the shells only place them in escaped attributes, and
the scripts build the DOM with ``textContent``.

Every page needs a ``read`` principal (``service/auth``): a browser without one is sent to
``/login``, which trades a token for an HttpOnly, SameSite=Strict session cookie that the
pages' own fetches then carry. Static files are public (they are the service's code, not data).

Wiring: ``app.include_router(web_router())`` after ``create_app``.
"""

from __future__ import annotations

import gzip
import hashlib
import html
import re
import threading
from datetime import UTC, datetime, timedelta
from importlib import resources
from string import Template
from typing import Annotated
from urllib.parse import parse_qs, quote

from fastapi import APIRouter, Depends, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse

from fp8guard import wire
from fp8guard.service.auth import SESSION_COOKIE, Authenticator, Principal, require
from fp8guard.service.auth import tokens as auth_tokens
from fp8guard.service.kinds import Role

__all__ = ["web_router"]

_STATIC_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}\.(js|css)$")
_TYPES = {"js": "text/javascript; charset=utf-8", "css": "text/css; charset=utf-8"}
_LONG_CACHE = "public, max-age=31536000, immutable"
_CSP = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'")
PLOTLY_FILE = "plotly.min.js"


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
        self.templates: dict[str, Template] = {}
        for item in root.joinpath("templates").iterdir():
            if item.name.endswith(".html"):
                self.templates[item.name[:-5]] = Template(item.read_text(encoding="utf-8"))
        self.files: dict[str, _Asset] = {}
        for item in root.joinpath("static").iterdir():
            match = _STATIC_NAME.match(item.name)
            if match:
                self.files[item.name] = _Asset(item.read_bytes(), _TYPES[match.group(1)])
        self._plotly: _Asset | None = None
        self._lock = threading.Lock()

    def get(self, name: str) -> _Asset | None:
        if name == PLOTLY_FILE:
            with self._lock:
                if self._plotly is None:
                    data = resources.files("plotly").joinpath("package_data", PLOTLY_FILE).read_bytes()
                    self._plotly = _Asset(data, _TYPES["js"])
                return self._plotly
        return self.files.get(name)

    def url(self, name: str) -> str:
        """``/static/NAME?v=HASH``: the hash changes with the content, so caching forever is safe."""
        asset = self.files[name]
        return f"/static/{name}?v={asset.etag}"


def _page(assets: _Assets, template: str, *, title: str, script: str, data: dict[str, str]) -> HTMLResponse:
    attrs = " ".join(f'data-{k}="{html.escape(v, quote=True)}"' for k, v in sorted(data.items()))
    body = assets.templates[template].substitute(
        title=html.escape(title), css=assets.url("style.css"), common=assets.url("common.js"),
        script=assets.url(script), plotly=f"/static/{PLOTLY_FILE}", data=attrs,
    )
    return HTMLResponse(body, headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-cache",
                                       "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"})


def _login_page(assets: _Assets, *, next_url: str, error: str = "", status_code: int = 200) -> HTMLResponse:
    body = assets.templates["login"].substitute(
        title="fp8guard: sign in", css=assets.url("style.css"), next=html.escape(next_url, quote=True),
        error=html.escape(error), error_hidden="" if error else "hidden",
    )
    return HTMLResponse(body, status_code=status_code,
                        headers={"Content-Security-Policy": _CSP, "Cache-Control": "no-store",
                                 "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"})


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


RunIdPath = Annotated[str, PathParam(pattern=wire.RUN_ID_PATTERN, max_length=128)]
RunIdQuery = Annotated[str | None, Query(pattern=wire.RUN_ID_PATTERN, max_length=128)]


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
        return _page(assets, "runs", title="fp8guard: runs", script="runs.js", data={"poll": poll})

    @pages.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(run_id: RunIdPath, request: Request) -> HTMLResponse:
        request.app.state.store.run(run_id)  # 404 (the API's error shape) for an unknown run
        return _page(assets, "run", title=f"fp8guard: {run_id}", script="run.js",
                     data={"poll": poll, "run-id": run_id})

    @pages.get("/compare", response_class=HTMLResponse)
    def compare_page(run: RunIdQuery = None, baseline: RunIdQuery = None) -> HTMLResponse:
        return _page(assets, "compare", title="fp8guard: compare", script="compare.js",
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
