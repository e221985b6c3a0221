"""One pass of the closed loop over one run: the detector over each queued batch in its rank's
write order, the policy over what it found, and the decisions and alerts to store.

Detection and policy are pure (``detector``, ``policy``); this module only sequences them over
``LoopTxn``, the store's unit of work, which holds the run's loop lock. Decisions are taken
batch by batch against the run's situation, read once per pass and kept up to date in memory by
the pass's own findings and decisions (their rows are written in bulk: findings once per batch,
decisions once per pass), so a second rank's report of the same incident finds the first
decision pending and orders nothing new: one decision per incident per run, whatever the number
of ranks or service processes.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from fp8guard import wire
from fp8guard.service.alerts.config import AlertSettings
from fp8guard.service.alerts.from_decisions import alert_rows
from fp8guard.service.domain import Batch, Decision, Finding, QueuedBatch
from fp8guard.service.kinds import ROLLBACK_RULES, ActionKind, ActionStatus, Precision, Rule
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.loop.detector import FP8_MAX, Detector, TensorMeta
from fp8guard.service.loop.policy import RunView, decide, promotion_wait, promotions
from fp8guard.service.store.loop_state import LoopTxn, TensorRow

__all__ = ["DetectorCache", "Judge", "PassResult", "tensor_metas"]


@dataclass(frozen=True, slots=True)
class PassResult:
    run_id: str
    judged: int
    """Queued batches judged in this pass."""
    commands: int
    """Commands issued (pending for the agent)."""
    more: bool
    """The pass stopped at its limit: more batches wait."""
    pending: tuple[wire.Command, ...] = ()
    """When the pass issued commands: the run's pending commands as its transaction committed them."""


def tensor_metas(rows: Sequence[TensorRow]) -> list[TensorMeta]:
    """The detector's view of the tensor table. A tensor without a ``format`` is taken to follow
    TE's HYBRID recipe: E5M2 for backward roles, E4M3 otherwise."""
    out = []
    for r in rows:
        backward = (r.role or "").startswith("bwd") or (r.fp8_format or "").lower() == "e5m2"
        fmt = (r.fp8_format or ("e5m2" if backward else "e4m3")).lower()
        out.append(TensorMeta(name=r.name, module=r.module or r.name.split(":")[0], backward=backward,
                              fp8_max=FP8_MAX.get(fmt)))
    return out


