"""The loop keeps each (run, rank)'s detector between passes, and reuses it only while the state
stored in the database is exactly the one it saved."""

from __future__ import annotations

import json

import numpy as np

from fp8guard.service.domain import StatBlock, StepRow
from fp8guard.service.loop.config import GuardConfig
from fp8guard.service.loop.detector import Detector, TensorMeta
from fp8guard.service.loop.judge import DetectorCache

METAS = [TensorMeta(name=f"l{i}:fwd_input", module=f"l{i}", backward=False, fp8_max=448.0) for i in range(3)]


def _fed(cfg: GuardConfig) -> tuple[Detector, str]:
    det = Detector(cfg, METAS)
    steps = [StepRow(step=s, time=0.0, tokens=None, loss=2.0, grad_norm=1.0) for s in range(5)]
    values = np.ones((5, 1, 3), dtype=np.float32)
    det.observe(steps, [StatBlock(stats=("amax",), steps=np.arange(5), values=values)])
    return det, json.dumps(det.state_dict(), allow_nan=False)


def test_a_kept_detector_is_reused_while_the_stored_state_is_its_own() -> None:
    cfg, cache = GuardConfig(), DetectorCache()
    det, text = _fed(cfg)
    cache.keep((1, 0), cfg, METAS, text, det)
    assert cache.take((1, 0), cfg, METAS, text) is det
    # take() removed it: a pass that fails after changing the detector leaves nothing behind
    again = cache.take((1, 0), cfg, METAS, text)
    assert again is not det and again.state_dict() == det.state_dict()


def test_another_writer_or_a_rollback_makes_it_read_the_stored_state() -> None:
    cfg, cache = GuardConfig(), DetectorCache()
    det, text = _fed(cfg)
    other = Detector(cfg, METAS)  # what another process saved (or the state before a rolled-back pass)
    stored = json.dumps(other.state_dict(), allow_nan=False)
    cache.keep((1, 0), cfg, METAS, text, det)
    got = cache.take((1, 0), cfg, METAS, stored)
    assert got is not det and got.state_dict() == other.state_dict()


def test_a_changed_guard_or_tensor_table_builds_a_new_detector() -> None:
    cfg, cache = GuardConfig(), DetectorCache()
    det, text = _fed(cfg)
    cache.keep((1, 0), cfg, METAS, text, det)
    stricter = GuardConfig.model_validate({"saturation_fwd": 3.0})
    assert cache.take((1, 0), stricter, METAS, text).config is stricter
    cache.keep((1, 0), cfg, METAS, text, det)
    assert cache.take((1, 0), cfg, [*METAS], text) is not det
    assert cache.take((2, 0), cfg, METAS, None).state_dict()["loss_hist"] == []


def test_the_cache_is_bounded() -> None:
    cfg, cache = GuardConfig(), DetectorCache(size=2)
    det, text = _fed(cfg)
    for run in range(3):
        cache.keep((run, 0), cfg, METAS, text, det)
    assert cache.take((0, 0), cfg, METAS, text) is not det  # the oldest went
    assert cache.take((2, 0), cfg, METAS, text) is det
