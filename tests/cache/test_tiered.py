"""The factory: ``open_cache`` and the environment, the process-wide ``default_cache``, and a
light package import."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from cache_testutil import key, result

from te_fl_attention.cache import (
    MemoryCache,
    ProbeCache,
    default_cache,
    default_path,
    open_cache,
    reset_default_cache,
)


# ------------------------------------------------------------------------- location / environment
def test_open_cache_env(tmp_path, monkeypatch):
    for off in ("off", "0", "none", "OFF"):
        monkeypatch.setenv("TE_FL_ATTN_CACHE", off)
        assert isinstance(open_cache(), MemoryCache)
    monkeypatch.setenv("TE_FL_ATTN_CACHE", str(tmp_path / "x.sqlite"))
    c = open_cache()
    assert isinstance(c, ProbeCache) and c.path == tmp_path / "x.sqlite"
    explicit = open_cache(tmp_path / "y.sqlite")
    assert explicit.path == tmp_path / "y.sqlite"
    monkeypatch.delenv("TE_FL_ATTN_CACHE")
    assert open_cache().path == default_path()
    assert default_path().name == "probes.sqlite"


def test_default_cache_singleton(monkeypatch, tmp_path):
    a = default_cache()
    assert default_cache() is a
    a.put(key(1), result(1))
    monkeypatch.setenv("TE_FL_ATTN_CACHE", "off")
    reset_default_cache()
    b = default_cache()
    assert b is not a and isinstance(b, MemoryCache)


def test_import_is_light():
    code = ("import sys, te_fl_attention.cache, te_fl_attention.cli.cache; "
            "print(json.dumps([m for m in ('torch', 'rich') if m in sys.modules]))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": _root()}
    out = subprocess.run([sys.executable, "-c", "import json; " + code], capture_output=True,
                         text=True, check=True, env=env)  # fmt: skip
    assert json.loads(out.stdout) == []


def _root() -> str:
    import te_fl_attention

    return os.path.dirname(os.path.dirname(os.path.abspath(te_fl_attention.__file__)))
