"""The agent stays light and the service never needs torch; checked in fresh interpreters."""

from __future__ import annotations

import subprocess
import sys

import pytest


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print('\\n'.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(out.split())


def test_service_never_imports_torch() -> None:
    mods = _loaded_after("import fp8guard.service, fp8guard.service.app, fp8guard.cli")
    assert "torch" not in mods


def test_agent_imports_no_service_dependencies() -> None:
    pytest.importorskip("torch")
    mods = _loaded_after("import fp8guard.agent")
    for heavy in ("fastapi", "sqlalchemy", "pydantic", "fp8guard.service", "starlette", "alembic", "triton",
                  "nvdlfw_inspect"):
        assert heavy not in mods, f"importing fp8guard.agent pulled in {heavy}"


def test_wire_is_standard_library_only() -> None:
    mods = _loaded_after("import fp8guard.wire")
    assert not {"numpy", "torch", "pydantic", "fastapi"} & mods


def test_no_generic_top_level_packages_installed() -> None:
    import importlib.util

    for name in ("agent", "service", "dashboards", "migrations"):
        spec = importlib.util.find_spec(name)
        # running from the repository root puts the folders themselves on sys.path; they must not be
        # importable from anywhere else (i.e. installed as top-level packages)
        if spec is not None and spec.origin is not None:
            assert "site-packages" not in spec.origin, f"{name} is installed as a top-level package"


def _imports(path: str) -> set[str]:
    import ast
    from pathlib import Path

    out: set[str] = set()
    for file in Path(path).rglob("*.py"):
        for node in ast.walk(ast.parse(file.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
    return out


def test_stages_keep_to_their_job() -> None:
    """The store persists and reads: it imports neither detection nor alerts; nothing outside the
    store touches its ORM models."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "service"
    store = _imports(str(root / "store"))
    assert not {m for m in store if m.startswith(("fp8guard.service.loop", "fp8guard.service.alerts"))}
    for stage in ("ingest", "loop", "alerts", "queries", "web"):
        assert "fp8guard.service.store.models" not in _imports(str(root / stage)), stage
    assert not {m for m in _imports(str(root / "loop")) if m.startswith("fp8guard.service.queries")}
