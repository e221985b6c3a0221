"""The scenario suite of issue #11: seeded CPU runs in emulated FP8 against the real service, scored.

    python bench/scenarios.py --json                         # the whole suite, one JSON scoreboard
    python bench/scenarios.py --scenarios data_spike,heal    # some of it
    python bench/scenarios.py --seeds 0,1 --batch-sizes 1,10

Each scenario (``bench/_scenario_train.py`` says what each injects) trains fp8guard's byte-level GPT
(2 blocks x 64) for 300 steps with the agent streaming to an fp8guard service started in this
process (real app, real loop, SQLite), once per agent batch size (``flush_interval_steps``), with
the agent's defaults otherwise (tripwire on) and a remediator applying the service's commands. The
guard keeps every detection default; only the horizons that a 300-step run cannot wait for are
shortened (``GUARD``). A fault scenario also trains once with no service at all: its unguarded
loss curve says when the loss left the healthy band.

Scored per run: the first finding at or after the injection (step, rule, modules), its lead over
the unguarded loss leaving the healthy band (steps; positive = found first), the first remediation
(kind, step, applied step), false remediations (kinds the scenario must never get), and the steps
from the anomaly's first finding to the step its command was applied. Per scenario: whether the
findings and the first decision are identical at every batch size.

The healthy band: per step, 10 % above the highest loss of the healthy seeds at that step (every
scenario trains seed 0's model on seed 0's batches, so until its onset it *is* healthy seed 0).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._scenario_train import Scenario, TrainResult, train

__all__ = ["EXPECT", "GUARD", "run_suite", "suite"]

GUARD: dict[str, Any] = {
    # Horizons only (a 300-step run cannot wait 500 steps to re-promote or skip 200 batches);
    # every detection threshold keeps its default, the one the held-out replay runs with.
    "rollback_margin_steps": 10, "known_good_after_steps": 10, "skip_batches": 10, "promote_after_steps": 60,
}
REMEDIATIONS = ("fallback", "rollback", "promote", "page")

EXPECT: dict[str, dict[str, Any]] = {
    # kind -> what the guard must never do (false remediations) and the first remediation it should take
    "healthy": {"false": REMEDIATIONS, "first": None},
    "weight_spike": {"false": ("fallback", "page"), "first": None},  # TE rescales the next step
    "weight_ramp": {"false": ("rollback", "page"), "first": None},  # the loss is not hurt: no rollback
    "lr_blowup": {"false": ("fallback",), "first": "rollback"},  # BF16 cures no learning rate
    "data_spike": {"false": ("fallback",), "first": "rollback"},  # nor bad data
    "heal": {"false": ("page",), "first": "fallback"},  # FP8 trouble on the modules it names
}


def suite(names: Sequence[str] | None = None, seeds: Sequence[int] = (0, 1, 2), steps: int = 300) -> list[Scenario]:
    """The scenarios of issue #11: healthy for each seed, the faults on seed 0."""
    out = [Scenario(name=f"healthy_s{s}", kind="healthy", seed=s, steps=steps) for s in seeds]
    out += [Scenario(name="weight_spike", kind="weight_spike", steps=steps),
            Scenario(name="weight_ramp", kind="weight_ramp", onset=100, steps=steps),
            Scenario(name="lr_blowup", kind="lr_blowup", onset=0, steps=steps),
            Scenario(name="data_spike", kind="data_spike", steps=steps),
            Scenario(name="heal", kind="heal", steps=steps),
            # H200-shaped (docs/gpu.md, 1e6 heal): the unit reaches every FP8 module of 4 blocks
            # and the head, the probe runs every 25 steps as there, so bisection names a subset first.
            Scenario(name="heal_wide", kind="heal", steps=steps, n_layer=4, heal_target="all", harm_interval=25)]
    if names:
        out = [s for s in out if s.name in names or s.kind in names]
    return out


# -- the service ------------------------------------------------------------------------------


