"""Per-rank training checkpoints for in-process rollback: atomic files, keep-last-K pruning
and known-good marks.

    ckpts = CheckpointManager("ckpt/", model=model, optimizer=opt, scheduler=sched,
                              data_state=lambda: {"position": data.position},
                              load_data_state=lambda s: setattr(data, "position", s["position"]),
                              every_n_steps=100, keep_last=5)
    for step in range(total):
        ...forward, backward, optimizer.step(), scheduler.step()...
        path = ckpts.maybe_save(step, extra={"monitor": monitor.state_dict()})
        if path is not None:
            monitor.event("checkpoint_saved", step=step, data={"path": str(path)})

    extra = ckpts.load(ckpts.latest_at_or_before(1234))   # restores everything in place

What a checkpoint of step ``s`` holds (saved after step ``s`` completed, so training resumes
at ``s + 1``): the model's ``state_dict`` (with the FP8 metadata buffers of the emulation and
Transformer Engine's ``_extra_state``), the optimizer's and the scheduler's state, the RNG
states (torch CPU, CUDA when initialised, Python ``random``, NumPy's global generator when NumPy
is importable), the data position from ``data_state()`` and the caller's ``extra`` (e.g. the
monitor's state). One file per (rank, step): every rank saves its own shard of the world's
state, so the same ``CheckpointManager`` works for DDP (identical replicas) and for sharded
or per-rank FP8 state (emulation and TE with ``reduce_amax=False`` keep amaxes per rank).

Files are written atomically (temp file in the same folder, fsync, ``os.replace``, fsync of
the folder): a crash mid-write leaves the previous checkpoints intact and never a torn file
under a checkpoint's name. Files are read back with ``torch.load(weights_only=True)``, so
``extra`` and the scheduler's state must hold only tensors and plain Python containers.

Data-state contract (what rollback relies on to skip batches): ``data_state()`` returns a dict
with an int ``"position"``, the index of the next batch the loader will produce; other keys
are carried along untouched. ``load_data_state(state)`` makes the loader continue from
``state["position"]``. :meth:`CheckpointManager.skip_batches` advances that position.

Transformer Engine notes: ``state_dict()`` syncs the device for ``_extra_state``, which is fine
at checkpoint time (never per step). TE 2.20 refuses pickled DelayedScaling extra state on load
unless ``NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1`` is set in the job's environment; the error
raised then says so. A TE module that was in BF16 at save time saves empty extra state, which
would leave its current (possibly corrupted) scale and history in place: after loading, such
modules get ``reset_fp8_meta_tensors()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import re
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any, Protocol, runtime_checkable

import torch
from torch import nn

from fp8guard.agent.distributed import rank_and_world
from fp8guard.agent.errors import CheckpointError, ConfigError
from fp8guard.agent.rng_state import capture_rng_state, restore_rng_state

__all__ = ["CHECKPOINT_FORMAT", "CheckpointManager", "Checkpoints", "Stateful"]

log = logging.getLogger("fp8guard.agent")

CHECKPOINT_FORMAT = "fp8guard-checkpoint"
_VERSION = 1
_INDEX_FORMAT = "fp8guard-checkpoint-index"
_TE_PICKLE_ENV = "NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE"


class Stateful(Protocol):
    """Anything with ``state_dict``/``load_state_dict``, e.g. an LR scheduler."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...


@runtime_checkable
class Checkpoints(Protocol):
    """What a rollback (:class:`~fp8guard.agent.remediation.Remediator`) uses of a run's
    checkpoints: :class:`CheckpointManager` is one, a framework integration's own checkpoints
    (:class:`~fp8guard.agent.integrations._heal.FrameworkCheckpoints`) another."""

    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    scheduler: Stateful | None

    @property
    def restores_data(self) -> bool: ...

    def read(self, step: int) -> dict[str, Any]: ...

    def restore(self, payload: Mapping[str, Any]) -> dict[str, Any]: ...

    def data_position(self) -> int | None: ...

    def skip_batches(self, n: int) -> int | None: ...

    def discard_after(self, step: int) -> list[int]: ...


