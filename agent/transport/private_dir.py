"""Per-user private folders for the spool: spooled batches are a run's telemetry, so they must not
sit at a predictable path in the shared temp folder, where another user could read them, plant
files that get backfilled as this run's data, or swap the folder for a link.

The default root is the user cache folder as ``platformdirs`` computes it (no new dependency:
the agent imports only torch, httpx and the standard library); if that cannot be created (a
read-only home), ``<tempdir>/fp8guard-<uid>``. Every folder from the ``fp8guard`` root down is
created with mode 0700 and refused if it exists owned by another user or writable by others.
"""

from __future__ import annotations

import contextlib
import os
import stat
import sys
import tempfile
from pathlib import Path

__all__ = ["UnsafeDirectory", "default_spool_root", "ensure_private_dir", "user_cache_root"]


class UnsafeDirectory(PermissionError):
    """A folder on the spool's path that another user owns or may write to."""


def user_cache_root() -> Path:
    """``<user cache dir>/fp8guard``: XDG_CACHE_HOME or ~/.cache on Linux, ~/Library/Caches on
    macOS, %LOCALAPPDATA% on Windows (what ``platformdirs.user_cache_dir`` answers)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = str(Path.home() / "Library" / "Caches")
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else str(Path.home() / ".cache")  # the spec ignores relative paths
    return Path(base) / "fp8guard"


def default_spool_root() -> Path:
    """The root under which default spools live (``<root>/<run_id>/rank-<rank>``), created private."""
    root = user_cache_root()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        ensure_private_dir(root, root / "spool")
        return root / "spool"
    except UnsafeDirectory:
        raise  # someone else's folder at our path: refuse, never fall back silently
    except OSError:
        uid = os.getuid() if hasattr(os, "getuid") else 0
        fallback = Path(tempfile.gettempdir()) / f"fp8guard-{uid}"
        ensure_private_dir(fallback, fallback / "spool")
        return fallback / "spool"


def ensure_private_dir(root: Path, directory: Path) -> None:
    """Create ``directory`` and every folder between it and ``root`` (included) with mode 0700;
    raise :class:`UnsafeDirectory` if one of them exists but is another user's or writable by
    group or others. ``root``'s own parent must exist."""
    part = root
    for name in ("", *directory.relative_to(root).parts):
        part = part / name if name else part
        with contextlib.suppress(FileExistsError):
            part.mkdir(mode=0o700)
        _check_private(part)


def _check_private(path: Path) -> None:
    st = path.stat()  # follows links: a link to another user's folder is refused by its owner
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a folder")
    if not hasattr(os, "getuid"):  # Windows: ACLs, not modes; the profile folder is private already
        return
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); "
                              "refusing to spool telemetry there")
    if st.st_mode & 0o022:
        raise UnsafeDirectory(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o}); "
                              "refusing to spool telemetry there (chmod 700 it, or pass spool_dir=)")
