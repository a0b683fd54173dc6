"""CLI tests: an isolated default cache (no remote tier, no agreement, writable) for the tests
that run a command in this process, and a ``store`` for the ``cache`` subcommands."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# ``cache_testutil`` (keys and results of the probe-cache tests) lives beside those tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cache"))

from te_fl_attention.cache import ProbeCache, reset_default_cache  # noqa: E402


@pytest.fixture
def isolated_cache(tmp_path, monkeypatch) -> Iterator[None]:
    """Point the default cache at a temp file; never touch the user's real cache."""
    (tmp_path / "default-cache").mkdir()  # an explicit TE_FL_ATTN_CACHE's directory must exist
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "default-cache" / "probes.sqlite"))
    for name in ("TE_FL_ATTN_CACHE_READONLY", "TE_FL_ATTN_REMOTE_CACHE", "TE_FL_ATTN_AGREE"):
        monkeypatch.delenv(name, raising=False)
    reset_default_cache()
    yield
    reset_default_cache()


@pytest.fixture
def store(tmp_path) -> Iterator[ProbeCache]:
    cache = ProbeCache(tmp_path / "store" / "probes.sqlite")
    yield cache
    cache.close()
