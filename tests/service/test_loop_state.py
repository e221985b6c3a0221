"""The loop's unit of work: the run's situation is read once per pass and kept up to date by the
pass's own writes, and findings and decisions are written in bulk, on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa

from fp8guard.service.domain import Decision, Finding, RunSpec
from fp8guard.service.kinds import ActionKind, ActionStatus, Rule, Severity
from fp8guard.service.store import Store
from fp8guard.service.store.loop_state import LoopTxn, ViewInputs

ROLLBACK = [str(Rule.LOSS_SPIKE), str(Rule.NONFINITE)]


def _finding(step: int, rule: Rule = Rule.SATURATION, modules: tuple[str, ...] = ("m1",)) -> Finding:
    return Finding(rule=rule, severity=Severity.WARNING, step=step, onset_step=step - 1,
                   explanation=f"finding at {step}", modules=modules, evidence={"step": step, "x": [1.5, 2]})


def _lookup(store: Store, run_id: str) -> int:
    with store.engine.connect() as conn:
        return int(conn.scalar(sa.text("SELECT id FROM runs WHERE run_id = :r"), {"r": run_id}))


def _fields(v: ViewInputs) -> dict[str, Any]:
    return {name: getattr(v, name) for name in ViewInputs.__slots__}


def test_findings_come_back_with_their_ids_in_order(store: Store) -> None:
    pk = _lookup_registered(store, "bulk-ids")
    findings = [_finding(s) for s in range(1234)]  # three multi-row statements

    def write(txn: LoopTxn) -> list[int]:
        return txn.add_findings(0, 0, findings)

    ids = store.loop_pass(pk, write)
    assert len(set(ids)) == len(findings)
    with store.engine.connect() as conn:
        rows = dict(conn.execute(sa.text("SELECT id, step FROM findings WHERE run_pk = :p"), {"p": pk}).all())
    assert [rows[i] for i in ids] == list(range(1234))


@pytest.mark.parametrize("read_first", [True, False], ids=["read-then-write", "write-then-read"])
def test_the_pass_keeps_the_situation_as_a_fresh_read_would_see_it(store: Store, read_first: bool) -> None:
    """Read before the pass's writes (then kept up to date) or first after them (decisions
    recorded but not written yet are applied to the read): the same as a read after writing."""
    pk = _lookup_registered(store, "bulk-view")

    def judge(txn: LoopTxn) -> tuple[dict[str, Any], dict[str, Any], list[tuple[int, Decision, int]]]:
        if read_first:
            txn.view_inputs(ROLLBACK)
        ids = txn.add_findings(0, 0, [_finding(10, modules=("m1", "m2")), _finding(12, Rule.LOSS_SPIKE, ()),
                                      _finding(14, modules=("m2",))])
        decisions = [
            (Decision(kind=ActionKind.FALLBACK, reason="two modules", findings=(0,), modules=("m1", "m2")),
             ActionStatus.PENDING, [ids[0]], 10),
            (Decision(kind=ActionKind.ROLLBACK, reason="spike", findings=(1,), checkpoint_step=0, onset_step=11),
             ActionStatus.PENDING, [ids[1]], 12),
            (Decision(kind=ActionKind.PAGE, reason="page", findings=(1,)), ActionStatus.RECORDED, [ids[1]], 12),
            (Decision(kind=ActionKind.FALLBACK, reason="whole model", findings=(2,)), ActionStatus.PENDING,
             [ids[2]], 14),
            (Decision(kind=ActionKind.PROMOTE, reason="dry run", findings=(), modules=("m3",)),
             ActionStatus.RECOMMENDED, [], 15),
        ]
        for d, status, fids, step in decisions:
            txn.add_action(d, status, fids, step)
        kept = _fields(txn.view_inputs(ROLLBACK))
        stored = txn.flush_actions()
        fresh = _fields(LoopTxn(txn.conn, txn.run_pk, txn.now).view_inputs(ROLLBACK))
        return kept, fresh, stored

    kept, fresh, stored = store.loop_pass(pk, judge)
    assert kept == fresh
    assert kept["pending_modules"] == {"m1": ActionKind.FALLBACK, "m2": ActionKind.FALLBACK}
    assert kept["whole_model_pending"] and kept["rollback_pending"] and kept["last_page"] == 12
    assert kept["last_loss_event"] == 11 and kept["last_fp8_finding"] == {"m1": 10, "m2": 14}
    assert [(d.reason, step) for _, d, step in stored] == [("two modules", 10), ("spike", 12), ("page", 12),
                                                          ("whole model", 14), ("dry run", 15)]
    assert [i for i, _, _ in stored] == sorted(i for i, _, _ in stored)


def _lookup_registered(store: Store, run_id: str) -> int:
    store.register_run(RunSpec(run_id=run_id))
    return _lookup(store, run_id)
