"""Shared fixtures for the probe-cache tests: an isolated default cache, sample results, a small
real disk (tmpfs)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cache_testutil import Records

from te_fl_attention.cache import ProbeCache, reset_default_cache


@pytest.fixture(autouse=True)
def _isolated_default_cache(tmp_path, monkeypatch) -> Iterator[None]:
    """Point the default cache at a temp file; never touch the user's real cache."""
    (tmp_path / "default-cache").mkdir()  # an explicit TE_FL_ATTN_CACHE's directory must exist
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "default-cache" / "probes.sqlite"))
    monkeypatch.delenv("TE_FL_ATTN_CACHE_READONLY", raising=False)
    reset_default_cache()
    yield
    reset_default_cache()


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store" / "probes.sqlite"


@pytest.fixture
def store(store_path) -> Iterator[ProbeCache]:
    cache = ProbeCache(store_path)
    yield cache
    cache.close()


@pytest.fixture
def cache_log() -> Iterator[Records]:
    logger = logging.getLogger("te_fl_attention.cache")
    handler = Records()
    old = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)


def _mount_tmpfs(where: Path, size: str) -> bool:
    where.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True).returncode == 0  # fmt: skip


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    if not _mount_tmpfs(disk, "1m"):
        pytest.skip("needs root to mount a small tmpfs")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], capture_output=True)
