"""Queries of runs: list, detail, and the downsampled series and events the dashboards draw."""

from __future__ import annotations

import json
from typing import Annotated, Literal

import numpy as np
import pybase64
from fastapi import APIRouter, Path, Query, Response
from pydantic import StringConstraints

from fp8guard import wire
from fp8guard.service.deps import SettingsDep, StoreDep
from fp8guard.service.domain import RunDetail, RunSummary, TensorInfo
from fp8guard.service.schemas import (
    MAX_STEP,
    EventOut,
    RankOut,
    RunDetailOut,
    RunOut,
    ScalarSeriesOut,
    TensorMatrixOut,
    TensorOut,
    TensorSeriesOut,
)
from fp8guard.service.store import Window

__all__ = ["RunId", "router", "run_out"]

router = APIRouter(prefix="/v1/runs", tags=["runs"],
                   responses={404: {"description": "Unknown run, tensor or stat"}})

RunId = Annotated[str, Path(pattern=wire.RUN_ID_PATTERN, description="the run's client-chosen id")]
Rank = Annotated[int | None, Query(ge=0, lt=65536, description="which rank's data (default: the run's lead rank, "
                                                              "its lowest reporting rank: 0 in most runs)")]
# Steps are below 2^53 (the wire protocol's bound); every integer bound also keeps queries inside
# the databases' 64-bit integers (SQLite raised OverflowError, a 500, past them).
Start = Annotated[int | None, Query(ge=0, lt=MAX_STEP, description="first step (default: the run's first)")]
End = Annotated[int | None, Query(ge=0, lt=MAX_STEP, description="last step, inclusive (default: the run's last)")]
Width = Annotated[int, Query(ge=1, description="at most this many points (and at most the service's max_width); "
                                              "extremes are kept per bucket")]
_SCALARS = (*wire.STEP_FIELDS, "tokens", "time")
_SCALAR_LIST = rf"^(({'|'.join(_SCALARS)})(,({'|'.join(_SCALARS)}))*)?$"
Segment = Annotated[int | None, Query(ge=0, lt=2**31, description="one segment only (default: the effective timeline)")]


def _window(settings_max: int, rank: int | None, start: int | None, end: int | None, width: int,
            segment: int | None) -> Window:
    """A width past the service's ``max_width`` gets that many columns (``bucket`` in the answer
    says how coarse), and ``end`` before ``start`` is an empty range, answered with no points:
    both are requests the OpenAPI allows, so they are answered, not refused."""
    return Window(rank=rank, start=start, end=end, width=min(width, settings_max), segment=segment)


def run_out(run: RunSummary) -> RunOut:
    return RunOut(run_id=run.run_id, model=run.model, status=run.status, world_size=run.world_size,
                  created_at=run.created_at, updated_at=run.updated_at, last_step=run.last_step,
                  last_loss=run.last_loss, samples=run.samples)


def _detail_out(d: RunDetail) -> RunDetailOut:
    return RunDetailOut(
        **run_out(d.summary).model_dump(), recipe=d.recipe, config=d.config, num_tensors=d.num_tensors,
        stats=d.stats,
        ranks=[RankOut(rank=r.rank, last_step=r.last_step, last_segment=r.last_segment, last_time=r.last_time,
                       last_loss=r.last_loss, batches=r.batches, samples=r.samples) for r in d.ranks],
    )


def _tensor_out(t: TensorInfo) -> TensorOut:
    return TensorOut(index=t.index, name=t.name, module=t.module, role=t.role, format=t.fp8_format,
                     first_step=t.first_step)


