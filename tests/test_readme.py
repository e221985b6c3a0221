"""Every Python block of README.md runs as is, against a real service started here.

A block runs in a fresh interpreter in an empty folder, with ``FP8GUARD_URL`` pointing at the
real app (SQLite, under uvicorn in a thread), as a reader who exported it would run it. A block
that needs hardware or a library this machine may lack says so on the line before its fence,
in a comment the page does not show::

    <!-- readme-test: needs cuda, transformer_engine -->

and is skipped here, with the reason, when one of them is missing. The agent quickstart's
block is also the proof that a plain loop heals with the lines it marks ``# fp8guard``: the
injected incident must end in an applied rollback, and the loop must reach its step budget.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from fp8guard.service import Settings, create_app
from fp8guard.service.store import make_engine, upgrade
from tests.helpers import app_in_thread

pytest.importorskip("torch")

README = Path(__file__).resolve().parents[1] / "README.md"
_FENCE = re.compile(r"^```(\w*)\s*$")
_NEEDS = re.compile(r"^<!--\s*readme-test:\s*needs\s+(?P<needs>[\w ,.-]+?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    line: int
    """1-based line of the opening fence."""
    language: str
    code: str
    needs: tuple[str, ...] = ()


def blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text, with the needs their marker line declares."""
    out: list[Block] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        start, language = i, m.group(1)
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith("```"):
            body.append(lines[i])
            i += 1
        marker = _NEEDS.match(lines[start - 1]) if start > 0 else None
        needs = tuple(n for n in re.split(r"[\s,]+", marker.group("needs")) if n) if marker else ()
        out.append(Block(line=start + 1, language=language, code="\n".join(body) + "\n", needs=needs))
        i += 1
    return out


def missing(needs: tuple[str, ...]) -> list[str]:
    """The needs this machine does not meet: ``cuda`` (a GPU torch can use) or an importable module."""
    lacking = []
    for need in needs:
        if need == "cuda":
            import torch

            if not torch.cuda.is_available():
                lacking.append("a CUDA GPU")
        elif importlib.util.find_spec(need) is None:
            lacking.append(need)
    return lacking


PYTHON = [b for b in blocks(README.read_text()) if b.language == "python"]


def test_the_readme_has_python_blocks_and_the_marker_is_recognised() -> None:
    assert len(PYTHON) >= 2
    sample = "text\n<!-- readme-test: needs cuda, transformer_engine -->\n```python\nimport x\n```\n"
    (block,) = blocks(sample)
    assert block.needs == ("cuda", "transformer_engine") and block.code == "import x\n" and block.line == 3
    assert missing(("a_module_that_is_not_installed",)) == ["a_module_that_is_not_installed"]


@pytest.fixture()
def service(tmp_path: Path) -> object:
    url = f"sqlite:///{tmp_path / 'readme.db'}"
    engine = make_engine(url)
    upgrade(engine)
    engine.dispose()
    with app_in_thread(create_app(Settings(database_url=url, auth="off"))) as base:
        yield base


@pytest.mark.slow
@pytest.mark.parametrize("block", PYTHON, ids=[f"README.md:{b.line}" for b in PYTHON])
def test_readme_block_runs_as_is(block: Block, service: str, tmp_path: Path) -> None:
    lacking = missing(block.needs)
    if lacking:
        pytest.skip(f"README.md:{block.line} needs {', '.join(lacking)}")
    work = tmp_path / "work"
    work.mkdir()
    env = {**os.environ, "FP8GUARD_URL": service, "PYTHONUNBUFFERED": "1"}
    env.pop("FP8GUARD_TOKEN", None)
    env.pop("FP8GUARD_RUN_ID", None)
    proc = subprocess.run([sys.executable, "-c", block.code], cwd=work, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"README.md:{block.line} failed:\n{proc.stderr[-4000:]}"
    if "heal=HealConfig" in block.code:
        _assert_healed(block, proc, service)


def _assert_healed(block: Block, proc: subprocess.CompletedProcess[str], service: str) -> None:
    marked = [line for line in block.code.splitlines() if line.rstrip().endswith("# fp8guard")]
    assert len(marked) <= 5, marked  # healing in at most five added lines
    with httpx.Client(base_url=service, timeout=30) as api:
        (run,) = api.get("/v1/runs").json()
        actions = api.get(f"/v1/runs/{run['run_id']}/actions").json()
        events = api.get(f"/v1/runs/{run['run_id']}/events").json()
    rollbacks = [a for a in actions if a["kind"] == "rollback"]
    assert rollbacks and all(a["status"] == "applied" for a in rollbacks), actions
    applied = [e for e in events if e["kind"] == "rollback_applied"]
    assert applied and applied[0]["data"]["checkpoint_step"] < 100 <= applied[0]["step"]
    assert any(e["kind"] == "checkpoint_saved" for e in events)
    assert "restored the checkpoint of step" in proc.stderr
    steps, last = re.search(r"(\d+) steps, last loss ([\d.]+)", proc.stdout).groups()  # type: ignore[union-attr]
    assert int(steps) == 200 and float(last) < 2.0  # the budget reached, the loss back to normal (not ~1e5)
    assert run["status"] == "finished"
