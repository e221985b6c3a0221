"""POST /v1/ingest: the agent's one write endpoint."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fp8guard.service.deps import SettingsDep, StoreDep
from fp8guard.service.ingest import decode_batch, read_body
from fp8guard.service.schemas import IngestBatchIn, IngestResultOut

__all__ = ["router"]

router = APIRouter(tags=["ingest"])

_BODY_DOC = {
    "requestBody": {
        "required": True,
        "description": "An ingest batch (wire protocol v1). May be sent with `Content-Encoding: gzip`.",
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/IngestBatchIn"}}},
    },
    "responses": {
        "413": {"description": "Body too large (as sent or once decompressed)"},
        "400": {"description": "Undecodable body (bad gzip, unsupported Content-Encoding)"},
        "404": {"description": "Run not registered"},
        "409": {"description": "Tensor table conflict"},
        "503": {"description": "Database unavailable; retry with the same batch_id"},
    },
}


@router.post("/v1/ingest", response_model=IngestResultOut, openapi_extra=_BODY_DOC,
             summary="Store one batch of telemetry (idempotent by batch_id)")
async def ingest(request: Request, store: StoreDep, settings: SettingsDep) -> IngestResultOut:
    """A batch is stored completely or not at all. Re-sending a stored ``batch_id`` changes
    nothing and answers ``duplicate: true``, so clients retry freely."""
    body = await read_body(request, settings)
    try:
        parsed = IngestBatchIn.model_validate_json(body)
    except ValidationError as exc:
        # No "input" echo: it can be megabytes of base64, or bytes that are not even UTF-8.
        errors = [{"loc": ("body", *e["loc"]), "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors(include_url=False, include_context=False, include_input=False)]
        raise RequestValidationError(errors) from None
    batch = decode_batch(parsed)
    # The store is synchronous (SQLAlchemy); keep the event loop free while it works.
    result = await run_in_threadpool(store.ingest, batch)
    request.app.state.metrics.observe(result, len(body))
    return IngestResultOut(batch_id=result.batch_id, duplicate=result.duplicate, steps=result.steps,
                           samples=result.samples, commands=result.commands)
