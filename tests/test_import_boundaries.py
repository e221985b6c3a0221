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