@contextlib.contextmanager
def service(database_url: str) -> Iterator[tuple[str, Any]]:
    """The real app (store, loop, commands) on uvicorn in a thread on 127.0.0.1; yields (base
    URL, app). Auth off where the service has auth: a loopback bench, as ``Settings`` allows."""
    import uvicorn

    from fp8guard.demo import _free_port
    from fp8guard.service import Settings, create_app
    from fp8guard.service.store import make_engine, upgrade

    engine = make_engine(database_url)
    upgrade(engine)
    engine.dispose()
    extra = {"auth": "off"} if "auth" in Settings.model_fields else {}
    app = create_app(Settings(database_url=database_url, **extra))
    port = _free_port("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name="fp8guard-scenarios", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the scenario service did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}", app
    finally:
        server.should_exit = True
        thread.join(timeout=10)


# -- scoring ----------------------------------------------------------------------------------


def left_band(losses: dict[int, float], band: dict[int, float], start: int) -> int | None:
    """First step >= ``start`` whose loss is above the healthy band."""
    for s in sorted(losses):
        if s >= start and s in band and losses[s] > band[s]:
            return s
    return None


def steps_to_apply(findings: list[dict[str, Any]], actions: list[dict[str, Any]]) -> list[int]:
    """Per applied command: steps from the first step its findings saw the anomaly to the step it
    was applied (``fp8guard demo``'s figure)."""
    seen = {f["id"]: f["step"] for f in findings}
    out = []
    for a in actions:
        steps = [seen[i] for i in a.get("finding_ids") or [] if i in seen]
        if a["status"] == "applied" and a.get("applied_step") is not None and steps:
            out.append(int(a["applied_step"]) - min(steps))
    return out


def score_run(sc: Scenario, findings: list[dict[str, Any]], actions: list[dict[str, Any]],
              unguarded_left: int | None) -> dict[str, Any]:
    onset = 0 if sc.kind == "healthy" else sc.onset
    after = [f for f in findings if f["step"] >= onset]
    first = after[0] if after else None
    remedies = [a for a in actions if a["kind"] in REMEDIATIONS]
    first_action = remedies[0] if remedies else None
    latency = steps_to_apply(findings, actions)
    return {
        "first_finding": None if first is None else
        {"step": first["step"], "rule": first["rule"], "modules": first["modules"], "severity": first["severity"]},
        "lead_steps": None if first is None or unguarded_left is None else unguarded_left - first["step"],
        "first_action": None if first_action is None else
        {"kind": first_action["kind"], "step": first_action["step"], "status": first_action["status"],
         "applied_step": first_action["applied_step"]},
        "actions": [f"{a['kind']}@{a['step']}" for a in remedies],
        "false_remediations": sum(a["kind"] in EXPECT[sc.kind]["false"] for a in remedies),
        "steps_to_apply": latency,
        "max_steps_to_apply": max(latency, default=None),
        "findings": [[f["segment"], f["step"], f["rule"], f["modules"]] for f in findings],
    }


def _first_applied(run: dict[str, Any]) -> int | None:
    steps = [a["applied_step"] for a in run["_actions"] if a["applied_step"] is not None]
    return min(steps, default=None)


def compare_batchings(runs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Findings and the first decision at every batch size. Telemetry is identical across batch
    sizes until a command changes a run's course, so findings are compared up to the first
    applied command of any of them (and in full, reported as ``findings_identical_full``)."""
    applied = [s for s in (_first_applied(r) for r in runs.values()) if s is not None]
    cut = min(applied, default=None)

    def upto(r: dict[str, Any]) -> list[Any]:
        return [f for f in r["findings"] if cut is None or (f[0] == 0 and f[1] <= cut)]

    def first_decision(r: dict[str, Any]) -> Any:
        a = r["first_action"]
        return None if a is None else [a["kind"], a["step"]]

    ref = next(iter(runs.values()))
    return {
        "findings_identical": all(upto(r) == upto(ref) for r in runs.values()),
        "findings_identical_full": all(r["findings"] == ref["findings"] for r in runs.values()),
        "first_decision_identical": all(first_decision(r) == first_decision(ref) for r in runs.values()),
        "compared_up_to_step": cut,
    }


# -- the suite --------------------------------------------------------------------------------


def run_suite(scenarios: Sequence[Scenario], batch_sizes: Sequence[int] = (1, 10), *,
              database_url: str | None = None, progress: bool = False, twins: bool = True) -> dict[str, Any]:
    """Run and score ``scenarios``. Without ``twins`` no unguarded run is trained: the loss leaves
    the band where the first guarded run's did before its first applied command (the two are the
    same run until then)."""
    import httpx

    started = time.perf_counter()
    workdir = Path(tempfile.mkdtemp(prefix="fp8guard-scenarios-"))
    url = database_url or f"sqlite:///{workdir / 'fp8guard.db'}"
    stamp = time.strftime("%H%M%S")
    board: dict[str, Any] = {}
    with service(url) as (base, app), httpx.Client(base_url=base, timeout=30) as api:
        band: dict[int, float] = {}
        healthy_curves: dict[int, dict[int, float]] = {}
        for sc in scenarios:
            per_bs: dict[int, dict[str, Any]] = {}
            left: int | None = None
            unguarded: TrainResult | None = None
            if sc.kind != "healthy" and twins:
                unguarded = train(sc, url=None, run_id=f"{sc.name}-unguarded", workdir=workdir, flush_steps=10,
                                  guarded=False)
            if sc.kind != "healthy" and not band:
                band = _band(healthy_curves or {0: _healthy(sc, workdir).losses})
            for bs in batch_sizes:
                run_id = f"{sc.name}-b{bs}-{stamp}"
                api.put(f"/v1/runs/{run_id}", json={"model": "byte-gpt-2x64", "guard": GUARD,
                                                    "recipe": {"emulation": "delayed", "history": 1024}}
                        ).raise_for_status()
                result = train(sc, url=base, run_id=run_id, workdir=workdir, flush_steps=bs, guarded=True)
                if not app.state.loop.drain(timeout=240):
                    raise RuntimeError("the closed loop did not catch up in 240 s")
                findings = api.get(f"/v1/runs/{run_id}/findings").json()
                actions = api.get(f"/v1/runs/{run_id}/actions").json()
                if sc.kind == "healthy" and bs == batch_sizes[0]:
                    healthy_curves[sc.seed] = result.losses
                if unguarded is not None:
                    left = left_band(unguarded.losses, band, sc.onset)
                elif sc.kind != "healthy" and bs == batch_sizes[0]:
                    applied = min((a["applied_step"] for a in actions if a["applied_step"] is not None),
                                  default=None)
                    first_segment = _first_segment(result.timeline, applied)
                    left = left_band(first_segment, band, sc.onset)
                per_bs[bs] = {**score_run(sc, findings, actions, left), "_actions": actions,
                              "seconds": round(result.seconds, 1)}
                if progress:
                    print(f"{sc.name} b{bs}: {result.seconds:.0f} s, {len(findings)} findings, "
                          f"actions {per_bs[bs]['actions']}", file=sys.stderr, flush=True)
            board[sc.name] = {
                "kind": sc.kind, "seed": sc.seed, "onset": None if sc.kind == "healthy" else sc.onset,
                "unguarded_loss_leaves_band_at": left,
                **compare_batchings(per_bs),
                "by_batch_size": {str(bs): {k: v for k, v in r.items() if not k.startswith("_")}
                                  for bs, r in per_bs.items()},
            }
    return {"scenarios": board, "batch_sizes": list(batch_sizes), "guard": GUARD,
            "seconds": round(time.perf_counter() - started, 1)}


def _first_segment(timeline: list[tuple[int, float]], applied: int | None) -> dict[int, float]:
    """The losses of the run's steps up to its first applied command (before any rollback)."""
    out: dict[int, float] = {}
    for step, loss in timeline:
        if step in out or (applied is not None and step > applied):
            break
        out[step] = loss
    return out


def _healthy(sc: Scenario, workdir: Path) -> TrainResult:
    """Healthy seed 0 without a service: the band when the suite runs no healthy scenario."""
    return train(Scenario(name="band", kind="healthy", seed=0, steps=sc.steps), url=None, run_id="band-s0",
                 workdir=workdir, flush_steps=10, guarded=False)


def _band(curves: dict[int, dict[int, float]]) -> dict[int, float]:
    steps = set.intersection(*(set(c) for c in curves.values()))
    return {s: 1.10 * max(c[s] for c in curves.values()) for s in sorted(steps)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the scoreboard as one JSON document")
    parser.add_argument("--scenarios", default="", help="comma list of names or kinds (default: all)")
    parser.add_argument("--seeds", default="0,1,2", help="healthy seeds")
    parser.add_argument("--batch-sizes", default="1,10", help="agent flush_interval_steps values")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--database-url", default=None, help="default: a fresh SQLite file")
    args = parser.parse_args()
    names = [n for n in args.scenarios.split(",") if n]
    scs = suite(names or None, [int(s) for s in args.seeds.split(",") if s], steps=args.steps)
    board = run_suite(scs, [int(b) for b in args.batch_sizes.split(",")], database_url=args.database_url,
                      progress=not args.json)
    if args.json:
        print(json.dumps(board, indent=1))
    else:
        print_board(board)


def print_board(board: dict[str, Any]) -> None:
    for name, s in board["scenarios"].items():
        print(f"{name}: loss leaves band at {s['unguarded_loss_leaves_band_at']}, findings identical "
              f"{s['findings_identical']}, first decision identical {s['first_decision_identical']}")
        for bs, r in s["by_batch_size"].items():
            print(f"  b{bs}: first finding {r['first_finding']}, lead {r['lead_steps']}, actions {r['actions']}, "
                  f"false {r['false_remediations']}, steps to apply {r['steps_to_apply']}")
    print(f"{board['seconds']} s")


if __name__ == "__main__":
    main()