class CheckpointManager:
    """Saves, prunes, marks and restores this rank's checkpoints in ``directory``.

    See the module docstring for what is saved and the data-state contract. Construction
    errors (folder not writable, ``every_n_steps < 1``, ...) raise ConfigError; a checkpoint
    that is missing, unreadable or does not fit raises CheckpointError.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Stateful | None = None,
        data_state: Callable[[], dict[str, Any]] | None = None,
        load_data_state: Callable[[dict[str, Any]], None] | None = None,
        every_n_steps: int = 100,
        keep_last: int = 5,
        rank: int | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise ConfigError(f"model must be the torch.nn.Module to checkpoint, got {type(model).__name__}")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise ConfigError(f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}")
        if scheduler is not None and not (callable(getattr(scheduler, "state_dict", None))
                                          and callable(getattr(scheduler, "load_state_dict", None))):
            raise ConfigError("scheduler must have state_dict() and load_state_dict() (an LR scheduler), or be None")
        if (data_state is None) != (load_data_state is None):
            raise ConfigError("pass data_state and load_data_state together (save and restore the data position), "
                             "or neither")
        if not _is_int(every_n_steps) or every_n_steps < 1:
            raise ConfigError(f"every_n_steps must be an int >= 1 (save after every N steps), got {every_n_steps!r}")
        if not _is_int(keep_last) or keep_last < 1:
            raise ConfigError(f"keep_last must be an int >= 1 (checkpoints kept per rank), got {keep_last!r}")
        if rank is not None and (not _is_int(rank) or rank < 0):
            raise ConfigError(f"rank must be an int >= 0 or None (taken from torch.distributed), got {rank!r}")
        self.model = model
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.every_n_steps = every_n_steps
        self.keep_last = keep_last
        self.rank = rank if rank is not None else rank_and_world()[0]
        self._data_state = data_state
        self._load_data_state = load_data_state
        self._dir = _usable_directory(Path(directory))
        self._pattern = re.compile(rf"^ckpt-rank{self.rank}-step(\d+)\.pt$")
        self._remove_stale_temp_files()

    # -- paths -----------------------------------------------------------------------------------

    @property
    def directory(self) -> Path:
        return self._dir

    def path_for(self, step: int) -> Path:
        """The file of this rank's checkpoint of ``step`` (whether or not it exists)."""
        return self._dir / f"ckpt-rank{self.rank}-step{_check_step(step):09d}.pt"

    @property
    def _index_path(self) -> Path:
        return self._dir / f"index-rank{self.rank}.json"

    # -- saving ----------------------------------------------------------------------------------

    def maybe_save(self, step: int, *, extra: Mapping[str, Any] | None = None) -> Path | None:
        """Save after every ``every_n_steps`` completed steps (0-based ``step`` with
        ``(step + 1) % every_n_steps == 0``, so a rollback resumes at a multiple of N).
        Returns the file written, or None."""
        if (_check_step(step) + 1) % self.every_n_steps != 0:
            return None
        return self.save(step, extra=extra)

    def save(self, step: int, *, extra: Mapping[str, Any] | None = None) -> Path:
        """Save the state after ``step`` completed, atomically, then prune. Returns the file.

        Raises what writing raises (disk full, ...); the previous checkpoints stay intact."""
        step = _check_step(step)
        payload = self._collect(step, extra)
        path = self.path_for(step)
        self._atomic_write(path, lambda f: torch.save(payload, f))
        self._prune()
        return path

    def _collect(self, step: int, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        data: dict[str, Any] | None = None
        if self._data_state is not None:
            data = dict(self._data_state())
        return {
            "format": CHECKPOINT_FORMAT,
            "version": _VERSION,
            "rank": self.rank,
            "step": step,
            "time": time.time(),
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict() if self.optimizer is not None else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": capture_rng_state(),
            "data": data,
            "extra": dict(extra) if extra is not None else {},
        }

    def _atomic_write(self, path: Path, write: Callable[[IO[bytes]], None]) -> None:
        # Same folder as the target, so os.replace is a rename on one file system (atomic).
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self._dir)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_directory(self._dir)  # make the rename itself durable

    def _remove_stale_temp_files(self) -> None:
        # Leftovers of a crash mid-write of this rank (other ranks clean their own).
        for p in self._dir.glob(f".ckpt-rank{self.rank}-step*.tmp"):
            with contextlib.suppress(OSError):
                p.unlink()
        for p in self._dir.glob(f".index-rank{self.rank}.json.*.tmp"):
            with contextlib.suppress(OSError):
                p.unlink()

    # -- listing, known-good marks and pruning ---------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a checkpoint of this rank, ascending."""
        out = []
        for p in self._dir.iterdir():
            m = self._pattern.match(p.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def known_good(self) -> list[int]:
        """Steps marked known-good that still have a checkpoint, ascending."""
        present = set(self.steps())
        return sorted(s for s in self._read_index() if s in present)

    def mark_known_good(self, step: int) -> None:
        """Record that the checkpoint of ``step`` is known-good (no trouble followed it).

        The newest known-good checkpoint is never pruned. Raises CheckpointError if there is
        no checkpoint of ``step`` on this rank."""
        step = _check_step(step)
        if not self.path_for(step).exists():
            raise CheckpointError(f"cannot mark step {step} known-good: rank {self.rank} has no checkpoint of it in "
                             f"{self._dir} (steps: {self.steps()})")
        marks = self._read_index()
        if step not in marks:
            self._write_index(sorted({*marks, step}))
        self._prune()

    def latest_at_or_before(self, step: int) -> int | None:
        """The newest checkpointed step <= ``step``, or None."""
        step = _check_step(step)
        earlier = [s for s in self.steps() if s <= step]
        return earlier[-1] if earlier else None

    def discard_after(self, step: int) -> list[int]:
        """Delete this rank's checkpoints of steps after ``step`` (the timeline a rollback
        abandoned, so that a restart never resumes from it). Returns the deleted steps."""
        step = _check_step(step)
        doomed = [s for s in self.steps() if s > step]
        self._delete(doomed)
        return doomed

    def _prune(self) -> None:
        steps = self.steps()
        keep = set(steps[-self.keep_last:])
        present = set(steps)
        good = [s for s in self._read_index() if s in present]
        if good:
            keep.add(max(good))  # the rollback target of last resort
        self._delete([s for s in steps if s not in keep])

    def _delete(self, steps: list[int]) -> None:
        if not steps:
            return
        marks = self._read_index()
        doomed = set(steps)
        left = [s for s in marks if s not in doomed]
        if left != marks:
            # Index first: a mark without a file is ignored, a file without its mark is not lost data.
            self._write_index(left)
        for s in steps:
            with contextlib.suppress(FileNotFoundError):
                self.path_for(s).unlink()

    def _read_index(self) -> list[int]:
        try:
            raw = json.loads(self._index_path.read_text())
            return sorted({int(s) for s in raw["known_good"]})
        except FileNotFoundError:
            return []
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("fp8guard: ignoring unreadable checkpoint index %s (%s); no checkpoint is known-good",
                        self._index_path, exc)
            return []

    def _write_index(self, known_good: list[int]) -> None:
        body = json.dumps({"format": _INDEX_FORMAT, "version": _VERSION, "rank": self.rank,
                           "known_good": known_good}).encode()

        def write(f: IO[bytes]) -> None:
            f.write(body)

        self._atomic_write(self._index_path, write)

    # -- loading ---------------------------------------------------------------------------------

    def read(self, step: int) -> dict[str, Any]:
        """Read and validate the checkpoint of ``step`` without changing anything.

        Raises CheckpointError naming the problem (no such checkpoint, an unreadable file,
        another format, a model whose keys or shapes differ). :meth:`restore` applies what this returns."""
        step = _check_step(step)
        path = self.path_for(step)
        if not path.exists():
            raise CheckpointError(f"rank {self.rank} has no checkpoint of step {step} in {self._dir} "
                             f"(steps: {self.steps()})")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise CheckpointError(f"{path} holds objects torch.load(weights_only=True) refuses ({exc}); keep extra= "
                             "and the scheduler's state to tensors and plain containers") from exc
        except Exception as exc:  # a truncated zip, a vanished or unreadable file, ...: never leaks from torch.load
            raise CheckpointError(f"{path} is not a readable torch checkpoint: {type(exc).__name__}: {exc}") from exc
        if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{path} is not an fp8guard checkpoint (no format {CHECKPOINT_FORMAT!r})")
        if payload.get("version") != _VERSION:
            raise CheckpointError(f"{path} has checkpoint version {payload.get('version')!r}; this fp8guard reads "
                             f"version {_VERSION}")
        if payload.get("rank") != self.rank or payload.get("step") != step:
            raise CheckpointError(f"{path} holds rank {payload.get('rank')} step {payload.get('step')}, expected rank "
                             f"{self.rank} step {step}: was it renamed?")
        self._check_model(payload["model"], path)
        if self.optimizer is not None and payload.get("optimizer") is None:
            raise CheckpointError(f"{path} has no optimizer state but this CheckpointManager has an optimizer")
        if self.scheduler is not None and payload.get("scheduler") is None:
            raise CheckpointError(f"{path} has no scheduler state but this CheckpointManager has a scheduler")
        if self._load_data_state is not None and payload.get("data") is None:
            raise CheckpointError(f"{path} has no data state but this CheckpointManager restores one")
        return dict(payload)

    def _check_model(self, saved: Mapping[str, Any], path: Path) -> None:
        # Checked up front: a strict load_state_dict that fails halfway leaves a half-restored model.
        own = self.model.state_dict()
        missing = sorted(set(own) - set(saved))
        unexpected = sorted(set(saved) - set(own))
        if missing or unexpected:
            raise CheckpointError(f"{path} does not fit this model: missing keys {missing[:5]}, unexpected keys "
                             f"{unexpected[:5]} ({len(missing)} and {len(unexpected)} in all)")
        bad = [k for k, v in own.items()
               if not k.endswith("_extra_state") and isinstance(v, torch.Tensor)
               and isinstance(saved[k], torch.Tensor) and saved[k].shape != v.shape]
        if bad:
            k = bad[0]
            raise CheckpointError(f"{path} does not fit this model: {len(bad)} tensors differ in shape, e.g. {k} "
                             f"{tuple(saved[k].shape)} saved vs {tuple(own[k].shape)} now")

    def restore(self, payload: Mapping[str, Any]) -> dict[str, Any]:
        """Apply a checkpoint from :meth:`read` in place: model (strict), optimizer, scheduler,
        RNG, data state. Returns its ``extra`` dict."""
        model_state = payload["model"]
        try:
            self.model.load_state_dict(model_state, strict=True)
        except RuntimeError as exc:
            if _TE_PICKLE_ENV in str(exc):
                raise CheckpointError(f"Transformer Engine refused the checkpoint's FP8 extra state: set "
                                 f"{_TE_PICKLE_ENV}=1 in the training job's environment to load checkpoints "
                                 f"this job wrote itself ({exc})") from exc
            raise
        _reset_te_modules_saved_without_fp8_state(self.model, model_state)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(payload["optimizer"])
        if self.scheduler is not None:
            self.scheduler.load_state_dict(payload["scheduler"])
        restore_rng_state(payload["rng"])
        if self._load_data_state is not None:
            self._load_data_state(dict(payload["data"]))
        return dict(payload.get("extra") or {})

    def load(self, step: int) -> dict[str, Any]:
        """Restore the checkpoint of ``step`` in place (see :meth:`restore`); returns its
        ``extra`` dict. Raises CheckpointError if it does not exist or does not fit."""
        return self.restore(self.read(step))

    # -- data position ---------------------------------------------------------------------------

    @property
    def restores_data(self) -> bool:
        """Whether data_state/load_data_state were given (needed to skip batches)."""
        return self._data_state is not None

    def data_position(self) -> int | None:
        """``data_state()["position"]`` now, or None without data hooks."""
        if self._data_state is None:
            return None
        return _position(self._data_state())

    def skip_batches(self, n: int) -> int:
        """Advance the data position by ``n`` batches (see the data-state contract); returns
        the new position. Raises ConfigError without data hooks or an int ``"position"``."""
        if not _is_int(n) or n < 0:
            raise ConfigError(f"batches to skip must be an int >= 0, got {n!r}")
        if self._data_state is None or self._load_data_state is None:
            raise ConfigError("skipping batches needs CheckpointManager(data_state=..., load_data_state=...)")
        state = dict(self._data_state())
        state["position"] = _position(state) + n
        self._load_data_state(state)
        return int(state["position"])


# -- helpers ---------------------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step!r}")
    return step


def _position(state: Mapping[str, Any]) -> int:
    pos = state.get("position")
    if isinstance(pos, bool) or not isinstance(pos, int):
        raise ConfigError(f"data_state() must return a dict with an int 'position' (the index of the next batch), "
                         f"got keys {sorted(state)} with position={pos!r}")
    return pos


def _usable_directory(path: Path) -> Path:
    try:
        path.mkdir(parents=True, exist_ok=True)
    except FileExistsError as exc:
        raise ConfigError(f"checkpoint directory {path} exists and is not a folder") from exc
    except OSError as exc:
        raise ConfigError(f"cannot create checkpoint directory {path}: {exc}; pass a writable folder") from exc
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"checkpoint directory {path} is not writable by this process; pass a writable folder")
    return path


def _fsync_directory(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some platforms cannot open folders; the rename is still atomic there
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _reset_te_modules_saved_without_fp8_state(model: nn.Module, saved: Mapping[str, Any]) -> None:
    """TE modules that were in BF16 at save time saved an empty ``_extra_state``; loading it
    keeps the in-memory scale/history (possibly the corrupted ones): start them fresh."""
    for name, module in model.named_modules():
        reset = getattr(module, "reset_fp8_meta_tensors", None)
        if not callable(reset):
            continue
        value = saved.get(f"{name}._extra_state" if name else "_extra_state")
        if isinstance(value, torch.Tensor) and value.numel() == 0:
            try:
                reset()
            except Exception:  # best effort: the weights are restored either way
                log.warning("fp8guard: reset_fp8_meta_tensors() failed on %s after loading a checkpoint",
                            name, exc_info=True)
