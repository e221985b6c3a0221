"""The ``fp8guard`` command line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from fp8guard.cli import app
from fp8guard.service.auth.tokens import digest
from fp8guard.service.domain import RunSpec
from fp8guard.service.store import Store

runner = CliRunner()


def test_db_upgrade_then_runs_list(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    r = runner.invoke(app, ["db", "upgrade", "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "revision 0006" in r.output
    store = Store.open(url)
    store.register_run(RunSpec(run_id="cli-run", model="gpt"))
    store.close()
    r = runner.invoke(app, ["runs", "list", "--database-url", url])
    assert r.exit_code == 0 and "cli-run" in r.output
    r = runner.invoke(app, ["runs", "list", "--database-url", url, "--json"])
    assert json.loads(r.output.splitlines()[0])["run_id"] == "cli-run"
    r = runner.invoke(app, ["db", "current", "--database-url", url])
    assert "current: 0006" in r.output


def test_runs_list_on_unmigrated_database_says_what_to_run(tmp_path) -> None:
    r = runner.invoke(app, ["runs", "list", "--database-url", f"sqlite:///{tmp_path / 'empty.db'}"])
    assert r.exit_code == 2
    assert "fp8guard db upgrade --database-url" in r.output


def test_serve_without_migrate_refuses_empty_database(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fp8guard", "serve", "--no-migrate", "--database-url",
         f"sqlite:///{tmp_path / 'none.db'}", "--port", "0"],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "fp8guard db upgrade" in proc.stderr


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    """Through the real entry point (its error boundary), as a user runs it."""
    return subprocess.run([sys.executable, "-m", "fp8guard", *args], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_bad_database_urls_fail_in_one_line() -> None:
    for url, expected in (("mysql://x@y/z", "error: database_url: unsupported database 'mysql'"),
                          ("not a url", "error: database_url: not a database URL"),
                          ("postgresql://nobody@127.0.0.1:1/x", "error: cannot use the database: connection")):
        proc = _cli("serve", "--database-url", url)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.strip().startswith(expected) and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_missing_postgres_database_fails_in_one_line() -> None:
    base = os.environ.get("FP8GUARD_TEST_POSTGRES_URL")
    if not base:
        pytest.skip("needs FP8GUARD_TEST_POSTGRES_URL")
    missing = base.rsplit("/", 1)[0] + "/fp8guard_no_such_database"
    proc = _cli("db", "upgrade", "--database-url", missing)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and 'database "fp8guard_no_such_database" does not exist' in lines[0], proc.stderr


def test_serving_beyond_loopback_without_auth_is_refused(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'open.db'}"
    r = runner.invoke(app, ["serve", "--host", "0.0.0.0", "--auth", "off", "--database-url", url])
    assert r.exit_code == 2 and "refusing to serve on 0.0.0.0 without authentication" in r.output
    r = runner.invoke(app, ["serve", "--host", "127.0.0.1", "--auth", "sometimes", "--database-url", url])
    assert r.exit_code == 2 and "FP8GUARD_AUTH must be one of required, off" in r.output


def test_token_create_list_revoke(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'tokens.db'}"
    assert runner.invoke(app, ["db", "upgrade", "--database-url", url]).exit_code == 0
    r = runner.invoke(app, ["token", "create", "--role", "ingest", "--name", "job-1", "--run-prefix", "job-1-",
                            "--database-url", url])
    assert r.exit_code == 0, r.output
    token = r.stdout.strip().splitlines()[-1]
    assert token.startswith("fp8g_") and len(token) > 40
    store = Store.open(url)
    try:
        record = store.token_by_hash(digest(token))
        assert record is not None and record.name == "job-1" and record.run_prefix == "job-1-"
    finally:
        store.close()
    r = runner.invoke(app, ["token", "list", "--database-url", url])
    assert "job-1" in r.output and token not in r.output and token[:9] in r.output
    r = runner.invoke(app, ["token", "create", "--role", "read", "--name", "x", "--run-prefix", "p", "--database-url", url])
    assert r.exit_code == 2 and "only ingest tokens take a run prefix" in r.output
    r = runner.invoke(app, ["token", "create", "--role", "root", "--name", "x", "--database-url", url])
    assert r.exit_code == 2 and "--role must be one of ingest, read, admin" in r.output
    assert runner.invoke(app, ["token", "revoke", "job-1", "--database-url", url]).exit_code == 0
    r = runner.invoke(app, ["token", "revoke", "job-1", "--database-url", url])
    assert r.exit_code == 2 and "no live token named 'job-1'" in r.output


def test_help_lists_commands() -> None:
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "serve" in r.output and "db" in r.output and "runs" in r.output


@pytest.mark.parametrize("group", [[], ["spool"], ["token"]])
def test_command_lists_show_each_summary_unbroken(group: list[str]) -> None:
    """A command whose docstring's first paragraph spans lines is listed with it as one
    sentence, wrapped to the panel only (Typer's rich help would keep the source's line breaks).
    Backticks are markup (code), shown or not."""
    r = runner.invoke(app, [*group, "--help"], env={"COLUMNS": "400"})  # wide: each summary fits one line
    assert r.exit_code == 0, r.output
    expected = {(): "Run a closed loop on its own, without serving: it judges the batches every serve process "
                    "stored in the database's queue",
                ("spool",): "each file is deleted only once the service acknowledged it.",
                ("token",): "Revoke a token: running services stop honouring it within auth_cache_s (5 s)."}
    assert any(expected[tuple(group)] in " ".join(line.replace("`", "").split())
               for line in r.output.splitlines()), r.output
