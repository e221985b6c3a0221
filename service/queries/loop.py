"""Queries of the closed loop: findings, actions, pending commands (with a long-poll),
precision per module and checkpoints."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request
from starlette.concurrency import run_in_threadpool

from fp8guard.service.auth import AUTH_RESPONSES, FollowAccess, require
from fp8guard.service.deps import ChannelDep, SettingsDep, StoreDep
from fp8guard.service.kinds import Role
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.queries.runs import RunId
from fp8guard.service.schemas import ActionOut, CheckpointOut, CommandOut, FindingOut, PrecisionOut

__all__ = ["router"]

router = APIRouter(prefix="/v1/runs", tags=["closed loop"], responses=AUTH_RESPONSES)
_READ = [Depends(require(Role.READ))]
"""Every route here needs a reader, except the commands an agent long-polls for its own run."""

_NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"description": "Unknown run"}}


@router.get("/{run_id}/guard", response_model=GuardConfig, responses=_NOT_FOUND, dependencies=_READ,
            summary="The run's detection thresholds and policy: every default, with its overrides applied")
def guard(run_id: RunId, store: StoreDep) -> GuardConfig:
    """What the closed loop judges this run with (set when the run is registered, changed by an
    admin with ``PUT /v1/runs/{run_id}/guard``; the defaults and their reasons are in ``docs/closed-loop.md``)."""
    return GuardConfig.model_validate(store.run(run_id).guard or {})


@router.get("/{run_id}/findings", response_model=list[FindingOut], responses=_NOT_FOUND, dependencies=_READ,
            summary="What detection saw: rule, severity, evidence, explanation")
def findings(run_id: RunId, store: StoreDep) -> list[FindingOut]:
    return [FindingOut.of(f) for f in store.findings(run_id)]


@router.get("/{run_id}/actions", response_model=list[ActionOut], responses=_NOT_FOUND, dependencies=_READ,
            summary="Every policy decision with its reason and status")
def actions(run_id: RunId, store: StoreDep) -> list[ActionOut]:
    return [ActionOut.of(a) for a in store.actions(run_id)]


@router.get("/{run_id}/commands", response_model=list[CommandOut], responses=_NOT_FOUND,
            summary="Pending remediation commands; long-polls with ?wait=S")
async def commands(
    run_id: RunId, request: Request, store: StoreDep, settings: SettingsDep, channel: ChannelDep, _: FollowAccess,
    wait: Annotated[float, Query(ge=0, le=300, description="seconds to wait for a command when none is pending "
                                                         "(capped by the service's long_poll_max_s)")] = 0,
    after: Annotated[int, Query(ge=0, lt=2**63, description="only commands with a larger id (the newest id "
                                                          "the agent has seen)")] = 0,
) -> list[CommandOut]:
    """Answers at once when a pending command with an id above ``after`` exists; otherwise waits
    up to ``wait`` seconds for the loop to issue one (the same commands also ride on every ingest
    answer). A command decided in this process is answered the moment it is committed; one
    decided by another process within ``command_poll_interval_s``. A client that hangs up ends
    its wait at the next poll (no request outlives its agent, nor holds up a shutdown)."""
    deadline = time.monotonic() + min(wait, settings.long_poll_max_s)
    while True:
        ticket = channel.watch(run_id) if wait > 0 else None
        pending = [c for c in await run_in_threadpool(store.commands, run_id) if c.id > after]
        left = deadline - time.monotonic()
        if ticket is not None and not pending and left > 0 and await request.is_disconnected():
            left = 0.0
        if ticket is None or pending or left <= 0:
            if ticket is not None:
                channel.release(run_id, ticket)
            return [CommandOut.of(c) for c in pending]
        if await channel.wait(run_id, ticket, min(left, settings.command_poll_interval_s)) and ticket.commands:
            # The loop of this process committed them and read them in that transaction.
            notified = [c for c in ticket.commands if c.id > after]
            if notified:
                return [CommandOut.of(c) for c in notified]


@router.get("/{run_id}/precision", response_model=list[PrecisionOut], responses=_NOT_FOUND, dependencies=_READ,
            summary="Each module's precision as the agent reported it applied, and since when")
def precision(run_id: RunId, store: StoreDep) -> list[PrecisionOut]:
    return [PrecisionOut.of(p) for p in store.precision(run_id)]


@router.get("/{run_id}/checkpoints", response_model=list[CheckpointOut], responses=_NOT_FOUND, dependencies=_READ,
            summary="Checkpoints the agent reported, with known-good marks")
def checkpoints(run_id: RunId, store: StoreDep) -> list[CheckpointOut]:
    return [CheckpointOut.of(c) for c in store.checkpoints(run_id)]
