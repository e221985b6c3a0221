"""docs/gpu.md names the result file behind each figure: every file it names is in the repository.

A figure's file is written in backticks next to it (``gpu_heal_1e6.2026-12-03c.json``); a name
with ``*`` stands for a family of files and must match at least one; ``a.run1..4.json`` stands
for ``a.run1.json`` to ``a.run4.json``.
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "gpu-results"
_NAME = re.compile(r"`([A-Za-z0-9_*][A-Za-z0-9_.\-*]*\.(?:json|log|png|txt))`")
_RANGE = re.compile(r"^(?P<head>.*?)(?P<lo>\d+)\.\.(?P<hi>\d+)(?P<tail>\..*)$")


def _expand(name: str) -> list[str]:
    m = _RANGE.match(name)
    if m is None:
        return [name]
    return [f"{m['head']}{i}{m['tail']}" for i in range(int(m["lo"]), int(m["hi"]) + 1)]


def test_every_result_file_named_in_the_gpu_page_exists() -> None:
    have = sorted(p.name for p in RESULTS.iterdir())
    named = sorted(set(_NAME.findall((ROOT / "docs" / "gpu.md").read_text())))
    assert len(named) > 50  # the page cites its files; a pattern that matched nothing would pass anything
    missing = [n for name in named for n in _expand(name)
               if not (fnmatch.filter(have, n) if "*" in n else n in have)]
    assert not missing, f"docs/gpu.md names result files that docs/gpu-results/ lacks: {missing}"


def test_the_range_and_family_forms_expand() -> None:
    assert _expand("gpu_counts_time.run1..4.json") == [f"gpu_counts_time.run{i}.json" for i in range(1, 5)]
    assert _expand("te_tests.log") == ["te_tests.log"]
