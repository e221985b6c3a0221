"""Pieces the framework integrations share: the monitor-state file in checkpoints, rank tagging,
and reading a loss out of whatever a training step or forward returned (for the harm probe)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from fp8guard.agent.config import MonitorConfig
from fp8guard.agent.monitor import Monitor

__all__ = ["STATE_FILE", "align_rank", "config_with_token", "loss_in", "read_state", "set_instance_attr", "write_state"]

log = logging.getLogger("fp8guard.agent")

STATE_FILE = "fp8guard_monitor.json"


def config_with_token(config: MonitorConfig | None, token: str | None) -> MonitorConfig:
    """The integration's config with its ``token=`` argument applied (it wins over the config's
    own and over ``$FP8GUARD_TOKEN``, which ``MonitorConfig`` reads when neither is given)."""
    config = config or MonitorConfig()
    return dataclasses.replace(config, token=token) if token is not None else config


def read_state(folder: str) -> dict[str, Any] | None:
    """The monitor state saved in a checkpoint folder, or None (absent or unreadable: logged)."""
    try:
        with open(os.path.join(folder, STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("fp8guard: ignoring unreadable %s in %s: %s", STATE_FILE, folder, exc)
        return None
    return state if isinstance(state, dict) and "run_id" in state else None


def write_state(folder: str, state: dict[str, Any]) -> None:
    path = os.path.join(folder, STATE_FILE)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)  # never a half-written file in a checkpoint


def align_rank(monitor: Monitor, rank: int, world_size: int, framework: str) -> None:
    """Tag the data with the framework's rank; it matches torch.distributed's wherever that is set up."""
    if (monitor.rank, monitor.world_size) != (rank, world_size):
        log.warning("fp8guard: torch.distributed says rank %d of %d, %s says %d of %d; reporting as %d",
                    monitor.rank, monitor.world_size, framework, rank, world_size, rank)
        monitor.rank, monitor.world_size = rank, world_size


def loss_in(output: Any) -> torch.Tensor | None:
    """The scalar loss a training step or a model's forward returned, or None when it carries
    none: a one-element tensor; a mapping's ``"loss"`` (Lightning's step output, HF's dicts);
    an object's ``.loss`` (HF ``ModelOutput``); in a tuple or list, its first one-element
    tensor (HF tuple outputs put the loss first, nanoGPT-style ``(logits, loss)`` last).
    Type checks only: no device work, no sync."""
    if isinstance(output, torch.Tensor):
        return output if output.numel() == 1 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, Sequence) and not isinstance(output, str):
        loss = next((t for t in output if isinstance(t, torch.Tensor) and t.numel() == 1), None)
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def set_instance_attr(obj: Any, name: str, value: Any) -> Callable[[], None]:
    """Set ``obj.name`` on the instance (shadowing the class's method); returns the undo, which
    puts back exactly what the instance had (an attribute of its own, or none)."""
    own = obj.__dict__.get(name, _MISSING)
    setattr(obj, name, value)

    def undo() -> None:
        if own is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)

    return undo


_MISSING = object()
