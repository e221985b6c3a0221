"""Builders for realistic ingest payloads."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from fp8guard import wire

STATS = ("amax", "scale", "saturation", "amax_history_max")


def tensor_defs(n: int) -> list[dict[str, Any]]:
    roles = ("fwd_input", "fwd_weight", "bwd_grad_output")
    return [
        {"index": i, "name": f"blocks.{i // 3}.fc:{roles[i % 3]}", "module": f"blocks.{i // 3}.fc",
         "role": roles[i % 3], "format": "e5m2" if roles[i % 3].startswith("bwd") else "e4m3"}
        for i in range(n)
    ]


def stat_values(steps: list[int], n_tensors: int, stats: tuple[str, ...] = STATS, seed: int = 0) -> np.ndarray:
    """Deterministic float32 values shaped (steps, stats, tensors): value = step + tensor/1000 + stat*1e-6 scale."""
    s = np.asarray(steps, dtype=np.float64)[:, None, None]
    k = np.arange(len(stats), dtype=np.float64)[None, :, None]
    t = np.arange(n_tensors, dtype=np.float64)[None, None, :]
    rng = np.random.default_rng(seed)
    noise = rng.random((len(steps), len(stats), n_tensors))
    return (1.0 + (s % 97) + t / 1000.0 + k * 0.25 + noise * 0.01).astype("<f4")


def batch(
    run_id: str,
    steps: list[int],
    *,
    n_tensors: int = 6,
    values: np.ndarray | None = None,
    define_tensors: bool = True,
    rank: int = 0,
    segment: int = 0,
    stats: tuple[str, ...] = STATS,
    batch_id: str | None = None,
    losses: list[float] | None = None,
    events: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    vals = stat_values(steps, n_tensors, stats) if values is None else values
    return wire.make_batch(
        run_id=run_id,
        rank=rank,
        segment=segment,
        batch_id=batch_id,
        tensors=tensor_defs(n_tensors) if define_tensors else (),
        steps=[{"step": s, "time": 1_700_000_000.0 + s, "loss": (losses[i] if losses else 3.0 - s * 1e-3),
                "grad_norm": 1.0, "lr": 3e-4, "tokens": 4096 * (s + 1)} for i, s in enumerate(steps)],
        tensor_stats=[wire.tensor_stats_block(stats=stats, steps=steps, n_tensors=n_tensors,
                                              data=np.ascontiguousarray(vals, dtype="<f4").tobytes())],
        events=events or (),
    )


def register(client: Any, run_id: str, **body: Any) -> Any:
    r = client.put(f"/v1/runs/{run_id}", json={"model": "tiny-gpt", "world_size": 1, **body})
    assert r.status_code in (200, 201), r.text
    return r


def post(client: Any, payload: dict[str, Any], *, judged: bool = True, **kw: Any) -> Any:
    """POST a batch; with ``judged`` (the default) also wait until the closed loop judged it, so a
    test reads the loop's findings and commands right after, as an agent's next answer would."""
    r = client.post("/v1/ingest", content=wire.dumps(payload), headers={"content-type": "application/json"}, **kw)
    app = getattr(client, "app", None)  # an in-process TestClient (a client of a real server has none)
    if judged and app is not None:
        assert app.state.loop.drain(timeout=30), "the closed loop did not catch up in 30 s"
    return r


@contextlib.contextmanager
def app_in_thread(app: Any, *, timeout: float = 30.0) -> Iterator[str]:
    """The real app under uvicorn on 127.0.0.1 in a daemon thread (its lifespan runs: loop,
    committer); yields ``http://127.0.0.1:PORT`` and stops the server afterwards."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the service did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
