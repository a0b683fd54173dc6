"""Fleet tests: an isolated default cache and no remote tier unless a test sets one; ``sel``, a
rules-only selector."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from te_fl_attention import Selector
from te_fl_attention.cache import reset_default_cache
from te_fl_attention.probes import default_probes


@pytest.fixture(autouse=True)
def _isolated(tmp_path, monkeypatch) -> Iterator[None]:
    (tmp_path / "default-cache").mkdir()  # an explicit cache path's directory must exist
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "default-cache" / "probes.sqlite"))
    monkeypatch.delenv("TE_FL_ATTN_REMOTE_CACHE", raising=False)
    monkeypatch.delenv("TE_FL_ATTN_AGREE", raising=False)
    reset_default_cache()
    yield
    reset_default_cache()


@pytest.fixture
def sel():
    return Selector(default_probes(graph=False))