class DetectorCache:
    """Detectors of recent passes, so the next pass of the same (run, rank) skips parsing their
    state and rebuilding them (about a third of a pass over a small batch).

    A kept detector is reused only if the state stored in the database is, character for
    character, the one it saved, with the same guard and tensor table: a pass of another
    process, a rolled-back commit, or a changed guard all make it read the stored state again.
    ``take`` removes the entry, so a pass that fails half-way (its detector changed, its state not
    saved) never leaves a detector behind; ``keep`` puts it back once its state is saved."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self._entries: OrderedDict[tuple[int, int], tuple[str, GuardConfig, list[TensorMeta], Detector]] = OrderedDict()
        self._lock = threading.Lock()

    def take(self, key: tuple[int, int], cfg: GuardConfig, metas: list[TensorMeta], stored: str | None) -> Detector:
        with self._lock:
            entry = self._entries.pop(key, None)
        if entry is not None and stored is not None and entry[0] == stored and entry[1] is cfg and entry[2] is metas:
            return entry[3]
        return Detector(cfg, metas, json.loads(stored) if stored is not None else None)

    def keep(self, key: tuple[int, int], cfg: GuardConfig, metas: list[TensorMeta], text: str,
             detector: Detector) -> None:
        with self._lock:
            self._entries[key] = (text, cfg, metas, detector)
            self._entries.move_to_end(key)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)


class Judge:
    """Judges runs; safe to share between loop threads (one run is judged by one thread at a time)."""

    def __init__(self, alerts: AlertSettings, *, batch_limit: int = 256) -> None:
        self.alerts = alerts
        self.batch_limit = batch_limit
        self._metas: dict[tuple[int, int], list[TensorMeta]] = {}
        self._configs: dict[str, GuardConfig] = {}
        self._lock = threading.Lock()
        self._detectors = DetectorCache()

    def __call__(self, txn: LoopTxn, take: Callable[[int], Batch | None], *, limit: int | None = None) -> PassResult:
        """Judge up to ``limit`` queued batches of ``txn``'s run; ``take(queue_id)`` hands over a
        batch this process still holds in memory (else it is read back from the database)."""
        start = txn.open(limit or self.batch_limit)  # the lock and the first reads: one round trip
        queued, run_id = start.queued, start.run_id
        if not queued:
            txn.finish([], [])
            return PassResult(run_id=run_id, judged=0, commands=0, more=False)
        cfg = self._config(start.guard)
        metas = self._tensor_metas(txn, start.n_tensors)
        states = start.states
        detectors: dict[int, Detector] = {}
        last_step: dict[int, int] = {}
        newest = max(q.last_step for q in queued) - cfg.known_good_after_steps
        unconfirmed = [c for c in start.unconfirmed if c[2] <= newest]
        remediating = start.remediating
        commands = 0
        modules = sorted({m.module for m in metas})
        for q in queued:
            batch = take(q.queue_id) or txn.read_batch(q, run_id)
            detector = detectors.get(q.rank)
            if detector is None:
                detector = detectors[q.rank] = self._detectors.take((txn.run_pk, q.rank), cfg, metas,
                                                                    states.get(q.rank))
            findings = detector.observe(batch.steps, batch.blocks, batch.events)
            last_step[q.rank] = max(last_step.get(q.rank, q.last_step), q.last_step)
            finding_ids = txn.add_findings(q.rank, q.segment, findings)
            if findings or remediating:
                # Decide step by step, as if every step had come alone: the same decisions at the
                # same steps whatever the batching (findings of a step, then promotions falling due).
                for at in _decision_points(txn, q, findings, modules, cfg, remediating, detectors.values()):
                    unconfirmed = self._confirm_checkpoints(txn, unconfirmed, at, cfg)
                    group = [i for i, f in enumerate(findings) if f.step == at]
                    view = _view(txn, at, modules, detectors.values())
                    for d in decide([findings[i] for i in group], view, cfg) + promotions(view, cfg):
                        status = _status(d, cfg)
                        txn.add_action(d, status, [finding_ids[group[j]] for j in d.findings], at)
                        if status is ActionStatus.PENDING:
                            commands += 1
                            remediating |= d.kind in (ActionKind.FALLBACK, ActionKind.PROMOTE)
            unconfirmed = self._confirm_checkpoints(txn, unconfirmed, q.last_step, cfg)
        # The pass's decisions in one statement, then their alerts (in the order they were taken).
        txn.enqueue_alerts(alert_rows(self.alerts, run_id, txn.flush_actions(), txn.now))
        saved = []
        for rank, detector in detectors.items():
            text = json.dumps(detector.state_dict(), allow_nan=False)
            saved.append((rank, text, last_step[rank], detector))
        pending = txn.finish([(rank, text, step) for rank, text, step, _ in saved], [q.queue_id for q in queued],
                             read_commands=commands > 0)
        for rank, text, _, detector in saved:
            self._detectors.keep((txn.run_pk, rank), cfg, metas, text, detector)
        return PassResult(run_id=run_id, judged=len(queued), commands=commands,
                          more=len(queued) == (limit or self.batch_limit), pending=tuple(pending))

    def _config(self, guard: dict[str, Any]) -> GuardConfig:
        """The run's guard, validated once per distinct set of overrides."""
        key = json.dumps(guard, sort_keys=True)
        with self._lock:
            cfg = self._configs.get(key)
        if cfg is None:
            cfg = GuardConfig.model_validate(guard)
            with self._lock:
                if len(self._configs) > 1024:
                    self._configs.clear()
                self._configs[key] = cfg
        return cfg

    def _tensor_metas(self, txn: LoopTxn, n_tensors: int) -> list[TensorMeta]:
        """The run's tensor table changes only by appending: cached by (run, number of tensors)."""
        key = (txn.run_pk, n_tensors)
        with self._lock:
            metas = self._metas.get(key)
        if metas is None:
            metas = tensor_metas(txn.tensors())
            with self._lock:
                self._metas[key] = metas
        return metas

    @staticmethod
    def _confirm_checkpoints(txn: LoopTxn, unconfirmed: list[tuple[int, int, int]], step: int,
                             cfg: GuardConfig) -> list[tuple[int, int, int]]:
        """A checkpoint is known-good once ``known_good_after_steps`` followed it with no warning or
        critical finding whose onset falls in [step - margin, step + known_good_after_steps]."""
        ripe = [c for c in unconfirmed if c[2] + cfg.known_good_after_steps <= step]
        if not ripe:
            return unconfirmed
        # Judged as at the step it ripened: findings of later steps (later in the same batch) do
        # not count, so the mark does not depend on how the telemetry was batched.
        good = [c for c in ripe if not txn.troubled_between(c[2] - cfg.rollback_margin_steps,
                                                            c[2] + cfg.known_good_after_steps,
                                                            seen_by=c[2] + cfg.known_good_after_steps)]
        txn.mark_known_good(good)
        return [c for c in unconfirmed if c not in ripe]


