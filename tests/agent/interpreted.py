"""Run a snippet in a fresh interpreter under Triton's CPU interpreter (``TRITON_INTERPRET=1``).

Triton reads the variable when it is imported, so each check needs a process of its own; the
snippet prints its result as JSON on its last line, which is returned parsed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_interpreted(code: str, timeout: float = 600) -> Any:
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
