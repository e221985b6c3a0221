#!/usr/bin/env bash
# The README's test command. On a fresh machine it does all the set-up, then runs every check:
#   bash tests/run.sh            (extra arguments go to pytest)
set -euo pipefail
cd "$(dirname "$0")/.."

# PostgreSQL: the store and API tests run on it for real. Start the local cluster if it is down.
PG_URL=${FP8GUARD_TEST_POSTGRES_URL:-postgresql://postgres@127.0.0.1:5432/test}
if command -v pg_isready >/dev/null && ! pg_isready -h 127.0.0.1 -p 5432 -q; then
  if command -v pg_ctlcluster >/dev/null; then
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
    for _ in $(seq 30); do pg_isready -h 127.0.0.1 -p 5432 -q && break; sleep 1; done
  fi
fi
if command -v pg_isready >/dev/null && pg_isready -h 127.0.0.1 -p 5432 -q; then
  export FP8GUARD_TEST_POSTGRES_URL=$PG_URL
fi
# In CI the PostgreSQL tests must run, never skip.
if [ "${CI:-}" = "true" ]; then export FP8GUARD_REQUIRE_POSTGRES=1; fi

SUDO=""
if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then SUDO="sudo -n"; fi
# Prometheus and promtool: the metrics tests lint the exposition, check and unit-test the alerting
# rules, and let a real Prometheus scrape the service.
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
  if ! { command -v apt-get >/dev/null && $SUDO apt-get update -qq \
         && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus; }; then
    if [ "${CI:-}" = "true" ]; then echo "cannot install prometheus" >&2; exit 1; fi
    echo "warning: could not install prometheus; the promtool/Prometheus tests will skip" >&2
  fi
fi
# Chromium for the browser tests (Debian's; Playwright drives it by path and never downloads one).
if ! command -v chromium >/dev/null; then
  if ! { command -v apt-get >/dev/null && $SUDO apt-get update -qq \
         && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; }; then
    if [ "${CI:-}" = "true" ]; then echo "cannot install chromium" >&2; exit 1; fi
    echo "warning: could not install chromium; the browser tests will skip" >&2
  fi
fi
# Alertmanager: tests/service/test_alertmanager.py starts a real one (Debian installs the binary as
# prometheus-alertmanager). Install it when missing; outside CI a failed install only skips those tests.
if ! command -v alertmanager >/dev/null && ! command -v prometheus-alertmanager >/dev/null; then
  if ! { command -v apt-get >/dev/null && $SUDO apt-get update -qq \
         && $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus-alertmanager; }; then
    if [ "${CI:-}" = "true" ]; then echo "cannot install prometheus-alertmanager" >&2; exit 1; fi
    echo "warning: could not install prometheus-alertmanager; the Alertmanager tests will skip" >&2
  fi
fi

# A virtualenv of the project's own: torch is the CPU build that lies on this disk (pinned, so pip
# never reaches for a multi-GB CUDA build), then the project with its dev extra.
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
python -m pip install -q -e '.[dev]'

echo "== ruff"
ruff check .
echo "== mypy --strict (through a symlinked fp8guard/ tree, since the folders map to fp8guard.* only when installed)"
rm -rf .typecheck && mkdir -p .typecheck/fp8guard
for f in fp8guard/*.py fp8guard/py.typed; do ln -s "$PWD/$f" .typecheck/fp8guard/; done
for d in agent service dashboards migrations; do ln -s "$PWD/$d" ".typecheck/fp8guard/$d"; done
(cd .typecheck && mypy --config-file ../pyproject.toml -p fp8guard)
echo "== pytest"
python -m pytest -m "" "$@"  # every tier: the slow stories too (a plain `pytest` runs the fast tier)
