"""The ``fp8guard`` command line. Heavy imports happen inside commands, so ``--help`` is fast."""

from __future__ import annotations

import gc
import json
import sys
from typing import TYPE_CHECKING, Annotated

import typer

if TYPE_CHECKING:
    from fp8guard.service.settings import AuthMode
    from fp8guard.service.store import Store

__all__ = ["app", "main"]

SWITCH_INTERVAL_S = 0.0005
"""``fp8guard serve``'s GIL switch interval (the default 5 ms showed in one agent's round trip: docs/benchmarks.md)."""

# Markdown: a docstring's paragraph is rewrapped to the terminal (Typer's default rich mode keeps
# the source's line breaks in the command lists, breaking summaries mid-sentence)
app = typer.Typer(help="fp8guard: watch and heal FP8 training runs.", no_args_is_help=True,
                  pretty_exceptions_enable=False, rich_markup_mode="markdown")
db_app = typer.Typer(help="Database schema management.", no_args_is_help=True)
runs_app = typer.Typer(help="Inspect stored runs.", no_args_is_help=True)
token_app = typer.Typer(help="API tokens: create (shown once), list, revoke.", no_args_is_help=True)
spool_app = typer.Typer(help="The agent's spool: batches it kept while the service was unreachable.",
                        no_args_is_help=True)
app.add_typer(db_app, name="db")
app.add_typer(runs_app, name="runs")
app.add_typer(token_app, name="token")
app.add_typer(spool_app, name="spool")

DatabaseUrl = Annotated[
    str | None,
    typer.Option("--database-url", envvar="FP8GUARD_DATABASE_URL",
                 help="sqlite:///file.db or postgresql://user@host/db (default: a SQLite file in your data dir)"),
]


def _url(url: str | None) -> str:
    _need("service", "fastapi", "sqlalchemy", "alembic")
    from fp8guard.service.settings import default_database_url

    return url or default_database_url()


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code=2)


