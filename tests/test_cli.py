"""The ``fp8guard`` command line."""

from __future__ import annotations

import json
import subprocess
import sys

from typer.testing import CliRunner

from fp8guard.cli import app
from fp8guard.service.domain import RunSpec
from fp8guard.service.store import Store

runner = CliRunner()


def test_db_upgrade_then_runs_list(tmp_path) -> None:
    url = f"sqlite:///{tmp_path / 'cli.db'}"
    r = runner.invoke(app, ["db", "upgrade", "--database-url", url])
    assert r.exit_code == 0, r.output
    assert "revision 0004" in r.output
    store = Store.open(url)
    store.register_run(RunSpec(run_id="cli-run", model="gpt"))
    store.close()
    r = runner.invoke(app, ["runs", "list", "--database-url", url])
    assert r.exit_code == 0 and "cli-run" in r.output
    r = runner.invoke(app, ["runs", "list", "--database-url", url, "--json"])
    assert json.loads(r.output.splitlines()[0])["run_id"] == "cli-run"
    r = runner.invoke(app, ["db", "current", "--database-url", url])
    assert "current: 0004" in r.output


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


def test_serve_rejects_unsupported_database() -> None:
    r = runner.invoke(app, ["serve", "--database-url", "mysql://x@y/z"])
    assert r.exit_code == 2 and "unsupported database" in r.output


def test_help_lists_commands() -> None:
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "serve" in r.output and "db" in r.output and "runs" in r.output
