"""Reading a request body: size-limited as sent and once gunzipped (a guard against bombs)."""

from __future__ import annotations

import zlib

from fastapi import HTTPException, Request

from fp8guard.service.errors import BadEncoding, PayloadTooLarge, ServiceError
from fp8guard.service.settings import Settings

__all__ = ["read_body"]


async def read_body(request: Request, settings: Settings) -> bytes:
    """The request body, size-limited and gunzipped. Errors become HTTPException because
    FastAPI turns anything else raised while reading a body into a bare 400."""
    try:
        return await _read_body(request, settings)
    except ServiceError as exc:
        raise HTTPException(exc.status_code, detail=exc.to_detail()) from exc


async def _read_body(request: Request, settings: Settings) -> bytes:
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"body of {declared} bytes exceeds the limit of {limit}", loc=("header", "content-length"))
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"body exceeds the limit of {limit} bytes", loc=("body",))
        chunks.append(chunk)
    body = b"".join(chunks)
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding == "gzip":
        return _gunzip(body, settings.max_decompressed_bytes)
    if encoding not in ("", "identity"):
        raise BadEncoding(f"Content-Encoding {encoding!r} is not supported; send gzip or identity",
                          loc=("header", "content-encoding"))
    return body


def _gunzip(body: bytes, limit: int) -> bytes:
    inflater = zlib.decompressobj(wbits=31)  # 31: gzip container only
    try:
        out = inflater.decompress(body, limit + 1)
    except zlib.error as exc:
        raise BadEncoding(f"body is not valid gzip: {exc}", loc=("body",)) from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise PayloadTooLarge(f"body exceeds {limit} bytes once decompressed", loc=("body",))
    if not inflater.eof:
        raise BadEncoding("gzip body is truncated", loc=("body",))
    return out
