"""``fp8guard spool flush``: batches an agent spooled while the service was down, sent later by
the command against the real service (uvicorn in a thread); nothing is lost on the way."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from fp8guard import wire
from fp8guard.agent.transport import HttpTransport, RunInfo
from fp8guard.agent.transport.spool import REGISTRATION_FILE
from fp8guard.cli import app
from fp8guard.service import Settings, create_app
from fp8guard.service.auth.tokens import issue_token
from fp8guard.service.kinds import Role
from fp8guard.service.store import Store
from tests.helpers import app_in_thread, batch

runner = CliRunner()
RUN = RunInfo("spooled-run", model="tiny-gpt", recipe={"kind": "delayed"}, world_size=1, config={"lr": 3e-4})
DOWN = "http://127.0.0.1:1"  # nothing listens on port 1: every request is refused at once


def spool_while_down(spool: Path, n: int) -> list[Path]:
    """A real agent transport whose service never answered: the run was never registered, and
    every batch (ten steps each, the tensor table in the first) went to the spool."""
    t = HttpTransport(DOWN, RUN, spool_dir=spool, max_attempts=1, sleep=lambda s: None, drain_s=1.0)
    for i in range(n):
        t.send(batch(RUN.run_id, list(range(10 * i, 10 * i + 10)), define_tensors=i == 0))
    t.close()
    assert t.stats().sent_batches == 0
    files = sorted(spool.glob("*.json.gz"))
    assert len(files) == n and (spool / REGISTRATION_FILE).is_file()
    return files


def flush(*args: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    r = runner.invoke(app, ["spool", "flush", *args], env=env)
    return r.exit_code, r.output.strip().splitlines()


def loss_steps(base: str, run_id: str) -> list[int]:
    answer = httpx.get(f"{base}/v1/runs/{run_id}/scalars", params={"fields": "loss"})
    assert answer.status_code == 200, answer.text
    steps: list[int] = answer.json()["steps"]
    return steps


def test_a_run_only_the_spool_knows_is_registered_stored_and_flushed_once(migrated_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    files = spool_while_down(spool, 3)
    keep = tmp_path / "copy.json.gz"
    shutil.copy(files[1], keep)
    with app_in_thread(create_app(Settings(database_url=migrated_url, auth="off"))) as base:
        code, lines = flush("--url", base, "--spool-dir", str(spool), "--dry-run")
        assert code == 0 and lines[0].startswith(f"spooled-run  {spool}: 3 batches") and "registration kept" in lines[0]
        assert lines[-1] == "1 spools, 3 batches; nothing sent (--dry-run)" and len(list(spool.iterdir())) == 4

        code, lines = flush("--url", base, "--spool-dir", str(spool))
        assert code == 0, lines
        assert lines == [f"spooled-run  {spool}: 3 sent, 0 refused, 0 left",
                         "3 batches sent (0 already stored), 0 refused, 0 left in the spool"]
        assert not spool.exists()  # emptied: the registration and the folder go too
        run = httpx.get(f"{base}/v1/runs/spooled-run").json()
        assert (run["model"], run["world_size"], run["recipe"]) == ("tiny-gpt", 1, {"kind": "delayed"})
        assert loss_steps(base, "spooled-run") == list(range(30))

        # A second run finds nothing; a file sent before (a flush killed between the service's
        # answer and the delete) is acknowledged as a duplicate and stored once.
        code, lines = flush("--url", base, "--spool-dir", str(spool.parent))
        assert code == 0 and lines == ["nothing spooled in " + str(spool.parent)]
        spool.mkdir()
        shutil.copy(keep, spool / files[1].name)
        code, lines = flush("--url", base, "--spool-dir", str(spool))
        assert code == 0 and lines[-1] == "1 batches sent (1 already stored), 0 refused, 0 left in the spool"
        assert loss_steps(base, "spooled-run") == list(range(30))


def test_a_refused_batch_is_kept_and_reported_while_the_others_are_sent(migrated_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool_while_down(spool, 3)
    # A body the service refuses for what it is (a loss that is no number), between good ones.
    bad = wire.make_batch(run_id=RUN.run_id, batch_id="bad-one", steps=[{"step": 99, "loss": 1.0}])
    bad["steps"][0]["loss"] = "NaN please"
    bad_file = spool / "000000000002.json.gz"
    (spool / "000000000002.json.gz").rename(spool / "000000000004.json.gz")  # keep the good one, later
    bad_file.write_bytes(gzip.compress(wire.dumps(bad)))
    with app_in_thread(create_app(Settings(database_url=migrated_url, auth="off"))) as base:
        code, lines = flush("--url", base, "--spool-dir", str(spool))
        assert code == 1
        assert lines[0] == f"spooled-run  {spool}: 3 sent, 1 refused, 1 left"
        assert lines[1].startswith(f"  refused {bad_file}: HTTP 422: ") and "loss" in lines[1]
        assert lines[-1] == "3 batches sent (0 already stored), 1 refused, 1 left in the spool"
        assert sorted(p.name for p in spool.iterdir()) == ["000000000002.json.gz", REGISTRATION_FILE]
        assert loss_steps(base, "spooled-run") == list(range(30))
        # Refused again next time, still kept: the person decides what to do with it.
        code, lines = flush("--url", base, "--spool-dir", str(spool))
        assert code == 1 and lines[-1] == "0 batches sent (0 already stored), 1 refused, 1 left in the spool"
        assert bad_file.exists()


def test_a_refused_token_stops_in_one_line_and_loses_nothing(migrated_url: str, tmp_path: Path) -> None:
    spool = tmp_path / "spool"
    spool_while_down(spool, 2)
    store = Store.open(migrated_url)
    try:
        token, _ = issue_token(store, name="flusher", role=Role.INGEST, run_prefix="spooled-")
    finally:
        store.close()
    with app_in_thread(create_app(Settings(database_url=migrated_url, auth="required"))) as base:
        code, lines = flush("--url", base, "--spool-dir", str(spool), env={"FP8GUARD_TOKEN": ""})
        assert code == 1
        assert lines[0].startswith(f"spooled-run  {spool}: 0 sent, 0 refused, 2 left; stopped: ")
        assert "401" in lines[0] and "--token or $FP8GUARD_TOKEN" in lines[0]
        assert len(list(spool.glob("*.json.gz"))) == 2
        code, lines = flush("--url", base, "--spool-dir", str(spool), env={"FP8GUARD_TOKEN": token})
        assert code == 0 and lines[-1] == "2 batches sent (0 already stored), 0 refused, 0 left in the spool"


def test_an_unreachable_service_keeps_everything_and_says_so(tmp_path: Path) -> None:
    for run_id in ("a-run", "b-run"):
        spool_while_down_as(tmp_path / "root" / run_id / "rank-0", run_id)
    code, lines = flush("--url", DOWN, "--spool-dir", str(tmp_path / "root"), "--attempts", "1")
    assert code == 1
    assert lines[0].startswith(f"a-run  {tmp_path / 'root' / 'a-run' / 'rank-0'}: 0 sent, 0 refused, 1 left; "
                               "stopped: registering the run: ConnectError")
    assert lines[1] == f"b-run  {tmp_path / 'root' / 'b-run' / 'rank-0'}: not tried, 1 left"
    assert lines[-1] == "0 batches sent (0 already stored), 0 refused, 2 left in the spool"
    assert len(list((tmp_path / "root").rglob("*.json.gz"))) == 2


def spool_while_down_as(spool: Path, run_id: str) -> None:
    t = HttpTransport(DOWN, RunInfo(run_id), spool_dir=spool, max_attempts=1, sleep=lambda s: None, drain_s=1.0)
    t.send(batch(run_id, [0, 1]))
    t.close()


@pytest.mark.parametrize(("args", "expected"), [
    (["--url", "ftp://x"], "error: --url must start with http:// or https://, not 'ftp://x'"),
    (["--spool-dir", "/no/such/folder"], "error: no spool folder at /no/such/folder"),
])
def test_bad_options_fail_in_one_line(args: list[str], expected: str) -> None:
    code, lines = flush(*args)
    assert code == 2 and lines == [expected]