def _need(extra: str, *modules: str) -> None:
    """Fail in one line when this install lacks what a command needs (``fp8guard[service]`` ...)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise _fail(f"this command needs {', '.join(missing)}: pip install 'fp8guard[{extra}]'")


def _one_line(exc: BaseException) -> str | None:
    """The message of a configuration or connection error a person can act on, or None."""
    try:
        from pydantic import ValidationError
        from sqlalchemy.exc import ArgumentError, OperationalError
    except ImportError:
        return None
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(map(str, e['loc']))}: {str(e['msg']).removeprefix('Value error, ')}"
                         for e in exc.errors(include_url=False))
    if isinstance(exc, OperationalError):
        reason = str(exc.orig).strip().splitlines()[0] if exc.orig is not None else str(exc)
        return f"cannot use the database: {reason}"
    if isinstance(exc, ArgumentError):
        return f"not a database URL: {exc}"
    return None


def _auth_mode(explicit: str | None, host: str, insecure: bool) -> AuthMode:
    """``FP8GUARD_AUTH``/``--auth`` if given, else required beyond loopback and off on it; off
    beyond loopback only with ``--insecure``."""
    from fp8guard.service.settings import AuthMode, is_loopback

    try:
        mode = AuthMode(explicit) if explicit else (AuthMode.OFF if is_loopback(host) else AuthMode.REQUIRED)
    except ValueError:
        raise _fail(f"FP8GUARD_AUTH must be one of {', '.join(AuthMode)}, not {explicit!r}") from None
    if mode is AuthMode.OFF and not is_loopback(host) and not insecure:
        raise _fail(f"refusing to serve on {host} without authentication: anyone who reaches the port could "
                    "steer your runs. Create tokens (fp8guard token create) and drop FP8GUARD_AUTH=off, "
                    "or pass --insecure")
    return mode


@app.command()
def serve(
    database_url: DatabaseUrl = None,
    host: Annotated[str, typer.Option(help="interface to listen on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8000,
    migrate: Annotated[bool, typer.Option(help="bring the schema to head before serving")] = True,
    log_level: Annotated[str, typer.Option(help="uvicorn log level")] = "info",
    auth: Annotated[str | None, typer.Option(envvar="FP8GUARD_AUTH", show_default=False,
                                             help="required | off (default: required unless HOST is loopback)")] = None,
    insecure: Annotated[bool, typer.Option(help="allow --auth off beyond loopback")] = False,
    loop_process: Annotated[bool, typer.Option("--loop-process/--loop-threads", envvar="FP8GUARD_LOOP_PROCESS",
                                               help="run the closed loop in a child process, or in threads "
                                                    "of this one (default; see Settings.loop_process)")] = False,
) -> None:
    """Run the service. Several `serve` processes may share one PostgreSQL database."""
    _need("service", "fastapi", "sqlalchemy", "uvicorn")
    import uvicorn

    from fp8guard.service import Settings, create_app
    from fp8guard.service.errors import SchemaNotAtHead
    from fp8guard.service.store import make_engine, upgrade

    url = _url(database_url)
    mode = _auth_mode(auth, host, insecure)
    settings = Settings(database_url=url, auth=mode, loop_process=loop_process)
    if migrate:
        # Before uvicorn starts, never in a worker, so processes do not race to migrate.
        engine = make_engine(url)
        upgrade(engine)
        engine.dispose()
    try:
        service = create_app(settings)
    except SchemaNotAtHead as exc:
        raise _fail(str(exc)) from None
    typer.echo(f"fp8guard serving on http://{host}:{port} (database: {settings.database_url}, auth: {mode.value})",
               err=True)
    if mode == "required" and not service.state.store.tokens():
        typer.echo("no tokens yet: create one with  fp8guard token create --role admin --name you "
                   f"--database-url '{settings.database_url}'", err=True)
    # The request, ingest-writer and loop threads hand work to each other for every batch; with
    # CPython's default 5 ms GIL switch interval each hand-off could wait that long.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    # Everything built so far (the app, SQLAlchemy's and pydantic's machinery: ~135,000 objects)
    # lives as long as the process: out of the collector's sight, a full collection no longer
    # walks them (it took 110-320 ms, every thread stopped, under 50 agents: docs/benchmarks.md).
    gc.collect()
    gc.freeze()
    uvicorn.run(service, host=host, port=port, log_level=log_level)


@app.command()
def loop(database_url: DatabaseUrl = None) -> None:
    """Run a closed loop on its own, without serving: it judges the batches every `serve` process
    stored in the database's queue (found by its sweep, every FP8GUARD_LOOP_SWEEP_INTERVAL_S), until
    SIGTERM or Ctrl-C. More judging capacity for several `serve` processes on one PostgreSQL."""
    _need("service", "fastapi", "sqlalchemy")
    from fp8guard.service import Settings
    from fp8guard.service.errors import SchemaNotAtHead
    from fp8guard.service.loop.process import run_loop

    try:
        settings = Settings(database_url=_url(database_url))
        typer.echo(f"fp8guard loop judging (database: {settings.database_url})", err=True)
        run_loop(settings, None)
    except SchemaNotAtHead as exc:
        raise _fail(str(exc)) from None


@app.command()
def demo(
    exit_after: Annotated[bool, typer.Option("--exit", help="finish after the summary; last line is JSON")] = False,
    compare: Annotated[bool, typer.Option(help="also train the same run unguarded, for the final loss")] = False,
    steps: Annotated[int, typer.Option(min=200, help="training steps")] = 300,
    seed: Annotated[int, typer.Option(help="random seed")] = 0,
    host: Annotated[str, typer.Option(help="interface the demo service listens on")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="port (a free one is taken if busy)")] = 8000,
    database_url: DatabaseUrl = None,
) -> None:
    """Train a small GPT in emulated FP8, inject an instability, watch fp8guard heal it."""
    _need("all", "torch", "httpx", "fastapi", "sqlalchemy")
    import logging

    from fp8guard.demo import DemoConfig, print_summary, run_demo

    logging.basicConfig(level=logging.ERROR)
    cfg = DemoConfig(steps=steps, seed=seed, host=host, port=port, compare=compare,
                     database_url=database_url, progress=True)
    typer.echo("fp8guard demo: a byte-level GPT on the Python standard library's sources, emulated FP8 "
               "(E4M3/E5M2, delayed scaling). Injected: activation outliers in data batches "
               f"{cfg.poison_start}-{cfg.poison_start + cfg.poison_batches - 1}, and a learning rate "
               f"{cfg.lr_burst_factor:g}x too high for steps {cfg.lr_burst_start}-"
               f"{cfg.lr_burst_start + cfg.lr_burst_steps - 1}.", err=True)
    result = run_demo(cfg)
    service = result.__dict__.pop("_service")
    print_summary(result, lambda line: typer.echo(line, err=True))
    typer.echo(f"Dashboard: {result.url}/runs/{result.run_id}   (all runs: {result.url}/, API: {result.url}/docs)",
               err=True)
    if service.read_token:
        typer.echo(f"Sign in to the dashboard with this read token: {service.read_token}", err=True)
    if exit_after:
        service.close()
        typer.echo(json.dumps(result.summary_json()))
        return
    typer.echo("Serving until Ctrl-C.", err=True)
    try:
        while service.thread.is_alive():
            service.thread.join(timeout=1.0)
    except KeyboardInterrupt:
        pass
    finally:
        service.close()


@db_app.command("upgrade")
def db_upgrade(
    database_url: DatabaseUrl = None,
    revision: Annotated[str, typer.Option(help="target revision")] = "head",
) -> None:
    """Apply migrations up to REVISION (default: head)."""
    from fp8guard.service.store import make_engine, upgrade
    from fp8guard.service.store.engine import current_revision

    url = _url(database_url)
    engine = make_engine(url)
    upgrade(engine, revision)
    typer.echo(f"database at revision {current_revision(engine)}")
    engine.dispose()


@db_app.command("current")
def db_current(database_url: DatabaseUrl = None) -> None:
    """Print the schema revision of the database and the newest one this fp8guard knows."""
    from fp8guard.service.store import make_engine
    from fp8guard.service.store.engine import current_revision, head_revision

    engine = make_engine(_url(database_url))
    typer.echo(f"current: {current_revision(engine) or '(empty)'}  head: {head_revision()}")
    engine.dispose()


@runs_app.command("list")
def runs_list(
    database_url: DatabaseUrl = None,
    status: Annotated[str | None, typer.Option(help="running | finished | failed")] = None,
    limit: Annotated[int, typer.Option(min=1, max=10_000)] = 50,
    as_json: Annotated[bool, typer.Option("--json", help="one JSON object per line")] = False,
) -> None:
    """List runs, most recently active first."""
    from fp8guard.wire import encode_float

    store = _store(database_url)
    runs = store.runs(status=status, limit=limit)
    store.close()
    if as_json:
        for r in runs:
            typer.echo(json.dumps({"run_id": r.run_id, "model": r.model, "status": r.status,
                                   "last_step": r.last_step, "last_loss": encode_float(r.last_loss),
                                   "samples": r.samples, "updated_at": r.updated_at.isoformat()}))
        return
    typer.echo(f"{'RUN':<32} {'STATUS':<9} {'STEP':>9} {'LOSS':>10} {'SAMPLES':>12}  UPDATED")
    for r in runs:
        loss = "-" if r.last_loss is None else f"{r.last_loss:.4g}"
        step = "-" if r.last_step is None else str(r.last_step)
        typer.echo(f"{r.run_id:<32} {r.status:<9} {step:>9} {loss:>10} {r.samples:>12}  "
                   f"{r.updated_at:%Y-%m-%d %H:%M:%S}")


def _store(url: str | None) -> Store:
    from fp8guard.service.errors import SchemaNotAtHead
    from fp8guard.service.store import Store

    try:
        return Store.open(_url(url))
    except SchemaNotAtHead as exc:
        raise _fail(str(exc)) from None


@token_app.command("create")
def token_create(
    role: Annotated[str, typer.Option(help="ingest | read | admin")],
    name: Annotated[str, typer.Option(help="who or what holds it (audit events name it)")],
    run_prefix: Annotated[str | None, typer.Option(help="ingest tokens: the run ids it may write")] = None,
    database_url: DatabaseUrl = None,
) -> None:
    """Create a token and print it, alone, on the last line: it is shown this once."""
    from fp8guard.service.auth.tokens import issue_token
    from fp8guard.service.errors import ServiceError
    from fp8guard.service.kinds import Role

    try:
        parsed = Role(role)
    except ValueError:
        raise _fail(f"--role must be one of {', '.join(Role)}, not {role!r}") from None
    store = _store(database_url)
    try:
        secret, record = issue_token(store, name=name, role=parsed, run_prefix=run_prefix)
    except ServiceError as exc:
        raise _fail(exc.message) from None
    finally:
        store.close()
    scope = f", runs starting with {record.run_prefix!r}" if record.run_prefix else ""
    typer.echo(f"created {record.role} token {record.name!r}{scope}; keep it secret, it is not shown again:", err=True)
    typer.echo(secret)


@token_app.command("list")
def token_list(
    database_url: DatabaseUrl = None,
    revoked: Annotated[bool, typer.Option(help="include revoked tokens")] = False,
) -> None:
    """List tokens (names, roles, scopes and hints; never secrets)."""
    store = _store(database_url)
    records = store.tokens(include_revoked=revoked)
    store.close()
    typer.echo(f"{'NAME':<24} {'ROLE':<7} {'RUN PREFIX':<20} {'HINT':<12} {'CREATED':<19}  REVOKED")
    for t in records:
        revoked_at = "-" if t.revoked_at is None else f"{t.revoked_at:%Y-%m-%d %H:%M:%S}"
        typer.echo(f"{t.name:<24} {t.role:<7} {t.run_prefix or '-':<20} {t.hint:<12} "
                   f"{t.created_at:%Y-%m-%d %H:%M:%S}  {revoked_at}")


@token_app.command("revoke")
def token_revoke(
    name: Annotated[str, typer.Argument(help="the token's name")],
    database_url: DatabaseUrl = None,
) -> None:
    """Revoke a token: running services stop honouring it within auth_cache_s (5 s)."""
    from fp8guard.service.errors import ServiceError

    store = _store(database_url)
    try:
        record = store.revoke_token(name)
    except ServiceError as exc:
        raise _fail(exc.message) from None
    finally:
        store.close()
    typer.echo(f"revoked {record.role} token {record.name!r}")


@spool_app.command("flush")
def spool_flush(
    url: Annotated[str, typer.Option(envvar="FP8GUARD_URL", help="the fp8guard service")] = "http://127.0.0.1:8000",
    spool_dir: Annotated[str | None, typer.Option(
        "--spool-dir", show_default=False,
        help="a spool folder, or a folder of them (default: the agent's, <user cache>/fp8guard/spool)")] = None,
    token: Annotated[str | None, typer.Option(envvar="FP8GUARD_TOKEN", show_default=False,
                                              help="an ingest token (default: $FP8GUARD_TOKEN)")] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="list the spools and send nothing")] = False,
    attempts: Annotated[int, typer.Option(min=1, max=20, help="tries per batch on transient failures")] = 3,
) -> None:
    """Send spooled batches to the service, oldest first; each file is deleted only once the
    service acknowledged it. Refused batches stay (listed); safe to run again."""
    _need("agent", "httpx")
    import logging
    from pathlib import Path

    from fp8guard.agent.transport.flush import default_spool_roots, find_spools, flush_spool
    from fp8guard.agent.transport.private_dir import user_cache_root

    if not url.startswith(("http://", "https://")):
        raise _fail(f"--url must start with http:// or https://, not {url!r}")
    if token is not None and (not token.strip() or "\n" in token):
        raise _fail("--token (or $FP8GUARD_TOKEN) must be a non-empty single line")
    if spool_dir is not None and not Path(spool_dir).is_dir():
        raise _fail(f"no spool folder at {spool_dir}")
    roots = [Path(spool_dir)] if spool_dir is not None else default_spool_roots()
    spools = [s for root in roots for s in find_spools(root)]
    if not spools:
        typer.echo(f"nothing spooled in {', '.join(map(str, roots or [user_cache_root() / 'spool']))}")
        return
    if dry_run:
        for s in spools:
            registration = "registration kept" if s.run is not None else "no registration (run must exist)"
            typer.echo(f"{s.run_id}  {s.directory}: {len(s.files)} batches, {s.size / 1024:.1f} KiB, {registration}")
        typer.echo(f"{len(spools)} spools, {sum(len(s.files) for s in spools)} batches; nothing sent (--dry-run)")
        return
    transport_log = logging.getLogger("fp8guard.agent.transport")
    level = transport_log.level
    transport_log.setLevel(logging.CRITICAL)  # the lines below say it all, without the agent's advice
    sent = duplicates = refused = left = 0
    try:
        for n, s in enumerate(spools):
            report = flush_spool(s, url=url, token=token, attempts=attempts)
            sent, duplicates = sent + report.sent, duplicates + report.duplicates
            refused, left = refused + len(report.refused), left + report.left
            line = (f"{s.run_id}  {s.directory}: {report.sent} sent"
                    f"{f' ({report.duplicates} already stored)' if report.duplicates else ''}, "
                    f"{len(report.refused)} refused, {report.left} left")
            if report.stopped is not None:
                line += f"; stopped: {report.stopped}{_flush_hint(report.stopped)}"
            typer.echo(line)
            for path, reason in report.refused:
                typer.echo(f"  refused {path}: {reason}")
            if report.unanswered:  # the service does not answer: the next spools would wait for nothing
                for later in spools[n + 1:]:
                    left += len(later.files)
                    typer.echo(f"{later.run_id}  {later.directory}: not tried, {len(later.files)} left")
                break
    finally:
        transport_log.setLevel(level)
    typer.echo(f"{sent} batches sent ({duplicates} already stored), {refused} refused, {left} left in the spool")
    if left:
        raise typer.Exit(code=1)


def _flush_hint(reason: str) -> str:
    if "401" in reason:
        return " (pass an ingest token: --token or $FP8GUARD_TOKEN)"
    if "403" in reason:
        return " (the token lacks the ingest role or is not scoped to this run)"
    if "404" in reason:
        return " (the service does not know the run, and this spool kept no registration)"
    return ""


def main() -> None:
    """The entry point: configuration and connection errors end in one line, not a traceback."""
    try:
        app()
    except Exception as exc:
        message = _one_line(exc)
        if message is None:
            raise
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
