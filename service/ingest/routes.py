"""The agent's write endpoints: ``PUT /v1/runs/{run_id}`` (register or resume) and
``POST /v1/ingest`` (one batch of telemetry, idempotent by ``batch_id``)."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fp8guard.service.deps import CommitterDep, SettingsDep, StoreDep
from fp8guard.service.domain import Batch, RunSpec
from fp8guard.service.ingest.body import read_body
from fp8guard.service.ingest.decode import decode_batch
from fp8guard.service.queries.runs import RunId, run_out
from fp8guard.service.schemas import CommandOut, IngestBatchIn, IngestResultOut, RunIn, RunOut

__all__ = ["router"]

router = APIRouter(tags=["ingest"])

_INLINE_PARSE_BYTES = 1 << 20
"""Bodies up to this size are parsed on the event loop (well under a millisecond); larger ones in
a worker thread, so one big batch never stalls the other requests."""

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


@router.put("/v1/runs/{run_id}", response_model=RunOut, summary="Register a run, or resume it", tags=["runs"],
            responses={201: {"model": RunOut, "description": "Created"}, 200: {"description": "Resumed"}})
def register_run(run_id: RunId, body: RunIn, store: StoreDep, response: Response) -> RunOut:
    """Idempotent: every rank may call it; the first creates the run, later calls resume it."""
    run, created = store.register_run(RunSpec(run_id=run_id, model=body.model, recipe=body.recipe,
                                              world_size=body.world_size, config=body.config, guard=body.guard))
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return run_out(run)


def _parse(body: bytes) -> Batch:
    try:
        parsed = IngestBatchIn.model_validate_json(body)
    except ValidationError as exc:
        # No "input" echo: it can be megabytes of base64, or bytes that are not even UTF-8.
        errors = [{"loc": ("body", *e["loc"]), "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors(include_url=False, include_context=False, include_input=False)]
        raise RequestValidationError(errors) from None
    return decode_batch(parsed)


@router.post("/v1/ingest", response_model=IngestResultOut, openapi_extra=_BODY_DOC,
             summary="Store one batch of telemetry (idempotent by batch_id)")
async def ingest(request: Request, committer: CommitterDep, settings: SettingsDep) -> IngestResultOut:
    """A batch is stored completely or not at all, and answered once it is durable. Re-sending a
    stored ``batch_id`` changes nothing and answers ``duplicate: true``, so clients retry freely.
    The answer carries the run's pending commands; the loop judges the batch right after, and a
    command it issues reaches ``GET /v1/runs/{run_id}/commands?wait=S`` at once."""
    body = await read_body(request, settings)
    batch = _parse(body) if len(body) <= _INLINE_PARSE_BYTES else await run_in_threadpool(_parse, body)
    result = await committer.submit(batch)
    request.app.state.metrics.observe(result, len(body))
    return IngestResultOut(batch_id=result.batch_id, duplicate=result.duplicate, steps=result.steps,
                           samples=result.samples, commands=[CommandOut.of(c) for c in result.commands])
