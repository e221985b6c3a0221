"""The log of ``bench/mlflow_peer.py``: one ``[mlflow_peer]`` line on stderr per message (stdout
holds the result line alone)."""

from __future__ import annotations

import sys


def log(msg: str) -> None:
    print(f"[mlflow_peer] {msg}", file=sys.stderr, flush=True)
