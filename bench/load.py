"""Many agents, small frequent batches: latency, throughput, durability and decision latency.

    python bench/load.py --agents 50 --rate 1 --duration 30 --json
    python bench/load.py --agents 1 --rate 0 --duration 15 --json
    python bench/load.py --database both --agents 200 --rate 0.5
    python bench/load.py --url http://127.0.0.1:8000 --agents 20    # an already running service
    python bench/load.py --auth --agents 50 --rate 1 --json        # as deployed: tokens required

Each part's implementation and its description: the bodies the agents send (a run's tensor
table, then healthy batches) bench/_load_bodies.py; the agents, throttled (``--rate``) or back to
back, through the agent's own transport or an async client (``--client``) bench/_load_agents.py;
the decision-latency probes (``--decisions``) bench/_load_probes.py; what a run reads besides
the answers (each run's stored counts, the service's CPU and latency histogram, the load
generator's event-loop lag) bench/_load_readings.py; one run over the window, its figures and the
stored-equals-acked check bench/_load_run.py; the service on a fresh SQLite or PostgreSQL
database, with ``--auth`` its tokens, bench/_load_service.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench._load_bodies import STAT_NAMES
from bench._load_run import _load
from bench._load_service import _postgres, _sqlite


def _print_table(results: dict[str, dict[str, Any]]) -> None:
    print(f"{'database':10} {'agents':>6} {'rate':>5} {'offered/s':>9} {'batches/s':>9} {'p50 ms':>8} "
          f"{'p99 ms':>8} {'max ms':>8} {'errors':>6} {'stored=acked':>12} {'decision ms (med/max)':>22}")
    for name, r in results.items():
        d = r["decision_latency_ms"]
        dec = f"{d['median']}/{d['max']} ({d['in_answer']}/{d['n']} in answer)" if d["n"] else "-"
        print(f"{name:10} {r['agents']:>6} {r['rate']:>5g} {r['offered_per_s']:>9} {r['batches_per_s']:>9} "
              f"{r['p50_ms']!s:>8} {r['p99_ms']!s:>8} {r['max_ms']!s:>8} {r['errors']:>6} "
              f"{r['stored_equals_acked']!s:>12} {dec:>22}")
        for example in r["error_examples"] + r["mismatches"]:
            print(f"  {example}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--database", choices=("sqlite", "postgresql", "both"), default="sqlite")
    parser.add_argument("--url", help="use this already running service (127.0.0.1) instead of starting one")
    parser.add_argument("--agents", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0, help="batches/s per agent; 0: back to back")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of load")
    parser.add_argument("--tensors", type=int, default=200)
    parser.add_argument("--stats", type=int, default=4, help=f"the first N of {', '.join(STAT_NAMES)}, ...")
    parser.add_argument("--steps-per-batch", type=int, default=10)
    parser.add_argument("--decisions", type=int, default=5, help="decision-latency probes")
    parser.add_argument("--json", action="store_true", help="print JSON")
    parser.add_argument("--pre-encode", action="store_true",
                        help="build every agent's bodies before the timed window (the agent's encoding runs on the "
                             "training host in production); the default builds each body just before sending it")
    parser.add_argument("--auth", action="store_true", help="require tokens (FP8GUARD_AUTH=required), as deployed")
    parser.add_argument("--client", choices=("agent", "async"),
                        help="agent: each agent a thread with a blocking httpx.Client, as the agent's shipper sends; "
                             "async: every agent a task on one event loop with an httpx.AsyncClient. "
                             "Default: agent with --rate 0, async otherwise")
    args = parser.parse_args()
    args.client = args.client or ("agent" if args.rate == 0 else "async")
    if min(args.agents, args.tensors, args.stats, args.steps_per_batch) < 1 or args.rate < 0 \
            or not 0 < args.duration <= 3600 or args.decisions < 0:
        parser.error("need agents, tensors, stats, steps-per-batch >= 1; rate >= 0; 0 < duration <= 3600; "
                     "decisions >= 0")
    if args.url is not None and httpx.URL(args.url).host not in ("127.0.0.1", "localhost"):
        parser.error("--url must point at 127.0.0.1")

    results: dict[str, dict[str, Any]] = {}
    if args.url is not None:
        args.database = "url"
        results["url"] = asyncio.run(_load(args.url.rstrip("/"), args))
    for name, run in (("sqlite", _sqlite), ("postgresql", _postgres)):
        if args.url is None and args.database in (name, "both"):
            results[name] = run(argparse.Namespace(**{**vars(args), "database": name}))
    if args.json:
        print(json.dumps(results if len(results) > 1 else next(iter(results.values()))))
    else:
        _print_table(results)


if __name__ == "__main__":
    main()