@router.get("", response_model=list[RunOut], summary="List runs, newest activity first")
def list_runs(
    store: StoreDep,
    run_status: Annotated[Literal["running", "finished", "failed"] | None, Query(alias="status")] = None,
    q: Annotated[str | None, Query(max_length=128, description="substring of run id or model")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    offset: Annotated[int, Query(ge=0, lt=2**63)] = 0,
) -> list[RunOut]:
    return [run_out(r) for r in store.runs(status=run_status, search=q, limit=limit, offset=offset)]


@router.get("/{run_id}", response_model=RunDetailOut, summary="One run with per-rank progress")
def get_run(run_id: RunId, store: StoreDep) -> RunDetailOut:
    return _detail_out(store.run(run_id))


@router.get("/{run_id}/tensors", response_model=list[TensorOut], summary="The run's tensor table")
def list_tensors(run_id: RunId, store: StoreDep) -> list[TensorOut]:
    return [_tensor_out(t) for t in store.tensors(run_id)]


@router.get("/{run_id}/scalars", response_model=ScalarSeriesOut, summary="Per-step scalars, downsampled")
def scalars(
    run_id: RunId, store: StoreDep, settings: SettingsDep,
    fields: Annotated[list[Annotated[str, StringConstraints(pattern=_SCALAR_LIST)]],
                      Query(description=f"{', '.join(_SCALARS)} (repeat or comma-separate)")]
    = ["loss", "grad_norm", "lr"],  # noqa: B006 - FastAPI copies defaults
    rank: Rank = None, start: Start = None, end: End = None, width: Width = 2000, segment: Segment = None,
) -> ScalarSeriesOut:
    names = [n for f in fields for n in f.split(",") if n]
    series = store.scalars(run_id, names, _window(settings.max_width, rank, start, end, width, segment))
    return ScalarSeriesOut(bucket=series.bucket, steps=series.steps, min=series.minimum, max=series.maximum)


@router.get("/{run_id}/tensors/{index}/series", response_model=TensorSeriesOut,
            summary="One tensor's statistic over steps, downsampled")
def tensor_series(
    run_id: RunId, index: Annotated[int, Path(ge=0, lt=wire.MAX_TENSORS)], store: StoreDep, settings: SettingsDep,
    stat: Annotated[str, Query(description="e.g. amax, scale, saturation")] = "amax",
    rank: Rank = None, start: Start = None, end: End = None, width: Width = 2000, segment: Segment = None,
) -> TensorSeriesOut:
    s = store.tensor_series(run_id, index, stat, _window(settings.max_width, rank, start, end, width, segment))
    return TensorSeriesOut(tensor=_tensor_out(s.tensor), stat=s.stat, bucket=s.bucket, steps=s.steps,
                           min=s.minimum, max=s.maximum)


@router.get("/{run_id}/matrix", response_model=TensorMatrixOut,
            summary="All tensors x steps for one statistic (heatmap), downsampled")
def tensor_matrix(
    run_id: RunId, store: StoreDep, settings: SettingsDep,
    stat: Annotated[str, Query()] = "amax",
    encoding: Annotated[Literal["base64", "json"], Query(description="base64 float32 (fast) or JSON lists")]
    = "base64",
    rank: Rank = None, start: Start = None, end: End = None, width: Width = 2000, segment: Segment = None,
) -> Response:
    m = store.tensor_matrix(run_id, stat, _window(settings.max_width, rank, start, end, width, segment))
    # Built by hand: validating and re-serialising megabytes of base64 through the response
    # model tripled the latency of a large heatmap; the model still documents the shape.
    body = {
        "stat": m.stat, "bucket": m.bucket, "level": m.level, "steps": m.column_steps.tolist(),
        "present": m.present.tolist(), "tensors": [_tensor_out(t).model_dump() for t in m.tensors],
        "encoding": encoding,
    }
    if encoding == "json":
        empty = m.minimum > m.maximum
        body["min"] = _json_cells(m.minimum, empty)
        body["max"] = _json_cells(m.maximum, empty)
        return Response(json.dumps(body, allow_nan=False, separators=(",", ":")), media_type="application/json")
    # Splice the base64 planes in as bytes: the base64 alphabet never needs JSON escaping, and
    # json.dumps scanning 16 MB of it character by character took 90 ms.
    head = json.dumps(body, allow_nan=False, separators=(",", ":")).encode()
    planes = [pybase64.b64encode(p.astype("<f4", copy=False).tobytes()) for p in (m.minimum, m.maximum)]
    content = b"".join([head[:-1], b',"min":"', planes[0], b'","max":"', planes[1], b'"}'])
    return Response(content, media_type="application/json")


def _json_cells(values: np.ndarray, empty: np.ndarray) -> list[list[float | str | None]]:
    """Nested lists with "no data" as null and non-finite values as strings (JSON has no NaN)."""
    cells = values.astype(object)
    cells[np.isnan(values)] = "NaN"
    cells[np.isposinf(values)] = "Infinity"
    cells[np.isneginf(values)] = "-Infinity"
    cells[empty] = None
    out: list[list[float | str | None]] = cells.tolist()
    return out


@router.get("/{run_id}/events", response_model=list[EventOut], summary="Run events in order")
def events(
    run_id: RunId, store: StoreDep,
    kind: Annotated[list[wire.EventKind] | None, Query()] = None,
    start: Start = None, end: End = None, limit: Annotated[int, Query(ge=1, le=100_000)] = 1000,
    after: Annotated[int | None, Query(ge=0, lt=2**63, description="only events with a larger id: the last id "
                                       "of the previous page")] = None,
) -> list[EventOut]:
    """At most ``limit`` events, in id order, from the one after ``after``. One answer carries at
    most 8 MiB of event data and 64 KiB per event; past either, an event keeps its place with
    ``data: {"truncated": true, "bytes": N}`` (page on with ``after`` for the rest in full)."""
    kinds = [str(k) for k in kind or ()]
    return [EventOut(id=e.id or 0, kind=e.kind, step=e.step, time=e.time, rank=e.rank, segment=e.segment,
                     data=e.data)
            for e in store.events(run_id, kinds=kinds, start=start, end=end, limit=limit, after=after)]
