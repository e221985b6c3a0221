"""The default spool lives in a per-user private folder (0700), never at a predictable shared
path: a folder another user owns, or one that group or others may write, is refused."""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest

from fp8guard import wire
from fp8guard.agent.transport import HttpTransport, RunInfo
from fp8guard.agent.transport.private_dir import UnsafeDirectory, default_spool_root, ensure_private_dir

URL = "http://fp8guard.test"
posix_only = pytest.mark.skipif(not hasattr(os, "getuid"), reason="POSIX owners and modes")


def _down_transport() -> HttpTransport:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)
    client = httpx.Client(base_url=URL, transport=httpx.MockTransport(refuse))
    return HttpTransport(URL, RunInfo("priv-run"), client=client, sleep=lambda s: None)


def _batch(rank: int = 0) -> dict[str, object]:
    return wire.make_batch(run_id="priv-run", rank=rank, steps=[{"step": 0, "loss": 1.0}])


@posix_only
def test_default_spool_is_created_private_under_the_user_cache(monkeypatch: pytest.MonkeyPatch,
                                                               tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    old = os.umask(0o000)  # the most permissive umask: modes must not depend on it
    try:
        t = _down_transport()
        t.send(_batch(rank=2))
    finally:
        os.umask(old)
    spool = tmp_path / "cache" / "fp8guard" / "spool" / "priv-run" / "rank-2"
    assert t.spool_dir == spool and sorted(p.name for p in spool.iterdir()) == ["000000000001.json.gz", "run.json"]
    assert (spool / "run.json").stat().st_mode & 0o777 == 0o600  # the registration (its config) too
    d = spool
    while d != tmp_path / "cache":
        assert d.stat().st_mode & 0o777 == 0o700, d
        d = d.parent
    assert t.stats().spooled_batches == 1
    t.close()


@posix_only
def test_group_or_world_writable_folder_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    planted = tmp_path / "cache" / "fp8guard"
    planted.mkdir(parents=True)
    planted.chmod(0o777)  # someone prepared it for everybody
    with pytest.raises(UnsafeDirectory, match="writable by group or others"):
        default_spool_root()
    t = _down_transport()
    t.send(_batch())  # refused, so the batch is lost: counted and to be reported, never written there
    assert list(planted.iterdir()) == []
    s = t.stats()
    assert (s.spooled_batches, s.dropped_batches, s.dropped_steps) == (0, 1, 1)
    t.close()


@posix_only
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a folder to another user")
def test_folder_of_another_user_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "fp8guard"
    root.mkdir(mode=0o700)
    os.chown(root, 12345, 12345)
    with pytest.raises(UnsafeDirectory, match="belongs to uid 12345"):
        ensure_private_dir(root, root / "spool")


@posix_only
def test_unwritable_home_falls_back_to_a_private_temp_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "cache"))  # cannot be created
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    root = default_spool_root()
    assert root == tmp_path / "tmp" / f"fp8guard-{os.getuid()}" / "spool"
    assert root.stat().st_mode & 0o777 == 0o700 and root.parent.stat().st_mode & 0o777 == 0o700


def test_explicit_spool_dir_is_used_as_given(tmp_path: Path) -> None:
    client = httpx.Client(base_url=URL, transport=httpx.MockTransport(
        lambda r: (_ for _ in ()).throw(httpx.ConnectError("refused", request=r))))
    t = HttpTransport(URL, RunInfo("priv-run"), client=client, spool_dir=tmp_path / "mine" / "spool",
                      sleep=lambda s: None)
    t.send(_batch())
    assert len(list((tmp_path / "mine" / "spool").glob("*.json.gz"))) == 1
    t.close()
