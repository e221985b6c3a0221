"""A one-step spike survives every zoom level of every query, through the HTTP API."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.helpers import batch, post, register, stat_values


@pytest.mark.slow
@pytest.mark.parametrize("width", [1, 3, 50, 700, 5000])
def test_single_step_spike_survives_any_zoom(client, width: int) -> None:
    register(client, "spiky")
    steps = list(range(0, 9000))
    vals = stat_values(steps, 4)
    vals[6_543, 0, 2] = 4.0e4  # amax outlier on one tensor at one step
    losses = [2.0] * len(steps)
    losses[6_543] = 90.0
    for lo in range(0, len(steps), 1500):
        chunk = slice(lo, lo + 1500)
        assert post(client, batch("spiky", steps[chunk], n_tensors=4, values=vals[chunk],
                                  losses=losses[chunk], define_tensors=lo == 0)).status_code == 200
    m = client.get("/v1/runs/spiky/matrix", params={"stat": "amax", "width": width}).json()
    hi = np.frombuffer(base64.b64decode(m["max"]), dtype="<f4").reshape(len(m["tensors"]), len(m["steps"]))
    assert len(m["steps"]) <= width
    assert hi[2].max() == np.float32(4.0e4) and hi[1].max() < 200
    col = int(np.argmax(hi[2]))
    assert m["steps"][col] <= 6_543 < m["steps"][col] + m["bucket"]
    s = client.get("/v1/runs/spiky/scalars", params={"fields": "loss", "width": width}).json()
    assert max(s["max"]["loss"]) == 90.0 and len(s["steps"]) <= width
    t = client.get("/v1/runs/spiky/tensors/2/series", params={"stat": "amax", "width": width}).json()
    assert max(t["max"]) == 4.0e4
