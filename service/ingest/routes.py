"""The write endpoints: ``PUT /v1/runs/{run_id}`` (register or resume), ``POST /v1/ingest`` (one
batch of telemetry, idempotent by ``batch_id``), and ``PUT /v1/runs/{run_id}/guard`` (an admin's
change of a run's detection and policy, audited).

An ingest token writes only the runs it registered or those under its run-id prefix; a run's
guard is set by whoever creates the run, and changed later only by an admin."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response, status
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError
from starlette.concurrency import run_in_threadpool

from fp8guard.service.auth import AUTH_RESPONSES, OPENAPI_SECURITY, AdminAccess, IngestAccess, authorize
from fp8guard.service.auth.access import authenticator, cached_or_loaded
from fp8guard.service.deps import StoreDep
from fp8guard.service.domain import Batch, RunSpec
from fp8guard.service.errors import Forbidden
from fp8guard.service.ingest.body import read_body
from fp8guard.service.ingest.committer import Committer
from fp8guard.service.ingest.decode import EventLimits, decode_batch
from fp8guard.service.kinds import Role
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.queries.runs import RunId, run_out
from fp8guard.service.schemas import CommandOut, IngestBatchIn, IngestResultOut, RunIn, RunOut
from fp8guard.service.settings import Settings

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
        "401": {"description": "No valid token"},
        "403": {"description": "The token may not write this run"},
        "413": {"description": "Body too large (as sent or once decompressed)"},
        "400": {"description": "Undecodable body (bad gzip, unsupported Content-Encoding)"},
        "404": {"description": "Run not registered"},
        "409": {"description": "Tensor table conflict"},
        "422": {"description": "A batch that parses but is invalid; `loc` names the field"},
        "503": {"description": "Database unavailable; retry with the same batch_id"},
    },
}


@router.put("/v1/runs/{run_id}", response_model=RunOut, summary="Register a run, or resume it", tags=["runs"],
            responses={201: {"model": RunOut, "description": "Created"}, 200: {"description": "Resumed"},
                       **AUTH_RESPONSES})
def register_run(run_id: RunId, body: RunIn, store: StoreDep, response: Response, request: Request,
                 principal: IngestAccess) -> RunOut:
    """Idempotent: every rank may call it; the first creates the run, later calls resume it. A
    resume that would change the run's guard needs an admin token (``PUT .../guard`` too)."""
    authenticator(request).check_run(principal, run_id)
    if body.guard is not None and not principal.has(Role.ADMIN):
        exists, _ = store.run_owner(run_id)
        if exists and store.run(run_id).guard != body.guard:
            raise Forbidden("changing a run's guard needs an admin token (PUT /v1/runs/{run_id}/guard)",
                            loc=("body", "guard"))
    run, created = store.register_run(RunSpec(run_id=run_id, model=body.model, recipe=body.recipe,
                                              world_size=body.world_size, config=body.config, guard=body.guard),
                                      owner_token_id=principal.token_id, actor=principal.name)
    response.status_code = status.HTTP_201_CREATED if created else status.HTTP_200_OK
    return run_out(run)


@router.put("/v1/runs/{run_id}/guard", response_model=GuardConfig, tags=["closed loop"],
            summary="Change a run's detection and policy (admin; audited as a guard_changed event)",
            responses={404: {"description": "Run not registered"}, **AUTH_RESPONSES})
def set_guard(run_id: RunId, body: GuardConfig, store: StoreDep, principal: AdminAccess) -> GuardConfig:
    """Replace the run's overrides with the fields ``body`` sets; the answer is the guard in force
    (every default with the overrides applied), as ``GET .../guard`` reads it."""
    overrides = body.model_dump(mode="json", exclude_unset=True)
    store.set_guard(run_id, overrides, principal.name)
    return GuardConfig.model_validate(overrides)


def _parse(body: bytes, limits: EventLimits) -> Batch:
    try:
        parsed = IngestBatchIn.model_validate_json(body)
    except ValidationError as exc:
        # No "input" echo: it can be megabytes of base64, or bytes that are not even UTF-8.
        errors = [{"loc": ("body", *e["loc"]), "msg": e["msg"], "type": e["type"]}
                  for e in exc.errors(include_url=False, include_context=False, include_input=False)]
        raise RequestValidationError(errors) from None
    return decode_batch(parsed, limits)


@router.post("/v1/ingest", response_model=IngestResultOut, openapi_extra={**_BODY_DOC, "security": OPENAPI_SECURITY},
             summary="Store one batch of telemetry (idempotent by batch_id)")
async def ingest(request: Request) -> Response:
    """A batch is stored completely or not at all, and answered once it is durable. Re-sending a
    stored ``batch_id`` changes nothing and answers ``duplicate: true``, so clients retry freely.
    The answer carries the run's pending commands; the loop judges the batch right after, and a
    command it issues reaches ``GET /v1/runs/{run_id}/commands?wait=S`` at once."""
    # The hottest route takes no FastAPI dependencies: solving them (the token schemes, the
    # settings, the committer) was a quarter of the event loop's time per batch. It makes the
    # check ``IngestAccess`` makes itself, before the body is read. The app calls this function
    # from ``IngestFastPath`` (``ingest/fast_path.py``), past FastAPI's router; the route stays
    # registered for the OpenAPI document and for an app built without that middleware.
    principal = await authorize(request, Role.INGEST)
    committer: Committer = request.app.state.committer
    settings: Settings = request.app.state.settings
    limits = EventLimits(per_event=settings.max_event_data_bytes, per_batch=settings.max_batch_event_bytes)
    async with read_body(request, settings) as body:  # counted against the in-flight budget while parsed
        size = len(body)
        batch = _parse(body, limits) if size <= _INLINE_PARSE_BYTES else await run_in_threadpool(_parse, body, limits)
    auth = authenticator(request)
    if auth.enabled and principal.role is not Role.ADMIN:
        await cached_or_loaded(auth.check_run, principal, batch.run_id)
    result = await committer.submit(batch)
    request.app.state.metrics.observe(result, size)
    answer = IngestResultOut(batch_id=result.batch_id, duplicate=result.duplicate, steps=result.steps,
                             samples=result.samples, commands=[CommandOut.of(c) for c in result.commands])
    # Serialised here, once: returning the model would have FastAPI dump it to a dict, validate
    # that against ``response_model`` again and encode it a second time (the route's
    # ``response_model`` still documents the answer in /openapi.json).
    return Response(content=answer.__pydantic_serializer__.to_json(answer), media_type="application/json")
