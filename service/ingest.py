"""From HTTP bytes to a domain ``Batch``: bounded body reading, gunzip, float32 decoding."""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
from fastapi import HTTPException, Request

from fp8guard import wire
from fp8guard.service.domain import Batch, EventRecord, StatBlock, StepRow, TensorInfo
from fp8guard.service.errors import BadEncoding, InvalidPayload, PayloadTooLarge, ServiceError
from fp8guard.service.schemas import IngestBatchIn
from fp8guard.service.settings import Settings

__all__ = ["decode_batch", "read_body"]


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


def decode_batch(batch: IngestBatchIn) -> Batch:
    """Validate what pydantic cannot (blob sizes) and decode float32 blocks without copying."""
    blocks: list[StatBlock] = []
    for i, block in enumerate(batch.tensor_stats):
        loc: tuple[Any, ...] = ("body", "tensor_stats", i, "data")
        try:
            raw = wire.decode_f32(block.data)
        except ValueError as exc:
            raise InvalidPayload(str(exc), loc=loc) from None
        shape = (len(block.steps), len(block.stats), block.n_tensors)
        expected = shape[0] * shape[1] * shape[2] * 4
        if len(raw) != expected:
            raise InvalidPayload(
                f"decodes to {len(raw)} bytes, expected {expected} = {shape[0]} steps x {shape[1]} stats x "
                f"{shape[2]} tensors x 4 (float32)", loc=loc)
        values = np.frombuffer(raw, dtype="<f4").reshape(shape)
        steps = np.asarray(block.steps, dtype=np.int64)
        if steps.size > 1 and np.any(steps[1:] <= steps[:-1]):
            order = np.argsort(steps, kind="stable")
            steps, values = steps[order], values[order]
        blocks.append(StatBlock(stats=tuple(block.stats), steps=steps, values=values))
    return Batch(
        run_id=batch.run_id,
        batch_id=batch.batch_id,
        rank=batch.rank,
        segment=batch.segment,
        tensors=[TensorInfo(index=t.index, name=t.name, module=t.module, role=t.role, fp8_format=t.format,
                            first_step=0) for t in batch.tensors],
        steps=[StepRow(step=s.step, time=s.time, loss=s.loss, grad_norm=s.grad_norm, lr=s.lr, tokens=s.tokens)
               for s in batch.steps],
        blocks=blocks,
        events=[EventRecord(kind=str(e.kind), step=e.step, time=e.time, rank=batch.rank, segment=batch.segment,
                            data=e.data) for e in batch.events],
    )