def _status(d: Decision, cfg: GuardConfig) -> ActionStatus:
    """Commands wait for the agent (in dry-run they are only recommended); alerts and pages are records."""
    if not d.kind.is_command:
        return ActionStatus.RECORDED
    return ActionStatus.RECOMMENDED if cfg.dry_run else ActionStatus.PENDING


_ROLLBACK_RULES = [str(r) for r in Rule if r in ROLLBACK_RULES or r is Rule.GRAD_NORM_SPIKE]


def _view(txn: LoopTxn, step: int, modules: Sequence[str], detectors: Iterable[Detector] = ()) -> RunView:
    """The policy's input at ``step``: the run's situation as this pass keeps it (read once, updated by
    the pass's own findings and decisions), copied so that the view stays as it was when taken."""
    v = txn.view_inputs(_ROLLBACK_RULES)
    bf16 = {m: since for m, (p, since) in v.precision.items() if p is not Precision.FP8}
    ledgers = [d.harm for d in detectors]  # what the harm probe reported, as of this step
    return RunView(step=step, modules=modules, bf16=bf16,
                   rollback_pending=v.rollback_pending, known_good=tuple(v.known_good),
                   recent_rollbacks=tuple(v.recent_rollbacks), last_finding_step=dict(v.last_fp8_finding),
                   pinned=v.pinned, pending=dict(v.pending_modules), whole_model_pending=v.whole_model_pending,
                   checkpoints=tuple(v.checkpoints), last_loss_event=_before(v.last_loss_event, step),
                   last_page=v.last_page, harm_probed=any(h.probed_at(step) for h in ledgers),
                   trials=tuple(t for h in ledgers for t in h.trials_at(step)))


def _before(event: int | None, step: int) -> int | None:
    return event if event is not None and event <= step else None


def _decision_points(txn: LoopTxn, q: QueuedBatch, findings: Sequence[Finding], modules: Sequence[str],
                     cfg: GuardConfig, remediating: bool, detectors: Iterable[Detector] = ()) -> list[int]:
    """The steps of a batch at which the policy is asked: each step with findings, and (while
    modules are off FP8) the steps at which a re-promotion falls due or a promotion trial was
    reported, else the batch's last."""
    points = {f.step for f in findings}
    if remediating:
        ledgers = list(detectors)
        view = _view(txn, q.last_step, modules, ledgers)
        due = {max(since, view.last_finding_step.get(m, since)) + promotion_wait(view, m, cfg)
               for m, since in view.bf16.items() if m not in view.pinned and m not in view.pending}
        due |= {t.step for t in view.trials}
        points |= {d for d in due if q.first_step <= d <= q.last_step} or {q.last_step}
    return sorted(points)
